"""Build the planned model from transformers' own classes and split it into the modules the plan places.

Nothing here re-implements the architecture: ``VisionTower`` and ``LanguageModel`` only hold transformers'
submodules (``model.model.visual``; ``model.model.language_model`` + ``model.lm_head``) so that each can be
parallelised as one unit, and map their parameter names back to the Hugging Face names (``hf_name``).

Shape legend: B batch (samples), L LLM sequence, N vision patches, M merged vision tokens, D hidden, V vocab.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn
from transformers import (
    AutoConfig,
    PretrainedConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

from runtime.parallel.ulysses import UlyssesGroup

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
}
"""HF ``model_type`` -> the conditional-generation class the runtime builds."""

ATTENTION = "sdpa"
"""Attention kernel of the reference model (flash-attn is an optional GPU extra, not built here)."""


def hf_config_from_dict(hf_config: dict[str, Any]) -> PretrainedConfig:
    """A transformers config from the plan's ``model.hf_config`` dict.

    Raises:
        ValueError: the model type is not one the runtime can build.
    """
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"the runtime builds {sorted(MODEL_CLASSES)} models, not model_type={model_type!r}")
    config = AutoConfig.for_model(**hf_config)
    config._attn_implementation = ATTENTION
    return config


def build_model(
    hf_config: dict[str, Any],
    *,
    seed: int,
    checkpoint: str | None = None,
    attention: str = ATTENTION,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """The full conditional-generation model in fp32 on ``device``, in training mode.

    Every rank builds the whole model before sharding it (no meta-device init yet), so a rank needs the
    memory of the full fp32 model once, at start-up.

    Args:
        hf_config: the plan's ``model.hf_config``.
        seed: random-init seed; every rank that builds with the same seed on the same device type gets the
            same weights.
        checkpoint: a local ``save_pretrained`` folder to load weights from instead of random init.
        attention: transformers attention implementation name (``sdpa`` or the runtime's registered one).
        device: where the weights are created (random init on a GPU is much faster than on CPU).
    """
    config = hf_config_from_dict(hf_config)
    cls = MODEL_CLASSES[config.model_type]
    if checkpoint is not None:
        if not os.path.isdir(checkpoint):
            raise ValueError(f"checkpoint {checkpoint} is not a folder written by save_pretrained")
        model = cls.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation=attention).to(device)
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls._from_config(config, dtype=torch.float32, attn_implementation=attention)
    return model.train()


class VisionTower(nn.Module):
    """The vision encoder (patch embed, blocks, merger) of a Qwen-VL model: ``model.model.visual``."""

    hf_prefix = "model.visual."

    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual
        self._forward: Callable[..., torch.Tensor] | None = None

    def set_forward(self, forward: Callable[..., torch.Tensor]) -> None:
        """Install the sequence-sharded forward (see runtime.parallel.ulysses.vision_forward)."""
        self._forward = forward

    def forward(self, shard: Any) -> torch.Tensor:
        """Merged tokens of this rank's window shard, in window order: [M_local, D_llm]."""
        assert self._forward is not None, "set_forward was not called"
        return self._forward(self.visual, shard)

    @staticmethod
    def hf_name(name: str) -> str:
        """HF parameter name of a parameter name of this module."""
        return VisionTower.hf_prefix + name.removeprefix("visual.")


class LanguageModel(nn.Module):
    """The decoder: ``model.model.language_model`` plus ``model.lm_head``."""

    def __init__(self, language_model: nn.Module, lm_head: nn.Linear, image_token_id: int):
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.image_token_id = image_token_id

    def forward(
        self, input_ids_BL: torch.Tensor, image_embeds_MD: torch.Tensor, position_ids_3BL: torch.Tensor,
        ulysses_group: UlyssesGroup | None = None,
    ) -> torch.Tensor:
        """Logits [B, L, V] (a DTensor sharded on V under tensor parallelism), as the HF model computes them.

        Under sequence parallelism ``L`` is this rank's slice, ``image_embeds_MD`` the image tokens in it, and
        ``ulysses_group`` (runtime.parallel.ulysses.UlyssesGroup) reaches every decoder layer's attention kernel.
        """
        embeds_BLD = self.language_model.embed_tokens(input_ids_BL)
        image_mask_BL1 = (input_ids_BL == self.image_token_id).unsqueeze(-1)
        embeds_BLD = embeds_BLD.masked_scatter(image_mask_BL1, image_embeds_MD.to(embeds_BLD.dtype))
        extra = {} if ulysses_group is None else {"ulysses_group": ulysses_group}
        hidden_BLD = self.language_model(inputs_embeds=embeds_BLD, position_ids=position_ids_3BL, **extra)
        return self.lm_head(hidden_BLD.last_hidden_state)

    @staticmethod
    def hf_name(name: str) -> str:
        """HF parameter name of a parameter name of this module."""
        if name.startswith("lm_head."):
            return name
        return "model." + name


RopeIndex = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""The model's ``get_rope_index``: (input_ids, mm_token_type_ids, image_grid_thw) -> (3-D positions, deltas)."""


def split_model(model: nn.Module) -> tuple[VisionTower, LanguageModel, RopeIndex]:
    """The vision tower, the language model, and the model's own M-RoPE position function (``get_rope_index``)."""
    vision = VisionTower(model.model.visual)
    llm = LanguageModel(model.model.language_model, model.lm_head, model.config.image_token_id)
    return vision, llm, model.model.get_rope_index

"""Build the planned model from transformers' own classes and split it into the modules the plan places.

Nothing here re-implements the architecture: the encoder towers (runtime.models.vision ``VisionTower``, the audio family's
``AudioTower``) and ``LanguageModel`` only hold transformers' submodules (``model.model.visual``;
``model.model.language_model`` + ``model.lm_head``) so that each can be
parallelised as one unit, and map their parameter names back to the Hugging Face names (``hf_name``).

The model is built on the ``meta`` device (``meta_model``: shapes, no memory); a rank materialises only its
shards (runtime.checkpoints.hf_folder.materialize), drawing each module's random init on its own (``RandomInit``), so the
full weights are the same under every plan and in the single-process ``build_model``.

Shape legend: B batch (samples), L LLM sequence, N vision patches, M merged vision tokens, D hidden, V vocab.
"""

from __future__ import annotations

import copy
import math
import hashlib
from typing import Any, Callable, Iterable

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from runtime.checkpoints.hf_folder import HFFolder, materialize
from runtime.models.families import FAMILIES
from runtime.models.loss import chunked_cross_entropy_sum, cross_entropy_sum
from runtime.parallel.attention import VARLEN_ATTENTION, packed_segments
from runtime.parallel.ulysses import UlyssesGroup

MODEL_CLASSES: dict[str, type[nn.Module]] = {model_type: f.model_class for model_type, f in FAMILIES.items()}
"""HF ``model_type`` -> the conditional-generation class the runtime builds (runtime.models.families)."""

ATTENTION = "sdpa"
"""Attention kernel of the reference model (flash-attn is an optional GPU extra, not built here)."""


def hf_config_from_dict(hf_config: dict[str, Any]) -> PretrainedConfig:
    """A transformers config from the plan's ``model.hf_config`` dict.

    Raises:
        ValueError: the model type is not one the runtime can build, or transformers refuses a field of the config
            (one line: its own message, joined).
    """
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"the runtime builds {sorted(MODEL_CLASSES)} models, not model_type={model_type!r}")
    try:
        config = AutoConfig.for_model(**hf_config)
    except (StrictDataclassError, ValueError, TypeError) as e:
        raise ValueError(f"model.hf_config is not a config transformers builds: {' '.join(str(e).split())}") from None
    config._attn_implementation = ATTENTION
    return config


def meta_model(hf_config: dict[str, Any], *, attention: str = ATTENTION) -> nn.Module:
    """The conditional-generation model on the ``meta`` device (shapes only, no memory), in training mode."""
    config = hf_config_from_dict(hf_config)
    with torch.device("meta"):
        model = MODEL_CLASSES[config.model_type]._from_config(
            config, dtype=torch.float32, attn_implementation=attention
        )
    return model.train()


def module_seed(seed: int, hf_module_name: str) -> int:
    """Random-init seed of one module: a stable hash of the run's seed and the module's HF name (not Python's
    per-process salted ``hash``), so every rank and every plan draws the same weights for it."""
    digest = hashlib.sha256(f"{seed}:{hf_module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RandomInit:
    """The model's own Hugging Face init (``_init_weights``), one module at a time, each module from its own seed
    (``module_seed``): a module's full weights are the same whichever rank draws them and however they are
    sharded, and drawing one costs one module's full fp32 tensors on CPU, not the model's. A parameter its
    module's ``_init_weights`` leaves unset is drawn by its parent's, as HF's whole-model init would (Qwen3.5-MoE's
    router weight: its sparse MoE block initialises it).

    Also the source of non-persistent buffers (rotary ``inv_freq``), which no checkpoint holds.
    """

    def __init__(self, meta: nn.Module, seed: int):
        """``meta``: an unsharded ``meta_model`` (kept as the template of every module)."""
        self.meta, self.seed = meta, seed
        self.owners = {name: m for name, m in meta.named_modules() if isinstance(m, PreTrainedModel)}
        self._cached: tuple[str, nn.Module] | None = None

    def read(self, hf_name: str, index: tuple[slice, ...], shape: torch.Size) -> torch.Tensor:
        """``index`` of the initial value of parameter or buffer ``hf_name`` (full ``shape``, HF layout)."""
        module_name, _, attr = hf_name.rpartition(".")
        value = getattr(self._initialized(module_name), attr)
        assert value.shape == shape, (hf_name, value.shape, shape)
        return value[index]

    def release(self) -> None:
        """Drop the module drawn last (once every shard is filled)."""
        self._cached = None

    def _initialized(self, module_name: str) -> nn.Module:
        if self._cached is None or self._cached[0] != module_name:
            self._cached = None  # free the previous module first
            module = self._drawn(module_name, module_name)
            if any(p.isnan().any() for p in module.parameters(recurse=False)):
                # HF initialises some parameters from their parent's _init_weights (Qwen3.5-MoE's router weight,
                # from its sparse MoE block's)
                parent_name, _, child = module_name.rpartition(".")
                module = self._drawn(parent_name, module_name, child=child).get_submodule(child)
            self._cached = (module_name, module)
        return self._cached[1]

    def _drawn(self, module_name: str, seed_name: str, child: str = "") -> nn.Module:
        """A copy of module ``module_name`` (and of its submodule ``child``) with storage for its own parameters
        and buffers, filled by HF's ``_init_weights`` drawing from ``seed_name``'s seed; a parameter it leaves
        unset is NaN."""
        module = copy.deepcopy(self.meta.get_submodule(module_name)).to_empty(device="cpu", recurse=False)
        if child:
            module.get_submodule(child).to_empty(device="cpu", recurse=False)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for p in (module.get_submodule(child) if child else module).parameters(recurse=False):
                p.fill_(math.nan)
            torch.manual_seed(module_seed(self.seed, seed_name))
            self._owner(module_name)._init_weights(module)
        return module

    def _owner(self, module_name: str) -> PreTrainedModel:
        """The innermost HF (sub-)model holding the module: its ``_init_weights`` and config apply, as in HF's
        own ``initialize_weights``."""
        parts = module_name.split(".")
        for end in range(len(parts), -1, -1):
            owner = self.owners.get(".".join(parts[:end]))
            if owner is not None:
                return owner
        raise AssertionError(f"no PreTrainedModel holds {module_name}")


def build_model(
    hf_config: dict[str, Any],
    *,
    seed: int,
    checkpoint: str | None = None,
    attention: str = ATTENTION,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """The whole (unsharded) conditional-generation model in fp32 on ``device``, in training mode.

    Its weights are exactly the full weights every parallel plan materialises shard by shard (runtime.training.trainer):
    the same ``RandomInit`` draws, or the same checkpoint tensors.

    Args:
        hf_config: the plan's ``model.hf_config``.
        seed: random-init seed (``module_seed``).
        checkpoint: a Hugging Face folder (``save_pretrained`` or as downloaded from the Hub) to load weights
            from instead of random init.
        attention: transformers attention implementation name (``sdpa`` or the runtime's registered one).
        device: where the weights are placed (``meta``: shapes only, nothing is read or drawn).
    """
    model = meta_model(hf_config, attention=attention)
    if torch.device(device).type == "meta":
        return model
    init = RandomInit(copy.deepcopy(model), seed)
    params = init if checkpoint is None else HFFolder(checkpoint)
    materialize(model, hf_name=lambda name: name, params=params, buffers=init, device=torch.device(device))
    init.release()
    return model


class LanguageModel(nn.Module):
    """The decoder: ``model.model.language_model`` plus ``model.lm_head``."""

    def __init__(self, language_model: nn.Module, lm_head: nn.Linear, visual_token_ids: tuple[int, ...]):
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.visual_token_ids = visual_token_ids
        """The image and video pad tokens: where the hand-off's rows go, in sequence order."""

    def forward(
        self, input_ids_BL: torch.Tensor, image_rows_MW: torch.Tensor, position_ids_3BL: torch.Tensor,
        ulysses_group: UlyssesGroup | None = None, targets_BL: torch.Tensor | None = None, loss_chunk_tokens: int = 0,
    ) -> torch.Tensor:
        """Logits [B, L, V] (a DTensor sharded on V under tensor parallelism), as the HF model computes them, from
        the image tokens' hand-off rows (``embed_image_rows``); with ``targets_BL``, their cross-entropy summed
        over the positions with a target instead (runtime.models.loss: ``loss_chunk_tokens`` at a time when positive).

        Under sequence parallelism ``L`` is this rank's slice, ``image_rows_MW`` the image tokens in it, and
        ``ulysses_group`` (runtime.parallel.ulysses.UlyssesGroup) reaches every decoder layer's attention kernel.
        """
        decoder = self.language_model
        hidden_BLD, injection = embed_image_rows(decoder, input_ids_BL, image_rows_MW, self.visual_token_ids)
        hidden_BLD = decoder_forward(decoder, hidden_BLD, position_ids_3BL, enumerate(decoder.layers),
                                     ulysses_group=ulysses_group, injection=injection)
        hidden_BLD = decoder.norm(hidden_BLD)
        if targets_BL is None:
            return self.lm_head(hidden_BLD)
        if loss_chunk_tokens:
            return chunked_cross_entropy_sum(self.lm_head, hidden_BLD, targets_BL, loss_chunk_tokens)
        return cross_entropy_sum(self.lm_head(hidden_BLD), targets_BL)

    @staticmethod
    def hf_name(name: str) -> str:
        """HF parameter name of a parameter name of this module."""
        if name.startswith("lm_head."):
            return name
        return "model." + name


Injection = tuple[torch.Tensor, tuple[torch.Tensor, ...]]
"""(image mask [B, L, 1], the features [M, D] decoder layer k's output receives there, k = 0, 1, ...)."""


def embed_image_rows(decoder: nn.Module, input_ids_BL: torch.Tensor, rows_MW: torch.Tensor,
                     visual_token_ids: tuple[int, ...]) -> tuple[torch.Tensor, Injection | None]:
    """The token embeddings with each image or video token's merged output in place (the rows in sequence order),
    and what the first decoder layers receive besides: a hand-off row is the merged output [D] followed by one
    feature [D] per injection level (Qwen3-VL's DeepStack; none for Qwen2-VL and Qwen2.5-VL)."""
    embeds_BLD = decoder.embed_tokens(input_ids_BL)
    device_type = embeds_BLD.device.type
    if torch.is_autocast_enabled(device_type):
        # the residual stream in the compute dtype, as under FSDP2's bf16 parameters: the fp32 table's rows would
        # keep it fp32 through every layer (autocast casts only the projections), doubling what recomputation
        # saves per layer
        embeds_BLD = embeds_BLD.to(torch.get_autocast_dtype(device_type))
    width = embeds_BLD.shape[-1]
    image_mask_BL1 = torch.isin(input_ids_BL, torch.tensor(visual_token_ids, device=input_ids_BL.device)).unsqueeze(-1)
    embeds_BLD = embeds_BLD.masked_scatter(image_mask_BL1, rows_MW[..., :width].to(embeds_BLD.dtype))
    features = tuple(rows_MW[..., width:].split(width, dim=-1)) if rows_MW.shape[-1] > width else ()
    return embeds_BLD, (image_mask_BL1, features) if features else None


def decoder_forward(decoder: nn.Module, hidden_BLD: torch.Tensor, position_ids: torch.Tensor,
                    layers: Iterable[tuple[int, nn.Module]], *, ulysses_group: UlyssesGroup | None,
                    injection: Injection | None) -> torch.Tensor:
    """``layers`` (index, layer) of the text model ``decoder`` on ``hidden_BLD``, as its own forward runs them
    (``Qwen2_5_VLTextModel``, ``Qwen3VLTextModel``, ``Qwen2Model``): 4 position rows are packed samples (row 0 the
    text positions the mask is made from), 3 rows (M-RoPE) or 1 row (1-D RoPE) plain causal; linear-attention layers
    (Qwen3.5) take the packed samples' bounds instead (runtime.models.linear_attention); layer ``k``'s output receives
    ``injection``'s feature ``k`` at the
    image positions (``Qwen3VLTextModel._deepstack_process``; added as a scatter of the features onto zeros, the
    same sums, without a data-dependent shape). No KV cache: transformers would otherwise fill one in training."""
    text_positions = None
    if position_ids.shape[0] == 4:
        text_positions, position_ids = position_ids[0], position_ids[1:]
    elif position_ids.shape[0] == 1:  # 1-D RoPE: the decoder's rotary embedding takes [B, L]
        position_ids = position_ids[0]
    mask_kwargs = dict(config=decoder.config, inputs_embeds=hidden_BLD, attention_mask=None, cache=None,
                       position_ids=text_positions)
    layer_types = getattr(decoder.config, "layer_types", None)
    masks = {"full_attention": create_causal_mask(**mask_kwargs)}
    if "sliding_attention" in (layer_types or ()):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
    # linear-attention layers take no mask (no padding) but where a packed row's samples start (under SP: the
    # group's segments of the whole sequence)
    linear = {} if ulysses_group is None else {"ulysses_group": ulysses_group}
    if "linear_attention" in (layer_types or ()):
        masks["linear_attention"] = None
        if text_positions is not None and ulysses_group is None:
            linear["cu_seq_lens_q"], _ = packed_segments(text_positions)
    position_embeddings = decoder.rotary_emb(hidden_BLD, position_ids)
    extra = {} if ulysses_group is None else {"ulysses_group": ulysses_group}
    if decoder.config._attn_implementation == VARLEN_ATTENTION and ulysses_group is None:  # one bound for all layers
        rows = text_positions if text_positions is not None else torch.arange(
            hidden_BLD.shape[1], device=hidden_BLD.device).expand(hidden_BLD.shape[:2])
        extra["cu_seq_lens_q"], extra["max_length_q"] = packed_segments(rows)
    for index, layer in layers:
        kind = layer_types[index] if layer_types else "full_attention"
        hidden_BLD = layer(hidden_BLD, attention_mask=masks[kind], position_embeddings=position_embeddings,
                           position_ids=text_positions, use_cache=False,
                           **(linear if kind == "linear_attention" else extra))
        if injection is not None and index < len(injection[1]):
            mask_BL1, features = injection
            hidden_BLD = hidden_BLD + torch.zeros_like(hidden_BLD).masked_scatter(
                mask_BL1, features[index].to(hidden_BLD.dtype))
    return hidden_BLD


RopeIndex = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""The model's ``get_rope_index``: (input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw) -> (3-D positions,
deltas)."""


def split_model(model: nn.Module) -> tuple[nn.Module, LanguageModel, RopeIndex]:
    """The encoder tower (runtime.models.families: the family's ``encoder``), the language model, and the model's own
    position function (M-RoPE ``get_rope_index``, or plain positions)."""
    return FAMILIES[model.config.model_type].encoder.split_model(model, LanguageModel)

"""Qwen2-Audio on the runtime: ``model.model.audio_tower`` (a Whisper-style encoder: two convolutions, learned
positions, pre-norm blocks, 2x average pooling, a final norm) and ``model.model.multi_modal_projector`` hand one
tensor per audio token to ``model.model.language_model`` (a Qwen2 decoder with 1-D RoPE).

Every clip is one whole encoder pass (``max_source_positions`` positions, ``2 *`` as many mel frames), as the
planner prices it; Ulysses SP splits a micro-batch's clips, laid end to end, on pooling pairs, and every block
attends within its clip (one segment per clip).

Shape legend: C clips of the micro-batch, M mel bins, F mel frames per clip, T encoder positions per clip, n this
rank's positions, D encoder width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import Qwen2AudioForConditionalGeneration

from planner.contract.families.qwen2_audio import POOL_STRIDE, WHISPER_MEL_FRAMES_PER_SECOND
from planner.contract.rules import attention_rules, width_rule
from runtime.data.samples import ordinary_ids
from runtime.models.families.family import RuntimeFamily
from runtime.parallel.ulysses import UlyssesGroup, split_windows

BLOCK_TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.out_proj": RowwiseParallel(),
    "fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
}
"""An encoder block: attention heads and the MLP's width split (Megatron-LM, Shoeybi et al. 2019); the
convolutions, norms and projector stay replicated (the planner's TP_SPLIT_KINDS)."""
MARKER_OFFSETS = (1, 2)
"""``<|audio_bos|>`` and ``<|audio_eos|>`` follow ``<|AUDIO|>`` in Qwen2-Audio's vocabulary (151646, 151647,
151648): their ids are the audio token's plus these."""


def handoff_tensors(config: Any) -> int:
    """One projected tensor per audio token."""
    return 1


class AudioTower(nn.Module):
    """The audio encoder and its projector into the LLM's width."""

    def __init__(self, audio: nn.Module, projector: nn.Module):
        super().__init__()
        self.audio, self.projector = audio, projector

    @property
    def blocks(self) -> list[nn.Module]:
        """The repeated blocks (FSDP units)."""
        return list(self.audio.layers)

    @property
    def pretrained(self) -> nn.Module:
        """The transformers model whose layers recomputation wraps."""
        return self.audio

    def forward(self, shard: AudioShard) -> torch.Tensor:
        return audio_forward(self, shard)

    @staticmethod
    def hf_name(name: str) -> str:
        """HF parameter name of a parameter name of this module."""
        if name.startswith("projector."):
            return "model.multi_modal_projector." + name.removeprefix("projector.")
        return "model.audio_tower." + name.removeprefix("audio.")


def split_model(model: nn.Module, language_model: Any) -> tuple[AudioTower, nn.Module, Any]:
    """The audio tower, the language model (``language_model(decoder, lm_head, handoff token ids)``) and its
    position function (1-D RoPE: ``text_positions``)."""
    tower = AudioTower(model.model.audio_tower, model.model.multi_modal_projector)
    llm = language_model(model.model.language_model, model.lm_head, (model.config.audio_token_id,))
    return tower, llm, text_positions


def text_positions(input_ids: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
    """[1, B, L] positions 0..L-1 of each row (what the Qwen2 decoder computes without ``position_ids``), one row
    where M-RoPE has three (runtime.models.model ``decoder_forward``)."""
    return torch.arange(input_ids.shape[-1]).expand(1, *input_ids.shape), None


def parallelize_tp(tower: AudioTower, mesh: Any) -> None:
    """Shard every encoder block over the ``tp`` mesh; each attention module then holds its rank's heads."""
    tp = mesh.size()
    for layer in tower.audio.layers:
        parallelize_module(layer, mesh, BLOCK_TP_PLAN)
        layer.self_attn.num_heads //= tp


def rules(tp: int, sp: int, config: Any) -> list[str]:
    """Why the encoder cannot run at these degrees (planner.contract.rules, as the planner checks them)."""
    ac = config.audio_config
    reasons = attention_rules(tp, sp, ac.encoder_attention_heads, ac.encoder_attention_heads, "the audio encoder")
    problem = width_rule(tp, ac.encoder_ffn_dim, "MLP hidden width of the audio blocks")
    return reasons + ([problem] if problem else [])


def pooled_bounds(clips: int, config: Any, sp: int) -> list[int]:
    """Encoder-position boundaries of ``sp`` near-equal parts of ``clips`` clips laid end to end, on pooling
    pairs (runtime.parallel.ulysses ``split_windows`` over pairs)."""
    positions = clips * config.max_source_positions
    return split_windows(list(range(0, positions + 1, POOL_STRIDE)), sp)


def output_positions_per_rank(clips: int, config: Any, sp: int) -> list[torch.Tensor]:
    """Index (among the micro-batch's audio tokens) of the tokens each of ``sp`` SP ranks emits."""
    bounds = pooled_bounds(clips, config, sp)
    return [torch.arange(a // POOL_STRIDE, b // POOL_STRIDE) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass(kw_only=True, frozen=True)
class AudioShard:
    """This rank's inputs for one audio micro-batch."""

    input_features_CMF: torch.Tensor
    """Every clip's log-mel features (the convolutions run on whole clips)."""
    start: int
    """First encoder position (of the clips laid end to end) this rank runs."""
    end: int
    """One past its last."""
    ulysses: UlyssesGroup | None
    """The SP group when the positions are split, else None."""


def shard(batch: dict[str, torch.Tensor], config: Any, *, sp_rank: int, sp_group: Any, sp: int) -> AudioShard:
    """The part of a replica's clips SP rank ``sp_rank`` of ``sp`` runs."""
    features = batch["input_features"]
    ac = config.audio_config
    bounds = pooled_bounds(len(features), ac, sp)
    ulysses = None
    if sp > 1:
        ulysses = UlyssesGroup(group=sp_group, rank=sp_rank, segment_lens=(ac.max_source_positions,) * len(features),
                               seq_lens=tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])))
    return AudioShard(input_features_CMF=features, start=bounds[sp_rank], end=bounds[sp_rank + 1], ulysses=ulysses)


def audio_forward(tower: AudioTower, shard: AudioShard) -> torch.Tensor:
    """Projected audio tokens [m, D_llm] of this rank's positions, in clip order: ``Qwen2AudioEncoder.forward``
    (its dropouts are 0 in every released config) and the projector, on this rank's positions."""
    audio = tower.audio
    features = shard.input_features_CMF.to(audio.conv1.weight.dtype)
    hidden = F.gelu(audio.conv2(F.gelu(audio.conv1(features)))).permute(0, 2, 1)  # [C, T, D]
    hidden = hidden + audio.embed_positions.weight
    extra = {}
    if shard.ulysses is not None:
        hidden = hidden.reshape(1, -1, hidden.shape[-1])[:, shard.start:shard.end]
        extra = {"ulysses_group": shard.ulysses}
    for layer in audio.layers:
        hidden = layer(hidden, None, **extra)
    hidden = audio.avg_pooler(hidden.permute(0, 2, 1)).permute(0, 2, 1)
    return tower.projector(audio.layer_norm(hidden)).flatten(0, 1)


@dataclass(kw_only=True, frozen=True)
class AudioLayout:
    """What every sample of an audio plan looks like: whole clips, then text."""

    clips: int
    """Clips per sample."""
    mel_bins: int
    mel_frames: int
    """Mel frames per clip (a whole encoder pass)."""
    tokens_per_clip: int
    """Audio tokens each clip becomes."""
    text_tokens: int
    """Text tokens per sample, including the start and end marker of each clip."""
    audio_token_id: int
    pad_token_id: int
    text_ids: tuple[int, int]
    """[first, end) of the ids random text is drawn from."""

    @property
    def seq_len(self) -> int:
        return self.text_tokens + self.clips * self.tokens_per_clip

    def token_sequence(self, text_ids: list[int]) -> dict[str, torch.Tensor]:
        """input_ids and labels: per clip ``<|audio_bos|> <|AUDIO|>*n <|audio_eos|>``, then ``text_ids`` cut or
        padded to fit; labels -100 on the audio blocks and padding."""
        bos, eos = (self.audio_token_id + offset for offset in MARKER_OFFSETS)
        ids = [bos, *[self.audio_token_id] * self.tokens_per_clip, eos] * self.clips
        room = self.text_tokens - 2 * self.clips
        text = list(text_ids[:room])
        labels = [-100] * len(ids) + text + [-100] * (room - len(text))
        return {"input_ids": torch.tensor(ids + text + [self.pad_token_id] * (room - len(text))),
                "labels": torch.tensor(labels)}

    def template_ids(self) -> torch.Tensor:
        """The token ids of every sample where it matters to the hand-off: its audio tokens' places."""
        return self.token_sequence([])["input_ids"]

    def handoff_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Where the audio tokens are."""
        return ids == self.audio_token_id

    def output_positions_per_rank(self, samples: int, config: Any, sp: int) -> list[torch.Tensor]:
        return output_positions_per_rank(self.clips * samples, config.audio_config, sp)


def layout_from_plan(workload: Any, config: Any) -> AudioLayout:
    """The sample layout of an audio plan's workload.

    Raises:
        ValueError: the audio is not a whole number of clips, or the text cannot hold the clips' markers.
    """
    ac = config.audio_config
    clip_seconds = 2 * ac.max_source_positions / WHISPER_MEL_FRAMES_PER_SECOND
    clips = round(workload.audio_seconds / clip_seconds)
    if clips < 1 or abs(clips * clip_seconds - workload.audio_seconds) > 1e-9:
        raise ValueError(f"the runtime trains on whole {clip_seconds:g} s clips (one encoder pass each); the plan has "
                         f"{workload.audio_seconds:g} s of audio per sample: plan with a multiple of {clip_seconds:g} s")
    if workload.text_tokens < 2 * clips + 1:
        raise ValueError(f"{workload.text_tokens} text tokens cannot hold a start and end marker for each of {clips} "
                         "clips plus one text token")
    text = config.get_text_config()
    text_ids = ordinary_ids(text.vocab_size, [config.audio_token_id + k for k in (0, *MARKER_OFFSETS)])
    return AudioLayout(clips=clips, mel_bins=ac.num_mel_bins, mel_frames=2 * ac.max_source_positions,
                       tokens_per_clip=ac.max_source_positions // POOL_STRIDE, text_tokens=workload.text_tokens,
                       audio_token_id=config.audio_token_id,
                       pad_token_id=text.pad_token_id if text.pad_token_id is not None else 0, text_ids=text_ids)


class SyntheticAudio:
    """Random log-mel features (uniform in [-1, 1], the range of Whisper's normalised features) and random text of
    the planned shape; sample i is fixed by (seed, i)."""

    def __init__(self, layout: AudioLayout, seed: int):
        self.layout, self.seed = layout, seed

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, index])
        layout = self.layout
        features = rng.uniform(-1, 1, (layout.clips, layout.mel_bins, layout.mel_frames)).astype(np.float32)
        text = rng.integers(*layout.text_ids, layout.text_tokens - 2 * layout.clips).tolist()
        return {"input_features": torch.from_numpy(features),
                "feature_attention_mask": torch.ones(layout.clips, layout.mel_frames, dtype=torch.long),
                **layout.token_sequence(text)}


class AudioEncoder:
    """The runtime's encoder interface (runtime.models.families ``Encoder``) for the audio tower."""

    name = "audio"
    split_model = staticmethod(split_model)
    parallelize_tp = staticmethod(parallelize_tp)
    rules = staticmethod(rules)
    shard = staticmethod(shard)
    layout_from_plan = staticmethod(layout_from_plan)
    synthetic = SyntheticAudio

    @staticmethod
    def config(config: Any) -> Any:
        return config.audio_config

    @staticmethod
    def row_order(local_name: str, tp: int, rows: int) -> None:
        """No parameter is stored in another row order than transformers'."""
        return None

    @staticmethod
    def missing_hooks() -> list[str]:
        """None: the encoder is written out here, not built from hooks."""
        return []


FAMILY = RuntimeFamily(model_type="qwen2_audio", model_class=Qwen2AudioForConditionalGeneration,
                       encoder=AudioEncoder(), handoff_tensors=handoff_tensors, llm_layer_tp_plan={})
"""The runtime's half of the family (runtime.models.families.family); its decoder layers take the common TP plan."""

"""One rank's shard of each Qwen2.5-VL and Qwen3.5 layer type, built from transformers' own layer classes.

TP = t divides what Megatron-style tensor parallelism divides: attention heads (kv heads too, replicated when
there are fewer than t), the MLP's intermediate width, the merger's hidden width and the vocabulary. Ulysses
SP = s gives a rank 1/s of the tokens for norms and MLPs and, inside attention, the whole sequence with 1/s of
the heads. The all-to-all that re-shards between the two is simulated by a local reshape of the same number of
elements (the data is not the real neighbour's, the shapes and the copy are); its communication is costed from
the collective profile.

Qwen3.5: its vision block, patch embedding (with the learned position table Qwen3-VL-style towers interpolate) and
merger, and both decoder layer types: a Gated DeltaNet layer (transformers' torch chunked delta rule and causal conv
where fla is not installed, one sequence per sample) and a gated full-attention layer, TP-split by building the layer
from a config with 1/tp of every head kind and of the MLP width. A Gated DeltaNet layer is measured without Ulysses
SP (the runtime exchanges its projections, not heads of an attention: not simulated here).

Legend: B micro-batch, S tokens per sample (before SP), L local tokens (S/sp), H heads, D head width.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionPatchEmbed,
    Qwen2_5_VLDecoderLayer,
    Qwen2_5_VLPatchMerger,
    Qwen2_5_VLRMSNorm,
    Qwen2_5_VLVisionBlock,
)
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5TextRotaryEmbedding,
    Qwen3_5VisionBlock,
    Qwen3_5VisionPatchEmbed,
    Qwen3_5VisionPatchMerger,
)

from planner.contract.models import LayerSpec

SEGMENTED_SDPA = "segmented_sdpa_flash_varlen_api"
"""Our attention function's registered name. It contains "flash" so that transformers' vision attention hands it the
varlen arguments (cu_seqlens, max_seqlen) the way it does flash-attention, instead of splitting the sequence with
``cu_seqlens.tolist()``, which fake tensors cannot do; the segments arrive as Python ints in ``segments``."""


def _seq_to_heads(x_BHLD: torch.Tensor, degree: int) -> torch.Tensor:
    """Ulysses' first all-to-all as a local reshape: (B, H, S/d, D) -> (B, H/d, S, D); heads replicated up to d."""
    b, h, l, d = x_BHLD.shape
    if h < degree:
        x_BHLD = x_BHLD.repeat_interleave(degree // h, dim=1)
        h = degree
    return x_BHLD.reshape(b, h // degree, l * degree, d)


_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "sliding_window")


def segmented_sdpa_attention(module, query, key, value, attention_mask, *, ulysses_degree=1, segments=None, **kw):
    """Attention as one Ulysses rank computes it: the full sequence with 1/degree of the heads (degree 1: plain
    SDPA), SDPA per segment (window / image) when ``segments`` are given, else over the whole sequence."""
    b, heads_q, local, d = query.shape
    for name in _VARLEN_KWARGS:
        kw.pop(name, None)
    q, k, v = (_seq_to_heads(t, ulysses_degree) for t in (query, key, value))
    if segments is None:
        out_BSHD, _ = sdpa_attention_forward(module, q, k, v, attention_mask, **kw)
    else:
        parts = zip(*(torch.split(t, segments, dim=2) for t in (q, k, v)))
        out_BSHD = torch.cat([sdpa_attention_forward(module, *p, None, **kw)[0] for p in parts], dim=1)
    return out_BSHD.reshape(b, local, heads_q, d), None


AttentionInterface.register(SEGMENTED_SDPA, segmented_sdpa_attention)


def _shrink_linear(linear: nn.Linear, *, out_div: int = 1, in_div: int = 1) -> nn.Linear:
    """A column- (out_div) or row-parallel (in_div) shard of ``linear``."""
    if linear.out_features % out_div or linear.in_features % in_div:
        raise NotImplementedError(
            f"a {linear.in_features}x{linear.out_features} linear does not split {in_div}x{out_div} ways"
        )
    return nn.Linear(linear.in_features // in_div, linear.out_features // out_div, bias=linear.bias is not None)


def _shard_mlp_(mlp: nn.Module, tp: int) -> None:
    """Megatron MLP split: gate/up column-parallel, down row-parallel."""
    mlp.gate_proj = _shrink_linear(mlp.gate_proj, out_div=tp)
    mlp.up_proj = _shrink_linear(mlp.up_proj, out_div=tp)
    mlp.down_proj = _shrink_linear(mlp.down_proj, in_div=tp)


def _check_divides(what: str, count: int, degree: int) -> None:
    if count % degree:
        raise NotImplementedError(f"{what} = {count} does not split {degree} ways")


def _with_attention(config, segmented: bool):
    config = copy.copy(config)
    config._attn_implementation = SEGMENTED_SDPA if segmented else "sdpa"
    return config


def _local_tokens(tokens: int, sp: int) -> int:
    if tokens % sp:
        raise ValueError(f"{tokens} tokens do not split into {sp} sequence-parallel shards")
    return tokens // sp


@dataclass(kw_only=True)
class ShardInputs:
    """Inputs of one shard forward: ``x`` (the differentiable input, or ids) and static keyword arguments."""

    x: torch.Tensor
    kwargs: dict


class LayerShard(nn.Module):
    """A layer shard with its own input factory; ``forward(x, **kwargs)`` returns what backward starts from."""

    def __init__(self, layer: nn.Module, *, tp: int, sp: int) -> None:
        super().__init__()
        self.layer, self.tp, self.sp = layer, tp, sp

    def inputs(self, seq_len: int, micro_batch: int, *, dtype: torch.dtype, device: torch.device) -> ShardInputs:
        raise NotImplementedError("each layer type defines its inputs")


class VisionBlockShard(LayerShard):
    """Qwen2_5_VLVisionBlock on (B*L, hidden); window blocks attend within windows, full blocks within images."""

    def __init__(self, config, *, window_patches: int | None, tp: int, sp: int) -> None:
        _check_divides("vision heads", config.num_heads, tp * sp)
        block = Qwen2_5_VLVisionBlock(_with_attention(config, segmented=True))
        dim = config.hidden_size
        block.attn.qkv = _shrink_linear(block.attn.qkv, out_div=tp)
        block.attn.proj = _shrink_linear(block.attn.proj, in_div=tp)
        block.attn.num_heads = config.num_heads // tp
        _shard_mlp_(block.mlp, tp)
        super().__init__(block, tp=tp, sp=sp)
        self.window_patches, self.head_dim = window_patches, dim // config.num_heads

    def _segments(self, seq_len: int, micro_batch: int) -> list[int]:
        size = self.window_patches or seq_len
        per_image = [size] * (seq_len // size) + ([seq_len % size] if seq_len % size else [])
        return per_image * micro_batch

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len * micro_batch, self.sp)
        segments = self._segments(seq_len, micro_batch)
        kwargs = {
            "cu_seqlens": torch.tensor([0, local], dtype=torch.int32, device=device),
            "max_seqlen": local,
            "position_embeddings": (
                torch.ones(local, self.head_dim, dtype=dtype, device=device),
                torch.zeros(local, self.head_dim, dtype=dtype, device=device),
            ),
            "ulysses_degree": self.sp,
            "segments": segments,
        }
        x = torch.randn(local, self.layer.norm1.weight.shape[0], dtype=dtype, device=device, requires_grad=True)
        return ShardInputs(x=x, kwargs=kwargs)

    def forward(self, x, **kwargs):
        return self.layer(x, **kwargs)


class PatchMergerShard(LayerShard):
    """Qwen2_5_VLPatchMerger on (B*L, vision hidden) -> (B*L/merge^2, LLM hidden); its MLP split Megatron-style."""

    def __init__(self, vision_config, *, tp: int, sp: int) -> None:
        merger = Qwen2_5_VLPatchMerger(
            dim=vision_config.out_hidden_size,
            context_dim=vision_config.hidden_size,
            spatial_merge_size=vision_config.spatial_merge_size,
        )
        merger.mlp[0] = _shrink_linear(merger.mlp[0], out_div=tp)
        merger.mlp[2] = _shrink_linear(merger.mlp[2], in_div=tp)
        super().__init__(merger, tp=tp, sp=sp)
        self.unit = vision_config.spatial_merge_size**2

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len * micro_batch, self.sp * self.unit) * self.unit
        x = torch.randn(local, self.layer.ln_q.weight.shape[0], dtype=dtype, device=device, requires_grad=True)
        return ShardInputs(x=x, kwargs={})

    def forward(self, x):
        return self.layer(x)


class PatchEmbedShard(LayerShard):
    """Qwen2_5_VisionPatchEmbed (Conv3d patchifier), replicated under TP; tokens split under SP."""

    def __init__(self, vision_config, *, tp: int, sp: int) -> None:
        embed = Qwen2_5_VisionPatchEmbed(
            patch_size=vision_config.patch_size,
            temporal_patch_size=vision_config.temporal_patch_size,
            in_channels=vision_config.in_channels,
            embed_dim=vision_config.hidden_size,
        )
        super().__init__(embed, tp=tp, sp=sp)
        self.in_features = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len * micro_batch, self.sp)
        return ShardInputs(x=torch.randn(local, self.in_features, dtype=dtype, device=device), kwargs={})

    def forward(self, x):
        return self.layer(x)


class DecoderLayerShard(LayerShard):
    """Qwen2_5_VLDecoderLayer on (B, L, hidden): GQA heads, kv heads and the SwiGLU width divided by TP."""

    def __init__(self, text_config, *, tp: int, sp: int) -> None:
        heads, kv_heads = text_config.num_attention_heads, text_config.num_key_value_heads
        _check_divides("attention heads", heads, tp * sp)
        kv_local = max(kv_heads // tp, 1)
        layer = Qwen2_5_VLDecoderLayer(_with_attention(text_config, segmented=sp > 1), layer_idx=0)
        attn = layer.self_attn
        attn.q_proj = _shrink_linear(attn.q_proj, out_div=tp)
        attn.k_proj = _shrink_linear(attn.k_proj, out_div=kv_heads // kv_local)
        attn.v_proj = _shrink_linear(attn.v_proj, out_div=kv_heads // kv_local)
        attn.o_proj = _shrink_linear(attn.o_proj, in_div=tp)
        attn.num_key_value_groups = (heads // tp) // kv_local
        _shard_mlp_(layer.mlp, tp)
        super().__init__(layer, tp=tp, sp=sp)
        self.hidden, self.head_dim = text_config.hidden_size, attn.head_dim

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len, self.sp)
        rope = torch.ones(micro_batch, local, self.head_dim, dtype=dtype, device=device)
        kwargs = {"position_embeddings": (rope, torch.zeros_like(rope))}
        if self.sp > 1:
            kwargs["ulysses_degree"] = self.sp
        x = torch.randn(micro_batch, local, self.hidden, dtype=dtype, device=device, requires_grad=True)
        return ShardInputs(x=x, kwargs=kwargs)

    def forward(self, x, **kwargs):
        return self.layer(x, **kwargs)


class EmbeddingShard(LayerShard):
    """Token embedding with the vocabulary split over TP (Megatron VocabParallelEmbedding's local lookup)."""

    def __init__(self, text_config, *, tp: int, sp: int) -> None:
        _check_divides("vocabulary", text_config.vocab_size, tp)
        super().__init__(nn.Embedding(text_config.vocab_size // tp, text_config.hidden_size), tp=tp, sp=sp)

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len, self.sp)
        ids = torch.randint(0, self.layer.num_embeddings, (micro_batch, local), device=device)
        return ShardInputs(x=ids, kwargs={})

    def forward(self, x):
        return self.layer(x)


class FinalNormShard(LayerShard):
    """The decoder's last RMSNorm (replicated under TP, tokens split under SP)."""

    def __init__(self, text_config, *, tp: int, sp: int) -> None:
        super().__init__(Qwen2_5_VLRMSNorm(text_config.hidden_size, eps=text_config.rms_norm_eps), tp=tp, sp=sp)

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len, self.sp)
        x = torch.randn(micro_batch, local, self.layer.weight.shape[0], dtype=dtype, device=device, requires_grad=True)
        return ShardInputs(x=x, kwargs={})

    def forward(self, x):
        return self.layer(x)


class LmHeadShard(LayerShard):
    """lm_head over 1/TP of the vocabulary plus the cross-entropy on those logits (loss_parallel's local work)."""

    def __init__(self, text_config, *, tp: int, sp: int) -> None:
        _check_divides("vocabulary", text_config.vocab_size, tp)
        head = nn.Linear(text_config.hidden_size, text_config.vocab_size // tp, bias=False)
        super().__init__(head, tp=tp, sp=sp)

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len, self.sp)
        x = torch.randn(micro_batch, local, self.layer.in_features, dtype=dtype, device=device, requires_grad=True)
        labels = torch.randint(0, self.layer.out_features, (micro_batch * local,), device=device)
        return ShardInputs(x=x, kwargs={"labels": labels})

    def forward(self, x, labels):
        logits = self.layer(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels)


class Qwen3_5VisionBlockShard(VisionBlockShard):
    """Qwen3_5VisionBlock (Qwen3-VL's: full attention within each image, an fc1/fc2 MLP), split as Qwen2.5-VL's."""

    def __init__(self, config, *, tp: int, sp: int) -> None:
        _check_divides("vision heads", config.num_heads, tp * sp)
        block = Qwen3_5VisionBlock(_with_attention(config, segmented=True))
        block.attn.qkv = _shrink_linear(block.attn.qkv, out_div=tp)
        block.attn.proj = _shrink_linear(block.attn.proj, in_div=tp)
        block.attn.num_heads = config.num_heads // tp
        block.mlp.linear_fc1 = _shrink_linear(block.mlp.linear_fc1, out_div=tp)
        block.mlp.linear_fc2 = _shrink_linear(block.mlp.linear_fc2, in_div=tp)
        LayerShard.__init__(self, block, tp=tp, sp=sp)
        self.window_patches, self.head_dim = None, config.hidden_size // config.num_heads


class Qwen3_5PatchEmbedShard(LayerShard):
    """Qwen3_5VisionPatchEmbed plus the learned position table, looked up at 4 bilinear taps per patch and weighted
    (as the tower interpolates it to each image's grid); replicated under TP, tokens split under SP."""

    def __init__(self, vision_config, *, tp: int, sp: int) -> None:
        layer = nn.ModuleDict({"embed": Qwen3_5VisionPatchEmbed(vision_config),
                               "pos_embed": nn.Embedding(vision_config.num_position_embeddings,
                                                         vision_config.hidden_size)})
        super().__init__(layer, tp=tp, sp=sp)
        self.in_features = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len * micro_batch, self.sp)
        taps = torch.randint(0, self.layer["pos_embed"].num_embeddings, (4, local), device=device)
        weights = torch.rand(4, local, 1, dtype=dtype, device=device)
        return ShardInputs(x=torch.randn(local, self.in_features, dtype=dtype, device=device),
                           kwargs={"taps": taps, "weights": weights})

    def forward(self, x, taps, weights):
        return self.layer["embed"](x) + (self.layer["pos_embed"](taps) * weights).sum(0)


class Qwen3_5PatchMergerShard(PatchMergerShard):
    """Qwen3_5VisionPatchMerger (norm before the 2 x 2 shuffle), its MLP split Megatron-style."""

    def __init__(self, vision_config, *, tp: int, sp: int) -> None:
        merger = Qwen3_5VisionPatchMerger(vision_config, use_postshuffle_norm=False)
        merger.linear_fc1 = _shrink_linear(merger.linear_fc1, out_div=tp)
        merger.linear_fc2 = _shrink_linear(merger.linear_fc2, in_div=tp)
        merger.hidden_size = vision_config.hidden_size * vision_config.spatial_merge_size**2
        LayerShard.__init__(self, merger, tp=tp, sp=sp)
        self.unit = vision_config.spatial_merge_size**2

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len * micro_batch, self.sp * self.unit) * self.unit
        x = torch.randn(local, self.layer.norm.weight.shape[0], dtype=dtype, device=device, requires_grad=True)
        return ShardInputs(x=x, kwargs={})


def _qwen3_5_text_shard_config(text_config, tp: int, sp: int):
    """The text config of one TP rank's layers: 1/tp of the query, KV (replicated below tp), linear-attention key and
    value heads and of the MLP width; the attention as a Ulysses rank runs it."""
    config = _with_attention(text_config, segmented=sp > 1)
    config.num_attention_heads = text_config.num_attention_heads // tp
    config.num_key_value_heads = max(text_config.num_key_value_heads // tp, 1)
    config.linear_num_key_heads = text_config.linear_num_key_heads // tp
    config.linear_num_value_heads = text_config.linear_num_value_heads // tp
    config.intermediate_size = text_config.intermediate_size // tp
    return config


class Qwen3_5DecoderLayerShard(LayerShard):
    """Qwen3_5DecoderLayer of either type (``linear``: Gated DeltaNet; else gated full attention with partial rotary)
    on (B, L, hidden), built at 1/tp of its heads and MLP width."""

    def __init__(self, text_config, *, linear: bool, tp: int, sp: int) -> None:
        kind = "linear_attention" if linear else "full_attention"
        layer = Qwen3_5DecoderLayer(_qwen3_5_text_shard_config(text_config, tp, sp),
                                    layer_idx=text_config.layer_types.index(kind))
        super().__init__(layer, tp=tp, sp=sp)
        self.hidden = text_config.hidden_size
        self.rotary = Qwen3_5TextRotaryEmbedding(text_config)

    def inputs(self, seq_len, micro_batch, *, dtype, device):
        local = _local_tokens(seq_len, self.sp)
        x = torch.randn(micro_batch, local, self.hidden, dtype=dtype, device=device, requires_grad=True)
        positions = torch.arange(local, device=device).expand(3, micro_batch, local)
        cos, sin = self.rotary.to(device)(x, positions)
        kwargs = {"position_embeddings": (cos.to(dtype), sin.to(dtype))}
        if self.sp > 1:
            kwargs["ulysses_degree"] = self.sp
        return ShardInputs(x=x, kwargs=kwargs)

    def forward(self, x, **kwargs):
        return self.layer(x, **kwargs)


PROFILED_FAMILIES = {"qwen2_5_vl": Qwen2_5_VLConfig, "qwen3_5": Qwen3_5Config}
"""Model types whose layers the shards here build, and their transformers config classes."""


def hf_config(hf_config_dict) -> Qwen2_5_VLConfig | Qwen3_5Config:
    """The transformers config of a ModelSpec's ``hf_config``.

    Raises:
        ValueError: a family whose layers these shards do not build (they would measure another's instead).
    """
    model_type = hf_config_dict.get("model_type")
    if model_type not in PROFILED_FAMILIES:
        raise ValueError(f"the profiler builds the layers of {', '.join(PROFILED_FAMILIES)} models, not "
                         f"{model_type}: plan it with the analytical cost model (no --profile)")
    return PROFILED_FAMILIES[model_type](**dict(hf_config_dict))


def build_shard(config: Qwen2_5_VLConfig | Qwen3_5Config, layer: LayerSpec, *, tp: int, sp: int) -> LayerShard:
    """One rank's shard of ``layer`` at degrees (tp, sp), parameters in the current default device/mode."""
    vision, text = config.vision_config, config.text_config
    qwen3_5 = isinstance(config, Qwen3_5Config)
    if layer.kind == "vision_block":
        if qwen3_5:
            return Qwen3_5VisionBlockShard(vision, tp=tp, sp=sp)
        window = layer.attention.window_patches if layer.attention is not None else None
        return VisionBlockShard(vision, window_patches=window, tp=tp, sp=sp)
    builders = {
        "patch_embed": lambda: (Qwen3_5PatchEmbedShard if qwen3_5 else PatchEmbedShard)(vision, tp=tp, sp=sp),
        "patch_merger": lambda: (Qwen3_5PatchMergerShard if qwen3_5 else PatchMergerShard)(vision, tp=tp, sp=sp),
        "decoder_layer": lambda: (Qwen3_5DecoderLayerShard(text, linear=layer.linear_attention is not None, tp=tp,
                                                           sp=sp) if qwen3_5 else DecoderLayerShard(text, tp=tp, sp=sp)),
        "embedding": lambda: EmbeddingShard(text, tp=tp, sp=sp),
        "final_norm": lambda: FinalNormShard(text, tp=tp, sp=sp),
        "lm_head": lambda: LmHeadShard(text, tp=tp, sp=sp),
    }
    if layer.kind not in builders:
        raise NotImplementedError(f"no profiler shard for layer kind {layer.kind!r} yet")
    return builders[layer.kind]()


def valid_degree(config: Qwen2_5_VLConfig | Qwen3_5Config, layer: LayerSpec, *, tp: int, sp: int) -> bool:
    """Whether (tp, sp) splits this layer evenly (heads, vocabulary, widths), and is measured here (a Gated DeltaNet
    layer without SP)."""
    vision, text = config.vision_config, config.text_config
    decoder = [text.num_attention_heads % (tp * sp), text.intermediate_size % tp]
    if layer.linear_attention is not None:
        decoder = [sp - 1, text.linear_num_key_heads % tp, text.linear_num_value_heads % tp,
                   text.intermediate_size % tp]
    checks = {
        "vision_block": [vision.num_heads % (tp * sp), vision.intermediate_size % tp],
        "patch_merger": [(vision.hidden_size * vision.spatial_merge_size**2) % tp],
        "decoder_layer": decoder,
        "embedding": [text.vocab_size % tp],
        "lm_head": [text.vocab_size % tp],
    }
    return not any(checks.get(layer.kind, []))


def shard_param_bytes(shard: LayerShard) -> int:
    """Bytes of the shard's parameters."""
    return sum(p.numel() * p.element_size() for p in shard.parameters())


def tokens_multiple(config: Qwen2_5_VLConfig | Qwen3_5Config, layer: LayerSpec, sp: int) -> int:
    """Sequence lengths of this layer must be multiples of this (merge unit and SP)."""
    unit = config.vision_config.spatial_merge_size**2 if layer.kind == "patch_merger" else 1
    return unit * sp

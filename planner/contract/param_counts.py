"""Exact parameter counts of the Hugging Face modules the catalog's layer types stand for.

One function per module, named in its docstring; ``tests/test_catalog.py`` checks each against transformers.
"""

from __future__ import annotations


def linear_params(in_features: int, out_features: int, bias: bool) -> int:
    """``nn.Linear``."""
    return in_features * out_features + (out_features if bias else 0)


def rms_norm_params(dim: int) -> int:
    """``Qwen2RMSNorm`` / ``Qwen2_5_VLRMSNorm``: a weight, no bias."""
    return dim


def layer_norm_params(dim: int) -> int:
    """``nn.LayerNorm``: weight and bias."""
    return 2 * dim


def patch_embed_params(in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int) -> int:
    """``Qwen2_5_VisionPatchEmbed`` / Qwen2-VL ``PatchEmbed``: a Conv3d without bias."""
    return in_channels * temporal_patch_size * patch_size**2 * embed_dim


def vision_attention_params(dim: int) -> int:
    """``Qwen2_5_VLVisionAttention`` / Qwen2-VL ``VisionAttention``: fused qkv and proj, both with bias."""
    return linear_params(dim, 3 * dim, bias=True) + linear_params(dim, dim, bias=True)


def qwen2_5_vision_block_params(dim: int, intermediate_size: int) -> int:
    """``Qwen2_5_VLVisionBlock``: two RMSNorms, attention, SwiGLU ``Qwen2_5_VLMLP(bias=True)``."""
    mlp = 2 * linear_params(dim, intermediate_size, bias=True) + linear_params(intermediate_size, dim, bias=True)
    return 2 * rms_norm_params(dim) + vision_attention_params(dim) + mlp


def qwen2_vl_vision_block_params(dim: int, mlp_hidden: int) -> int:
    """``Qwen2VLVisionBlock``: two LayerNorms, attention, ``VisionMlp`` (fc1/fc2 with bias)."""
    mlp = linear_params(dim, mlp_hidden, bias=True) + linear_params(mlp_hidden, dim, bias=True)
    return 2 * layer_norm_params(dim) + vision_attention_params(dim) + mlp


def patch_merger_params(context_dim: int, out_dim: int, merge: int, norm_params: int) -> int:
    """``Qwen2_5_VLPatchMerger`` (RMSNorm ln_q) / Qwen2-VL ``PatchMerger`` (LayerNorm ln_q): norm + 2-layer MLP."""
    merged = context_dim * merge**2
    return norm_params + linear_params(merged, merged, bias=True) + linear_params(merged, out_dim, bias=True)


def whisper_conv_params(num_mel_bins: int, d_model: int, max_source_positions: int) -> int:
    """``Qwen2AudioEncoder`` conv1 + conv2 (kernel 3, bias) + ``embed_positions`` (frozen, but a parameter)."""
    conv1 = num_mel_bins * d_model * 3 + d_model
    conv2 = d_model * d_model * 3 + d_model
    return conv1 + conv2 + max_source_positions * d_model


def qwen2_audio_layer_params(d_model: int, ffn_dim: int) -> int:
    """``Qwen2AudioEncoderLayer``: q/v/out_proj with bias, k_proj without, fc1/fc2, two LayerNorms."""
    attention = 3 * linear_params(d_model, d_model, bias=True) + linear_params(d_model, d_model, bias=False)
    mlp = linear_params(d_model, ffn_dim, bias=True) + linear_params(ffn_dim, d_model, bias=True)
    return attention + mlp + 2 * layer_norm_params(d_model)


def qwen2_audio_projector_params(d_model: int, llm_hidden: int) -> int:
    """``Qwen2AudioEncoder.layer_norm`` + ``Qwen2AudioMultiModalProjector`` (Linear with bias)."""
    return layer_norm_params(d_model) + linear_params(d_model, llm_hidden, bias=True)


def embedding_params(vocab_size: int, hidden: int) -> int:
    """``nn.Embedding`` (``embed_tokens``)."""
    return vocab_size * hidden


def qwen2_decoder_layer_params(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """``Qwen2DecoderLayer`` / ``Qwen2_5_VLDecoderLayer``: q/k/v with bias, o without, SwiGLU MLP, two RMSNorms."""
    attention = (
        linear_params(hidden, heads * head_dim, bias=True)
        + 2 * linear_params(hidden, kv_heads * head_dim, bias=True)
        + linear_params(heads * head_dim, hidden, bias=False)
    )
    mlp = 3 * linear_params(hidden, intermediate, bias=False)
    return attention + mlp + 2 * rms_norm_params(hidden)


def lm_head_params(hidden: int, vocab_size: int, tied: bool) -> int:
    """``lm_head`` (Linear without bias); 0 when it shares the embedding matrix."""
    return 0 if tied else linear_params(hidden, vocab_size, bias=False)


def routed_experts_params(num_experts: int, hidden: int, expert_intermediate: int) -> int:
    """``Qwen3VLMoeTextExperts``: per expert a fused gate/up ``[2I, H]`` and a down ``[H, I]`` projection, no bias."""
    return num_experts * 3 * hidden * expert_intermediate


def top_k_router_params(num_experts: int, hidden: int) -> int:
    """``Qwen3VLMoeTextTopKRouter``: one ``[E, H]`` weight, no bias."""
    return num_experts * hidden

"""Analytical cost of ONE instance of a layer for ONE micro-batch on one GPU, by layer kind.

Each ``*_terms`` function lists the layer's GEMMs, attention core, elementwise traffic, saved activations
and collectives, and hands them to the formulas in ``compute``, ``memory`` and ``comm``. Widths are per rank:
TP splits heads and MLP width; Ulysses SP and CP split tokens (``Shard.tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.cost.assumptions import CostAssumptions
from planner.cost.comm import Link, all_reduce_time, all_to_all_time, exposed_time, p2p_time
from planner.cost.compute import attention_core_time, attention_flops, elementwise_time, gemm_flops, gemm_time
from planner.cost.memory import block_saved_bytes_per_token, loss_logits_bytes, score_matrix_bytes
from planner.hardware import DeviceSpec
from planner.models import LayerSpec

Backward = str
"""How much backward a module runs: ``full`` (weight + input grads), ``input`` (frozen, input grads only,
because a trainable module feeds it), ``none`` (frozen with nothing trainable upstream: forward only)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Shard:
    """How one micro-batch of a module lies on one rank, and the links its groups use."""

    tp: int
    """Tensor-parallel degree."""
    sp: int
    """Ulysses degree."""
    cp: int
    """Context-parallel degree."""
    micro_batch: int
    """Samples per micro-batch."""
    tokens: float
    """Tokens per rank per micro-batch: micro_batch * tokens_per_sample / (sp * cp)."""
    segment_tokens: float
    """Token-weighted mean length of the full-attention segments (one per image / clip / sequence)."""
    segments: float
    """Full-attention segments per sample, such that segments * segment_tokens^2 = sum of squared lengths."""
    window_tokens: float
    """Mean tokens per attention window (0 without windows)."""
    windows: float
    """Attention windows per sample."""
    recompute: str
    """none, selective or full."""
    backward: Backward
    """full, input or none."""
    tp_link: Link
    """Link of the TP groups."""
    sp_link: Link
    """Link of the Ulysses groups."""
    cp_link: Link
    """Link of the CP ring."""
    device: DeviceSpec
    """The GPU."""
    assumptions: CostAssumptions
    """Cost-model knobs."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LayerTerms:
    """Cost of one layer instance for one micro-batch on one rank."""

    forward_s: float
    """Forward compute."""
    backward_s: float
    """Backward compute (no recomputation)."""
    recompute_s: float
    """Forward compute re-run in backward."""
    tp_comm_s: float
    """Exposed TP collectives (forward, backward, recomputed forward)."""
    sp_comm_s: float
    """Exposed Ulysses all-to-alls."""
    cp_comm_s: float
    """Exposed ring-attention passing."""
    saved_bytes: float
    """Activations kept for backward under the recompute mode."""
    working_bytes: float
    """Activations a recomputable block holds while its backward runs (what full recomputation re-creates);
    0 for layers that are never recomputed."""
    buffer_bytes: float
    """Transient bytes alive while the layer runs (loss logits, all-to-all and ring buffers)."""
    flops: float
    """Forward model FLOPs on this rank (GEMMs + attention core)."""
    backward_flops: float
    """Backward model FLOPs on this rank (no recomputation)."""


def gemm_backward_factor(backward: Backward, assumptions: CostAssumptions) -> float:
    """Backward/forward ratio of a GEMM: 2 with weight gradients, 1 for input gradients only, else 0.

    Source: Narayanan et al. 2021, Sec. 5.1 (backward = 2x forward: one GEMM for the input gradient, one
    for the weight gradient); a frozen weight skips the weight-gradient GEMM.
    """
    if backward == "full":
        return assumptions.backward_to_forward_flops
    if backward == "input":
        return assumptions.backward_to_forward_flops / 2
    return 0.0


def _gemms(shapes: tuple[tuple[float, float, float], ...], shard: Shard) -> tuple[float, float]:
    """(seconds, FLOPs) of a list of (m, n, k) GEMMs."""
    seconds = flops = 0.0
    for m, n, k in shapes:
        seconds += gemm_time(m, n, k, shard.device, shard.assumptions)
        flops += gemm_flops(m, n, k)
    return seconds, flops


def _terms(
    shard: Shard,
    *,
    gemm_s: float,
    gemm_flops_: float,
    attention_s: float = 0.0,
    attention_flops_: float = 0.0,
    elementwise_s: float,
    saved: float,
    working: float | None = None,
    buffers: float = 0.0,
    tp_fwd: float = 0.0,
    tp_bwd: float = 0.0,
    sp_fwd: float = 0.0,
    sp_bwd: float = 0.0,
    cp_fwd: float = 0.0,
    cp_bwd: float = 0.0,
    recomputable: bool = False,
    input_grad: bool = True,
) -> LayerTerms:
    """Assemble LayerTerms from forward pieces; backward, recompute and exposure follow the module's modes.

    ``input_grad=False`` marks a first layer whose input (pixels, mel frames) needs no gradient: its backward
    is the weight-gradient GEMM only.
    """
    a = shard.assumptions
    runs_backward = shard.backward != "none"
    gemm_bwd = gemm_backward_factor(shard.backward, a)
    if not input_grad:
        gemm_bwd = max(0.0, gemm_bwd - a.backward_to_forward_flops / 2)
    attn_bwd = a.attention_backward_ratio() if runs_backward else 0.0
    elem_bwd = a.backward_to_forward_flops if runs_backward else 0.0
    forward = gemm_s + attention_s + elementwise_s
    backward = gemm_s * gemm_bwd + attention_s * attn_bwd + elementwise_s * elem_bwd
    rc = shard.recompute if (recomputable and runs_backward) else "none"
    recompute = {"none": 0.0, "selective": attention_s, "full": forward}[rc]
    if not runs_backward:
        tp_bwd = sp_bwd = cp_bwd = 0.0
        saved = working = 0.0
    if rc == "full":
        tp_fwd, sp_fwd = 2 * tp_fwd, 2 * sp_fwd
    cp_exposed = exposed_time(cp_fwd, attention_s, a.cp_comm_overlap) + exposed_time(
        cp_bwd, attention_s * attn_bwd, a.cp_comm_overlap
    )
    if rc != "none":
        cp_exposed += exposed_time(cp_fwd, attention_s, a.cp_comm_overlap)
    return LayerTerms(
        forward_s=forward,
        backward_s=backward,
        recompute_s=recompute,
        tp_comm_s=(tp_fwd + tp_bwd) * (1 - a.tp_comm_overlap),
        sp_comm_s=(sp_fwd + sp_bwd) * (1 - a.sp_comm_overlap),
        cp_comm_s=cp_exposed,
        saved_bytes=saved,
        working_bytes=(saved if working is None else working) if recomputable else 0.0,
        buffer_bytes=buffers,
        flops=gemm_flops_ + attention_flops_,
        backward_flops=gemm_flops_ * gemm_bwd + attention_flops_ * elem_bwd,
    )


def block_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """A transformer block (ViT/Whisper encoder block or GQA + SwiGLU decoder layer).

    GEMMs (Narayanan et al. 2021, eq. 3 accounting): QKV (fused for the vision tower, separate q/k/v in the
    decoder), output projection, MLP (SwiGLU: gate, up, down). Attention core per full segment, per window
    (window blocks) and causal-halved for the decoder. TP: 2 all-reduces of the block output width in forward
    and 2 in backward (Shoeybi et al. 2019, Megatron-LM, Sec. 3, Fig. 4). Ulysses: all-to-all of q, k, v before
    and of the output after full attention, mirrored in backward (Jacobs et al. 2023, DeepSpeed-Ulysses,
    Sec. 3.1); window blocks keep whole windows on a rank and exchange nothing. Ring CP: cp-1 KV block passes
    per attention forward, KV + dKV in backward (Liu et al. 2023, Ring Attention, Sec. 3).
    """
    a, mlp, s, asm = layer.attention, layer.mlp, shard, shard.assumptions
    h, d, m, e = layer.hidden_size, a.head_dim, shard.tokens, asm.activation_bytes
    q_width = a.num_heads * d / s.tp
    kv_width = max(a.num_kv_heads, s.tp) / s.tp * d
    f = mlp.intermediate_size / s.tp
    if layer.kind == "decoder_layer":
        qkv = ((m, q_width, h), (m, kv_width, h), (m, kv_width, h))
    else:
        qkv = ((m, q_width + 2 * kv_width, h),)
    mlp_shapes = ((m, f, h), (m, f, h), (m, h, f)) if mlp.gated else ((m, f, h), (m, h, f))
    gemm_s, gemm_fl = _gemms(qkv + ((m, h, q_width),) + mlp_shapes, s)

    heads = a.num_heads / (s.tp * s.sp)
    windowed = bool(a.window_patches) and s.windows > 0
    seg, num_seg = (s.window_tokens, s.windows) if windowed else (s.segment_tokens, s.segments)
    causal = asm.causal_attention_flops_fraction if a.causal and asm.attention_implementation != "eager" else 1.0
    attn_fl = attention_flops(seg, num_seg * s.micro_batch, heads * d, causal) / s.cp
    scores = seg * seg * num_seg * s.micro_batch * heads / s.cp
    attn_s = attention_core_time(attn_fl, seg / s.cp, scores, s.device, asm)

    replicated = h / s.tp if asm.megatron_sequence_parallel else h
    activation_elems = (3 if mlp.gated else 2) * f
    elem_s = elementwise_time(m * (10 * replicated + 2 * (q_width + kv_width) + activation_elems), s.device, asm)

    mem_kv = max(a.num_kv_heads, s.tp * s.sp) / s.tp * d
    per_token = dict(
        hidden=h, q_width=q_width, kv_width=mem_kv, mlp_width=f, gated=mlp.gated, heads=a.num_heads / s.tp, tp=s.tp
    )
    saved = m * block_saved_bytes_per_token(**per_token, recompute=s.recompute, assumptions=asm)
    saved += score_matrix_bytes(scores, s.recompute, asm)
    working = m * block_saved_bytes_per_token(**per_token, recompute="none", assumptions=asm)
    working += score_matrix_bytes(scores, "none", asm)

    tp_ar = 2 * all_reduce_time(m * h * e, s.tp, s.tp_link)
    sp_fwd = 0.0
    buffers = 0.0
    if s.sp > 1 and not windowed:
        per_rank = (2 * a.num_heads * d, 2 * max(a.num_kv_heads, s.sp) * d)
        sp_fwd = 2 * all_to_all_time(m * per_rank[0] / 2 * e, s.sp, s.sp_link)
        sp_fwd += 2 * all_to_all_time(m * per_rank[1] / 2 * e, s.sp, s.sp_link)
        buffers = m * (per_rank[0] + per_rank[1]) * e
    cp_fwd = 0.0
    if s.cp > 1:
        kv_block = m * 2 * kv_width * e
        cp_fwd = (s.cp - 1) * p2p_time(kv_block, s.cp_link)
        buffers += 2 * kv_block
    return _terms(
        s,
        gemm_s=gemm_s,
        gemm_flops_=gemm_fl,
        attention_s=attn_s,
        attention_flops_=attn_fl,
        elementwise_s=elem_s,
        saved=saved,
        working=working,
        buffers=buffers,
        tp_fwd=tp_ar,
        tp_bwd=tp_ar,
        sp_fwd=sp_fwd,
        sp_bwd=sp_fwd,
        cp_fwd=cp_fwd,
        cp_bwd=2 * cp_fwd,
        recomputable=True,
    )


def patch_embed_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Patchifier (Conv3d with stride = kernel, i.e. one GEMM tokens x in_features x hidden), replicated on TP
    ranks. It keeps its pixel input only to form its weight gradient."""
    k = layer.in_features or layer.params / layer.hidden_size
    m = shard.tokens
    gemm_s, gemm_fl = _gemms(((m, layer.hidden_size, k),), shard)
    saved = m * k * shard.assumptions.activation_bytes if shard.backward == "full" else 0.0
    return _terms(shard, gemm_s=gemm_s, gemm_flops_=gemm_fl, elementwise_s=0.0, saved=saved, input_grad=False)


def patch_merger_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Qwen-VL PatchMerger: norm, merge ``token_reduction`` tokens, Linear(in, in) -> GELU -> Linear(in, out).

    The MLP is column- then row-parallel under TP (1 all-reduce forward, 1 backward, Shoeybi et al. 2019
    Sec. 3). Under Ulysses each rank merges its own tokens (merge groups never straddle windows).
    """
    asm, e = shard.assumptions, shard.assumptions.activation_bytes
    h, m = layer.hidden_size, shard.tokens
    in_f = layer.in_features or h * layer.token_reduction
    out = layer.out_features or h
    m_out = m / layer.token_reduction
    mid = in_f / shard.tp
    gemm_s, gemm_fl = _gemms(((m_out, mid, in_f), (m_out, out, mid)), shard)
    elem_s = elementwise_time(2 * m * h + 2 * m_out * mid, shard.device, asm)
    saved = (m * h + m_out * in_f + 2 * m_out * mid) * e
    return _terms(
        shard,
        gemm_s=gemm_s,
        gemm_flops_=gemm_fl,
        elementwise_s=elem_s,
        saved=saved,
        tp_fwd=all_reduce_time(m_out * out * e, shard.tp, shard.tp_link),
        tp_bwd=all_reduce_time(m_out * in_f * e, shard.tp, shard.tp_link),
    )


def embedding_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Token embedding: a memory-bound gather of ``tokens x h``; vocab-parallel under TP, whose partial
    outputs are all-reduced in forward (Shoeybi et al. 2019, Sec. 3). Backward only scatters the weight
    gradient, so a frozen embedding runs none. It keeps only token ids."""
    h, m = layer.hidden_size, shard.tokens
    elem_s = elementwise_time(2 * m * h, shard.device, shard.assumptions)
    if shard.backward != "full":
        shard = _forward_only(shard)
    e = shard.assumptions.activation_bytes
    return _terms(
        shard,
        gemm_s=0.0,
        gemm_flops_=0.0,
        elementwise_s=elem_s,
        saved=0.0,
        tp_fwd=all_reduce_time(m * h * e, shard.tp, shard.tp_link),
    )


def final_norm_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Final RMSNorm: memory-bound read + write of ``tokens x h``; keeps its input (replicated under TP)."""
    h, m = layer.hidden_size, shard.tokens
    elem_s = elementwise_time(2 * m * h, shard.device, shard.assumptions)
    return _terms(shard, gemm_s=0.0, gemm_flops_=0.0, elementwise_s=elem_s, saved=m * h * shard.assumptions.activation_bytes)


def lm_head_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Vocabulary projection + cross-entropy, vocab-parallel under TP (``loss_parallel``).

    GEMM tokens x h x V/tp; the loss reads and writes the fp32 logits (memory-bound); it keeps its input and
    the fp32 log-softmax, and the bf16 + fp32 logits are a transient peak (``loss_logits_bytes``). TP: two
    small fp32 all-reduces of per-token max and sum in forward, an all-reduce of the input gradient in
    backward (column-parallel input; Shoeybi et al. 2019, Sec. 3).
    """
    asm, e = shard.assumptions, shard.assumptions.activation_bytes
    h, m = layer.hidden_size, shard.tokens
    vocab = (layer.out_features or h) / shard.tp
    gemm_s, gemm_fl = _gemms(((m, vocab, h),), shard)
    saved_logits, transient = loss_logits_bytes(m, vocab, asm)
    loss_bytes = 2 * (saved_logits + transient)
    loss_s = loss_bytes / (shard.device.memory_bandwidth * asm.memory_bandwidth_efficiency)
    return _terms(
        shard,
        gemm_s=gemm_s,
        gemm_flops_=gemm_fl,
        elementwise_s=loss_s,
        saved=m * h * e + saved_logits,
        buffers=transient,
        tp_fwd=2 * all_reduce_time(m * 4, shard.tp, shard.tp_link),
        tp_bwd=all_reduce_time(m * h * e, shard.tp, shard.tp_link),
    )


def audio_conv_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Whisper conv front end as one GEMM per output position of ``params / h`` inputs (2 * params FLOPs per
    token, Kaplan et al. 2020 Sec. 2.1 accounting; ``in_features`` is the mel count, the conv weights dominate
    the parameters), replicated under TP; keeps the two conv outputs."""
    h, m = layer.hidden_size, shard.tokens
    k = layer.params / h
    gemm_s, gemm_fl = _gemms(((m, h, k),), shard)
    elem_s = elementwise_time(4 * m * h, shard.device, shard.assumptions)
    saved = 2 * m * h * shard.assumptions.activation_bytes
    return _terms(shard, gemm_s=gemm_s, gemm_flops_=gemm_fl, elementwise_s=elem_s, saved=saved, input_grad=False)


def audio_projector_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Pooling + norm + Linear(in, out) into the LLM width, replicated under TP."""
    h, m = layer.hidden_size, shard.tokens
    in_f = layer.in_features or h
    m_out = m / layer.token_reduction
    gemm_s, gemm_fl = _gemms(((m_out, layer.out_features or h, in_f),), shard)
    elem_s = elementwise_time(4 * m * h, shard.device, shard.assumptions)
    saved = (m * h + m_out * in_f) * shard.assumptions.activation_bytes
    return _terms(shard, gemm_s=gemm_s, gemm_flops_=gemm_fl, elementwise_s=elem_s, saved=saved)


def _forward_only(shard: Shard) -> Shard:
    """The same shard with no backward (for layers whose backward is nothing but a frozen weight gradient)."""
    return replace(shard, backward="none")


LAYER_TERMS = {
    "vision_block": block_terms,
    "audio_block": block_terms,
    "decoder_layer": block_terms,
    "patch_embed": patch_embed_terms,
    "patch_merger": patch_merger_terms,
    "embedding": embedding_terms,
    "final_norm": final_norm_terms,
    "lm_head": lm_head_terms,
    "audio_conv": audio_conv_terms,
    "audio_projector": audio_projector_terms,
}
"""Layer kind -> its analytical cost function."""


def layer_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Analytical cost of one instance of ``layer`` on ``shard``."""
    return LAYER_TERMS[layer.kind](layer, shard)

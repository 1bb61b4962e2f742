"""Compute time of one op on one GPU: roofline with a small-GEMM efficiency curve.

Each op's time is ``max(FLOPs / (peak * efficiency), bytes / (HBM bandwidth * efficiency))`` -- the roofline
of Williams, Waterman & Patterson (2009), "Roofline: an insightful visual performance model", eq. 1.
"""

from __future__ import annotations

from planner.cost.assumptions import BytesPerParam, CostAssumptions
from planner.cost.host import pass_time
from planner.cost.op_counts import optimizer_pass_ops
from planner.contract.hardware import DeviceSpec


def gemm_flops(m: float, n: float, k: float) -> float:
    """FLOPs of an (m x k) @ (k x n) GEMM: ``2mnk`` (one multiply + one add per term).

    Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", Sec. 5.1 / eq. 3 (which counts every linear layer this way).
    """
    return 2.0 * m * n * k


def gemm_bytes(m: float, n: float, k: float, element_bytes: float) -> float:
    """HBM bytes a GEMM moves at least once: read A (m x k) and B (k x n), write C (m x n)."""
    return element_bytes * (m * k + k * n + m * n)


def matmul_efficiency(m: float, n: float, k: float, assumptions: CostAssumptions) -> float:
    """Achieved fraction of peak of a GEMM: ``max_eff * d / (d + d_half)``, d = smallest GEMM dimension.

    A saturating (Michaelis-Menten-shaped) curve: a GEMM narrower than a tensor-core tile leaves most of it
    idle, so a 1280-wide vision GEMM split 8 ways (160 wide) runs markedly below a 1280-wide one. Source: the
    tile-quantisation and wave-quantisation effects in NVIDIA's "Matrix Multiplication Background User's
    Guide" (2023), Sec. "Dimension Quantization Effects"; the curve shape and ``d_half`` are assumptions.
    """
    d = min(m, n, k)
    if d <= 0:
        return 0.0
    return assumptions.max_matmul_efficiency * d / (d + assumptions.matmul_half_saturation_dim)


def grouped_gemm_efficiency(tokens_per_expert: float, n: float, k: float, assumptions: CostAssumptions) -> float:
    """Achieved fraction of peak of a grouped expert GEMM: ``matmul_efficiency`` of its widths times
    ``t / (t + t_half)``, t = tokens per expert, t_half = ``expert_gemm_half_efficiency_tokens``.

    Source: Gale et al. 2023, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", Sec. 5 (grouped /
    block-sparse expert GEMMs tiled in 128-row blocks: an expert's partial last tile idles the tensor cores); the
    saturating shape is ``matmul_efficiency``'s, ``t_half`` an assumption.
    """
    if tokens_per_expert <= 0:
        return 0.0
    width = matmul_efficiency(float("inf"), n, k, assumptions)
    return width * tokens_per_expert / (tokens_per_expert + assumptions.expert_gemm_half_efficiency_tokens)


def grouped_gemm_time(tokens_per_expert: float, experts: float, n: float, k: float, device: DeviceSpec,
                      assumptions: CostAssumptions) -> float:
    """Seconds of one grouped GEMM over ``experts`` local experts, each an (t x k) @ (k x n) product: roofline of
    ``experts * 2tnk`` FLOPs at ``grouped_gemm_efficiency`` against reading every expert's weight and its rows
    (few tokens per expert make it weight-bandwidth-bound)."""
    if tokens_per_expert <= 0 or experts <= 0:
        return 0.0
    return roofline_time(
        experts * gemm_flops(tokens_per_expert, n, k),
        experts * gemm_bytes(tokens_per_expert, n, k, assumptions.activation_bytes),
        device.peak_bf16_flops * grouped_gemm_efficiency(tokens_per_expert, n, k, assumptions),
        device.memory_bandwidth * assumptions.memory_bandwidth_efficiency,
    )


def roofline_time(flops: float, num_bytes: float, flops_per_s: float, bytes_per_s: float) -> float:
    """``max(flops / flops_per_s, bytes / bytes_per_s)`` (Williams et al. 2009, eq. 1)."""
    return max(flops / flops_per_s if flops else 0.0, num_bytes / bytes_per_s if num_bytes else 0.0)


def gemm_time(m: float, n: float, k: float, device: DeviceSpec, assumptions: CostAssumptions) -> float:
    """Seconds of one bf16 GEMM on ``device``: roofline of 2mnk FLOPs at the shape's efficiency vs its bytes."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    return roofline_time(
        gemm_flops(m, n, k),
        gemm_bytes(m, n, k, assumptions.activation_bytes),
        device.peak_bf16_flops * matmul_efficiency(m, n, k, assumptions),
        device.memory_bandwidth * assumptions.memory_bandwidth_efficiency,
    )


def attention_flops(
    segment_tokens: float, num_segments: float, attention_width: float, causal_fraction: float
) -> float:
    """Forward FLOPs of the attention core over ``num_segments`` independent segments of equal length.

    ``4 * s^2 * width`` per segment: QK^T and P@V are each ``2 * s * s * width`` (Narayanan et al. 2021,
    eq. 3, the ``2 * 2 * s^2 * h`` attention term per layer in forward), times ``causal_fraction`` when a causal
    kernel skips masked blocks. Window attention is the same with s = window length, per window; a
    block-diagonal (per-image) mask is one segment per image.
    """
    return 4.0 * segment_tokens * segment_tokens * attention_width * num_segments * causal_fraction


def attention_efficiency(key_tokens: float, assumptions: CostAssumptions) -> float:
    """Achieved fraction of peak of the attention kernel: ``eff_impl * L / (L + L_half)``, L = keys per segment.

    Same saturating shape as ``matmul_efficiency``: a 64-patch window fills one partial tile. Source: Dao 2023,
    FlashAttention-2, Sec. 4.1 (throughput rises with sequence length); the constants are assumptions.
    """
    if key_tokens <= 0:
        return 0.0
    eff = assumptions.attention_efficiency()
    return eff * key_tokens / (key_tokens + assumptions.attention_half_saturation_tokens)


def attention_core_time(
    flops: float, key_tokens: float, score_elements: float, device: DeviceSpec, assumptions: CostAssumptions
) -> float:
    """Seconds of the attention core (QK^T, softmax, P@V) forward on one GPU.

    Flash / memory-efficient kernels are compute-bound at ``attention_efficiency``; eager attention adds the
    memory-bound traffic of its ``score_elements`` materialised scores (Dao et al. 2022, FlashAttention,
    Sec. 3.2: standard attention needs Theta(N^2) HBM accesses), run as separate kernels after the GEMMs.
    """
    if flops <= 0:
        return 0.0
    compute = flops / (device.peak_bf16_flops * attention_efficiency(key_tokens, assumptions))
    if assumptions.attention_implementation != "eager":
        return compute
    traffic = score_elements * assumptions.eager_score_traffic_bytes_per_element
    return compute + traffic / (device.memory_bandwidth * assumptions.memory_bandwidth_efficiency)


def optimizer_step_time(
    params: float, recipe: BytesPerParam, device: DeviceSpec, assumptions: CostAssumptions
) -> float:
    """Seconds of one AdamW step over ``params`` locally held parameters (the rank's optimizer shard).

    Adam is memory-bound (a handful of FLOPs per element): each optimizer state, fp32 master copy included, is
    read and written once, the gradient read once and the weights written (and, without a master copy, read)
    once -- ``gradients + 2 * optimizer + 2 * weights`` bytes per parameter (Rajbhandari et al. 2020, ZeRO,
    Sec. 3.1 state sizes; roofline at zero arithmetic intensity, Williams et al. 2009). bf16 mixed: 2 + 24 + 4
    = 30 B/param.
    """
    num_bytes = params * (recipe.gradients + 2 * recipe.optimizer + 2 * recipe.weights)
    return num_bytes / (device.memory_bandwidth * assumptions.memory_bandwidth_efficiency)


def optimizer_pass_time(params: float, tensors: float, recipe: BytesPerParam, *, dtensor: bool, device: DeviceSpec,
                        assumptions: CostAssumptions) -> float:
    """Seconds of one optimizer step over ``params`` parameters in ``tensors`` tensors: the memory-bound
    ``optimizer_step_time`` against the host dispatch of its calls (``host.pass_time``; multi-tensor or
    per-parameter as ``optimizer_foreach`` says, ``op_counts.OPTIMIZER_OPS``)."""
    if params <= 0:
        return 0.0
    ops = optimizer_pass_ops(tensors, foreach=assumptions.optimizer_foreach, dtensor=dtensor)
    return pass_time(optimizer_step_time(params, recipe, device, assumptions), ops, device, assumptions)


def bucket_copy_time(gradient_bytes: float, copies: int, device: DeviceSpec, assumptions: CostAssumptions) -> float:
    """Seconds spent copying gradients into a flat all-reduce buffer and back, ``copies`` passes that each read and
    write every gradient byte once (PyTorch DDP's bucket copies, Li et al. 2020, "PyTorch Distributed", Sec. 3.2.3;
    its ``gradient_as_bucket_view`` removes them). Roofline at zero arithmetic intensity (Williams et al. 2009)."""
    return copies * 2 * gradient_bytes / (device.memory_bandwidth * assumptions.memory_bandwidth_efficiency)


def elementwise_time(elements_moved: float, device: DeviceSpec, assumptions: CostAssumptions) -> float:
    """Seconds of memory-bound elementwise ops that read + write ``elements_moved`` bf16 elements in total.

    Roofline with zero arithmetic intensity (Williams et al. 2009): bytes / achieved HBM bandwidth, times the
    ``elementwise_traffic_factor`` of unfused eager kernels.
    """
    num_bytes = elements_moved * assumptions.activation_bytes * assumptions.elementwise_traffic_factor
    return num_bytes / (device.memory_bandwidth * assumptions.memory_bandwidth_efficiency)

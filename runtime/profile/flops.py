"""FLOP formulas torch's FlopCounterMode lacks: the CPU flash-attention kernels behind SDPA.

``torch.utils.flop_counter`` registers the CUDA SDPA kernels (flash, efficient, cuDNN) but not
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), so on CPU attention FLOPs count as zero.
We map them to the same formulas torch uses for the CUDA kernels, passed as FlopCounterMode's ``custom_mapping``.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of the CPU flash-attention forward: QK^T and PV, 2*b*h*s_q*s_k*(d_qk + d_v) (Vaswani et al. 2017, §3.2).

    Like torch's CUDA formula, causal masking is not discounted (the kernel's skipped blocks are not counted off).
    """
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of the CPU flash-attention backward: recomputed scores, dV, dP, dQ, dK (five matmuls, 2.5x the forward;
    torch's formula for the CUDA kernels)."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode wraps custom formulas so that they receive shapes instead of tensors.
CPU_SDPA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_sdpa_backward_flop,
}


def flop_counter() -> FlopCounterMode:
    """A silent FlopCounterMode that also counts CPU SDPA."""
    return FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS)

"""A CPU kernel for torch's variable-length attention op (``torch_attn::_varlen_attn``, CUDA-only in torch 2.13):
per-segment SDPA, the reference the runtime's varlen path is checked against on a machine without a GPU. Only
what that path passes is supported (full or causal windows, no paging)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _segments(cu_seq: torch.Tensor) -> list[int]:
    return (cu_seq[1:] - cu_seq[:-1]).tolist()


def _per_segment(query, key, value, cu_seq, is_causal, scale):
    """Output [T, H, D] of SDPA run on each segment of ``cu_seq`` alone (grouped KV heads as SDPA takes them)."""
    gqa = key.shape[1] != query.shape[1]
    lengths = _segments(cu_seq)
    outs = [F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=is_causal, scale=scale, enable_gqa=gqa).transpose(0, 1)
            for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths))]
    return torch.cat(outs)


def _forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None,
             enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert list(window_size or [-1, -1]) in ([-1, -1], [-1, 0]) and torch.equal(cu_seq_q, cu_seq_k)
    out = _per_segment(query, key, value, cu_seq_q, is_causal, scale)
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float32)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _segment_backward(grad_out, q, k, v, is_causal, scale):
    """(dq, dk, dv) of one segment's attention [S, H, D] by hand (Dao et al. 2022, FlashAttention, Alg. 4 in full):
    the kernel runs below autograd, so SDPA cannot be differentiated here."""
    groups = q.shape[1] // k.shape[1]
    k_, v_ = (t.repeat_interleave(groups, dim=1).transpose(0, 1) for t in (k, v))
    q_, g_ = q.transpose(0, 1), grad_out.transpose(0, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q_ @ k_.transpose(1, 2) * scale
    if is_causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    p = scores.softmax(-1)
    dv = p.transpose(1, 2) @ g_
    dp = g_ @ v_.transpose(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = ds @ k_ * scale, ds.transpose(1, 2) @ q_ * scale
    dk, dv = (t.unflatten(0, (k.shape[1], groups)).sum(1) for t in (dk, dv))
    return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


def _backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, rng_state,
              scale=None, window_size=None):
    lengths = _segments(cu_seq_q)
    parts = [_segment_backward(g, q, k, v, is_causal, scale) for g, q, k, v in
             zip(*(t.split(lengths) for t in (grad_out, query, key, value)))]
    return tuple(torch.cat(grads) for grads in zip(*parts))


@functools.cache
def register_cpu_reference() -> None:
    """Give the varlen op and its backward this module's CPU kernels (once per process)."""
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _backward)

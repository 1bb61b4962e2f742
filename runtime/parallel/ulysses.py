"""Ulysses sequence parallelism for the Qwen2.5-VL vision tower (DeepSpeed-Ulysses, Jacobs et al. 2023).

After Qwen2.5-VL's window reordering, a replica's packed patch sequence is a run of attention windows. The SP
group splits it into contiguous runs of whole windows (uneven lengths allowed), so:

- window-attention blocks run locally with rank-local ``cu_seqlens``, no communication;
- full-attention blocks exchange heads by ``all_to_all_single``: sequence-sharded q/k/v [H, s_local, Dh] become
  head-sharded [H/sp, S, Dh], SDPA runs per image, and the output goes back the same way;
- the merger runs locally (windows are whole merge units), each rank emitting its own merged tokens.

The all-to-all pair is a small autograd Function each way; each is the other's backward, and both return early
when the degree is 1.

Shape legend: H heads (local after TP), h = H / sp, S replica sequence, s this rank's part, Dh head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


@dataclass(kw_only=True, frozen=True)
class UlyssesGroup:
    """The SP group of one vision micro-batch, and how its sequence is split."""

    group: Any
    """Process group of the SP ranks (None when the degree is 1)."""
    seq_lens: tuple[int, ...]
    """Patches held by each SP rank, in group-rank order."""
    rank: int
    """This rank's index in the group."""
    segment_lens: tuple[int, ...]
    """Lengths of the full-attention segments (one per image) of the whole replica sequence."""

    @property
    def degree(self) -> int:
        return len(self.seq_lens)


def _all_to_all(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty(sum(recv_sizes))
    dist.all_to_all_single(out, x.contiguous().view(-1), recv_sizes, send_sizes, group=group)
    return out


def _seq_to_heads(x_HsD: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
    """[H, s, Dh] sequence-sharded -> [h, S, Dh] head-sharded."""
    H, s, D = x_HsD.shape
    h = H // ug.degree
    send = [h * s * D] * ug.degree
    recv = [h * n * D for n in ug.seq_lens]
    parts = _all_to_all(x_HsD, send, recv, ug.group).split(recv)
    return torch.cat([p.view(h, n, D) for p, n in zip(parts, ug.seq_lens)], dim=1)


def _heads_to_seq(y_hSD: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
    """[h, S, Dh] head-sharded -> [H, s, Dh] sequence-sharded (inverse of _seq_to_heads)."""
    h, S, D = y_hSD.shape
    s = ug.seq_lens[ug.rank]
    send_parts = [p.reshape(-1) for p in y_hSD.split(list(ug.seq_lens), dim=1)]
    out = _all_to_all(torch.cat(send_parts), [p.numel() for p in send_parts], [h * s * D] * ug.degree, ug.group)
    return out.view(ug.degree * h, s, D)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_HsD: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
        ctx.ug = ug
        return x_HsD if ug.degree == 1 else _seq_to_heads(x_HsD, ug)

    @staticmethod
    def backward(ctx, grad_hSD: torch.Tensor):
        return (grad_hSD if ctx.ug.degree == 1 else _heads_to_seq(grad_hSD.contiguous(), ctx.ug)), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_hSD: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
        ctx.ug = ug
        return y_hSD if ug.degree == 1 else _heads_to_seq(y_hSD, ug)

    @staticmethod
    def backward(ctx, grad_HsD: torch.Tensor):
        return (grad_HsD if ctx.ug.degree == 1 else _seq_to_heads(grad_HsD.contiguous(), ctx.ug)), None


def attention(
    core: Callable[..., tuple[torch.Tensor, Any]],
    module: nn.Module,
    q_1HsD: torch.Tensor,
    k_1HsD: torch.Tensor,
    v_1HsD: torch.Tensor,
    ug: UlyssesGroup,
    **kwargs,
) -> torch.Tensor:
    """Full attention of a sequence-sharded block: heads all-to-all, ``core`` (SDPA) per image, all-to-all back.

    Returns [1, s, H, Dh], the layout transformers' SDPA function returns.
    """
    q, k, v = (SeqToHeads.apply(t[0], ug).unsqueeze(0) for t in (q_1HsD, k_1HsD, v_1HsD))
    segments = list(ug.segment_lens)
    outs = [
        core(module, qi, ki, vi, None, **kwargs)[0]
        for qi, ki, vi in zip(q.split(segments, dim=2), k.split(segments, dim=2), v.split(segments, dim=2))
    ]
    out_hSD = torch.cat(outs, dim=1)[0].transpose(0, 1)
    return HeadsToSeq.apply(out_hSD.contiguous(), ug).transpose(0, 1).unsqueeze(0)


def split_windows(cu_window_seqlens: list[int], degree: int) -> list[int]:
    """Boundaries (in patches) splitting a run of windows into ``degree`` contiguous parts of near-equal length.

    Returns ``degree + 1`` offsets, each one a window boundary.

    Raises:
        ValueError: fewer windows than parts.
    """
    num_windows = len(cu_window_seqlens) - 1
    if num_windows < degree:
        raise ValueError(f"{num_windows} attention windows cannot be split over {degree} sequence-parallel ranks")
    total = cu_window_seqlens[-1]
    bounds = [0]
    for part in range(1, degree):
        target = total * part / degree
        lo = cu_window_seqlens.index(bounds[-1]) + 1
        hi = num_windows - (degree - part)
        best = min(range(lo, hi + 1), key=lambda i: abs(cu_window_seqlens[i] - target))
        bounds.append(cu_window_seqlens[best])
    return bounds + [total]

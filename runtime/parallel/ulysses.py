"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) for the vision tower and the LLM decoder.

Each SP rank holds a contiguous part of every sequence (uneven lengths allowed). Attention exchanges heads by
``all_to_all_single``: sequence-sharded q/k/v [B, H, s, Dh] become head-sharded [B, H/sp, S, Dh], SDPA runs on
whole sequences (per segment), and the output goes back the same way. Everything else runs on local tokens.

- Vision: after Qwen2.5-VL's window reordering, a replica's packed patch sequence is a run of attention windows;
  the SP group splits it into runs of whole windows (``split_windows``), so window-attention blocks run locally
  with rank-local ``cu_seqlens``, full-attention blocks exchange heads (one segment per image, non-causal), and
  the merger runs locally (windows are whole merge units), each rank emitting its own merged tokens.
- LLM: each sample's token sequence is split into near-equal contiguous slices (``split_sequence``); every
  decoder layer exchanges heads and runs causal SDPA over the whole sequence (one segment). Grouped-query KV heads
  fewer than (or not divisible by) the SP degree are repeated first (``kv_repeats``), which is exact.

The all-to-all pair is a small autograd Function each way; each is the other's backward, and both return early
when the degree is 1.

Shape legend: B batch, H heads (local after TP), h = H / sp, S whole sequence, s this rank's part, Dh head dim.
"""

from __future__ import annotations

import bisect
import math
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from planner.contract.rules import split_rule
from runtime.parallel.ring import RingGroup


@dataclass(kw_only=True, frozen=True)
class UlyssesGroup:
    """The SP group of one micro-batch, and how its sequence is split."""

    group: Any
    """Process group of the SP ranks (None when the degree is 1)."""
    seq_lens: tuple[int, ...]
    """Sequence positions held by each SP rank, in group-rank order."""
    rank: int
    """This rank's index in the group."""
    segment_lens: tuple[int, ...]
    """Lengths of the attention segments of the whole sequence (vision: one per image; LLM: the sequence)."""
    ring: RingGroup | None = None
    """The CP group whose ring runs the attention on the exchanged sequence (runtime.parallel.ring), if any."""
    segment_mask: Any = None
    """Under CP, a packed row's sample-and-causal mask over the CP group's positions (``segment_causal_mask``)."""
    gathered: Any = None
    """Under CP, a bidirectional module's sequence over the CP group (``GatheredSequence``): ``segment_lens`` is
    then the CP rank's whole part, one segment for the exchange."""

    @property
    def degree(self) -> int:
        return len(self.seq_lens)


def _all_to_all(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty(sum(recv_sizes))
    dist.all_to_all_single(out, x.contiguous().view(-1), recv_sizes, send_sizes, group=group)
    return out


def _seq_to_heads(x_BHsD: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
    """[B, H, s, Dh] sequence-sharded -> [B, h, S, Dh] head-sharded."""
    B, H, s, D = x_BHsD.shape
    h = H // ug.degree
    send = [h * B * s * D] * ug.degree
    recv = [h * B * n * D for n in ug.seq_lens]
    parts = _all_to_all(x_BHsD.transpose(0, 1), send, recv, ug.group).split(recv)
    return torch.cat([p.view(h, B, n, D) for p, n in zip(parts, ug.seq_lens)], dim=2).transpose(0, 1)


def _heads_to_seq(y_BhSD: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
    """[B, h, S, Dh] head-sharded -> [B, H, s, Dh] sequence-sharded (inverse of _seq_to_heads)."""
    B, h, S, D = y_BhSD.shape
    s = ug.seq_lens[ug.rank]
    send_parts = [p.reshape(-1) for p in y_BhSD.transpose(0, 1).split(list(ug.seq_lens), dim=2)]
    out = _all_to_all(torch.cat(send_parts), [p.numel() for p in send_parts], [h * B * s * D] * ug.degree, ug.group)
    return out.view(ug.degree * h, B, s, D).transpose(0, 1)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BHsD: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
        ctx.ug = ug
        return x_BHsD if ug.degree == 1 else _seq_to_heads(x_BHsD, ug)

    @staticmethod
    def backward(ctx, grad_BhSD: torch.Tensor):
        return (grad_BhSD if ctx.ug.degree == 1 else _heads_to_seq(grad_BhSD.contiguous(), ctx.ug)), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_BhSD: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
        ctx.ug = ug
        return y_BhSD if ug.degree == 1 else _heads_to_seq(y_BhSD, ug)

    @staticmethod
    def backward(ctx, grad_BHsD: torch.Tensor):
        return (grad_BHsD if ctx.ug.degree == 1 else _seq_to_heads(grad_BHsD.contiguous(), ctx.ug)), None


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How often each KV head is repeated before the exchange so that ``degree`` ranks get whole, matching groups.

    Repeating to lcm(kv_heads, degree) heads is exact: query head i of a group of g = H_q / H_kv uses KV head
    i // g, and that still holds per rank after the split because lcm(kv_heads, degree) divides H_q (both do).
    """
    return degree // math.gcd(kv_heads, degree)


def _grouped(module: nn.Module, q_heads: int, kv_heads: int) -> Any:
    """``module`` as SDPA reads it (``is_causal``, ``num_key_value_groups``), with this rank's query/KV ratio."""
    groups = q_heads // kv_heads
    if getattr(module, "num_key_value_groups", 1) == groups:
        return module
    return types.SimpleNamespace(is_causal=getattr(module, "is_causal", True), num_key_value_groups=groups)


def attention(
    core: Callable[..., tuple[torch.Tensor, Any]],
    module: nn.Module,
    q_BHsD: torch.Tensor,
    k_BKsD: torch.Tensor,
    v_BKsD: torch.Tensor,
    ug: UlyssesGroup,
    segmented: bool = True,
    **kwargs,
) -> torch.Tensor:
    """Attention of a sequence-sharded block: heads all-to-all, ``core`` (SDPA, causal if ``module.is_causal``)
    per segment of the whole sequence (or, not ``segmented``, once: a variable-length core given the segments in
    ``kwargs``), all-to-all back. K is the number of KV heads (grouped-query attention).

    Returns [B, s, H, Dh], the layout transformers' SDPA function returns.
    """
    repeats = kv_repeats(k_BKsD.shape[1], ug.degree)
    k_BKsD, v_BKsD = (t.repeat_interleave(repeats, dim=1) if repeats > 1 else t for t in (k_BKsD, v_BKsD))
    q, k, v = (SeqToHeads.apply(t, ug) for t in (q_BHsD, k_BKsD, v_BKsD))
    grouped = _grouped(module, q.shape[1], k.shape[1])
    segments = list(ug.segment_lens) if segmented else [q.shape[2]]
    outs = [
        core(grouped, qi, ki, vi, None, **kwargs)[0]
        for qi, ki, vi in zip(q.split(segments, dim=2), k.split(segments, dim=2), v.split(segments, dim=2))
    ]
    out_BhSD = torch.cat(outs, dim=1).transpose(1, 2)
    return HeadsToSeq.apply(out_BhSD.contiguous(), ug).transpose(1, 2)


def split_sequence(length: int, degree: int) -> list[int]:
    """Boundaries of ``degree`` contiguous, near-equal parts of a sequence (the first ``length % degree`` parts
    one position longer); ``degree + 1`` offsets.

    Raises:
        ValueError: fewer positions than parts.
    """
    if problem := split_rule(degree, length, "tokens", "a sequence"):
        raise ValueError(problem)
    base, extra = divmod(length, degree)
    return [part * base + min(part, extra) for part in range(degree + 1)]


def split_windows(cu_window_seqlens: list[int], degree: int) -> list[int]:
    """Boundaries (in patches) splitting a run of windows into ``degree`` contiguous parts of near-equal length.

    Returns ``degree + 1`` offsets, each one a window boundary.

    Raises:
        ValueError: fewer windows than parts.
    """
    num_windows = len(cu_window_seqlens) - 1
    if problem := split_rule(degree, num_windows, "attention windows (or merge units)", "a micro-batch"):
        raise ValueError(problem)
    total = cu_window_seqlens[-1]
    bounds, last = [0], 0
    for part in range(1, degree):
        target = total * part / degree
        lo, hi = last + 1, num_windows - (degree - part)
        # the boundary nearest the target (the earlier one on a tie) among lo..hi: the offsets increase, so it is
        # the first at or past the target or the one before it
        after = bisect.bisect_left(cu_window_seqlens, target, lo, hi + 1)
        before = max(after - 1, lo)
        after = min(after, hi)
        last = before if target - cu_window_seqlens[before] <= cu_window_seqlens[after] - target else after
        bounds.append(cu_window_seqlens[last])
    return bounds + [total]

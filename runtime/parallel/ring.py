"""Ring context parallelism (Liu et al. 2023, "Ring Attention with Blockwise Transformers") for the LLM decoder, and
its all-gather form for packed rows and the vision tower.

Each of ``cp`` ranks holds two of ``2 cp`` equal chunks of every sequence, chunk ``c`` and chunk ``2 cp - 1 - c``
(the head-tail, or zig-zag, split: every rank then has an equal share of the causal work, Brandon et al. 2023),
padded at the end to a multiple of ``2 cp`` tokens (``zigzag_positions``). Attention passes the key/value blocks
around the ring, runs the attention kernel on each (query, key/value block) pair that the causal mask leaves any
work in, and merges the partial outputs by their log-sum-exp.

What torch ships is used as is: the ring loops of ``torch.distributed.tensor.experimental``'s context parallelism
(``_templated_ring_attention`` and its backward, which rotate the blocks with functional collectives, skip or
mask each block for the head-tail layout and merge by log-sum-exp), over an SDPA kernel that returns the
log-sum-exp: on CPU ``aten._scaled_dot_product_flash_attention_for_cpu``, on CUDA the flash kernel, through
torch's own ring functions. What is hand-written here: the autograd Function joining forward and backward (torch
reaches them only by dispatching DTensor SDPA, which has no rule for the CPU kernel), the repeat of grouped-query
KV heads (the kernels take equal heads), and the sequence layout.

A packed row (a dataset plan: several samples back to back) is laid out the same way, but its attention gathers the
CP group's keys and values and attends them under each position's sample-and-causal mask in one SDPA call (the
all-gather form of context parallelism, Llama 3's): torch's ring passes one mask to every block, and a sample
boundary can fall in any of them. Its gathered keys and values are ``cp`` times a rank's own.

The vision tower's full-attention blocks (bidirectional, one segment per image or temporal group) take the
all-gather form too, without a mask: the tower's sequence of attention windows is split over the CP ranks (then
each CP rank's part over its SP ranks) in whole windows, so window blocks stay local; a full block gathers the
group's keys and values (parts of unequal length, padded for the collective) and attends each of the rank's
queries to its own segment's keys, one SDPA call per segment the rank's part meets (``GatheredSequence``): no
query waits on a causal block, so the work is the rank's share of queries, and no mask is built. torch's ring
(one segment, equal blocks) does neither.

Composed with Ulysses SP (2-D): the sequence is split over CP first, each CP rank's two chunks then over its SP
ranks; attention exchanges heads within the SP group (runtime.parallel.ulysses), which gives each rank the CP
rank's two chunks for its heads, and runs the ring over the CP group on them.

Shape legend: B batch, H heads, S the CP rank's sequence (two chunks), Dh head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

from planner.contract.rules import split_rule

aten = torch.ops.aten

SEQ_DIM = 2
"""The sequence dimension of [B, H, S, Dh] q/k/v."""


@dataclass(frozen=True)
class RingGroup:
    """The CP group a module's attention runs its ring over."""

    mesh: Any
    """The CP ranks' 1-D DeviceMesh (torch's CUDA ring functions take it; the CPU loops its process group)."""

    @property
    def group(self) -> Any:
        return self.mesh.get_group()

    @property
    def degree(self) -> int:
        return self.mesh.size()


def zigzag_positions(length: int, cp: int) -> list[torch.Tensor]:
    """Each CP rank's sequence positions, in its local order: chunks ``c`` and ``2 cp - 1 - c`` of the sequence
    padded to ``padded_length`` (positions past ``length`` are padding).

    Raises:
        ValueError: fewer tokens than chunks.
    """
    if problem := split_rule(2 * cp, length, "tokens", "a sequence split for ring context parallelism"):
        raise ValueError(problem)
    chunk = padded_length(length, cp) // (2 * cp)
    return [torch.cat([torch.arange(c * chunk, (c + 1) * chunk),
                       torch.arange((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk)]) for c in range(cp)]


def padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to a multiple of ``2 cp`` (each rank's two chunks are then equal, as the ring's causal
    block skipping assumes). The pad tokens come last: under the causal mask no real token attends to them."""
    return -(-length // (2 * cp)) * (2 * cp)


class _RingAttention(torch.autograd.Function):
    """Causal ring attention of this rank's [B, H, S, Dh] q/k/v over ``ring``; returns [B, H, S, Dh]."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingGroup, scale: float | None
                ) -> torch.Tensor:
        if q.is_cuda:
            out, lse, *rest = torch_cp._scaled_dot_product_ring_flash_attention(ring.mesh, q, k, v, is_causal=True,
                                                                                  scale=scale)
        else:
            out, lse = torch_cp._templated_ring_attention(
                ring.group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True,
                dropout_p=0.0, scale=scale)[:2]
            rest = []
        ctx.ring, ctx.scale, ctx.rest = ring, scale, rest
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if q.is_cuda:
            cum_q, cum_k, max_q, max_k, seed, offset, _ = ctx.rest
            grads = torch_cp._scaled_dot_product_ring_flash_attention_backward(
                ctx.ring.mesh, grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset,
                scale=ctx.scale)
        else:
            grads = torch_cp._templated_ring_attention_backward(
                ctx.ring.group, SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward, grad_out,
                "grad_out", q, k, v, out, lse, True, dropout_p=0.0, scale=ctx.scale)
        return grads[0], grads[1], grads[2], None, None


class _GatherParts(torch.autograd.Function):
    """[B, H, S_c, Dh] of each CP rank, the parts of lengths ``lens`` -> [B, H, sum(lens), Dh] in rank order (padded
    to the longest for the collective); backward sums the gradient over the group (an all-reduce) and keeps this
    rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ring: RingGroup, lens: tuple[int, ...]) -> torch.Tensor:
        ctx.ring, ctx.lens = ring, lens
        longest = max(lens)
        padded = F.pad(x, (0, 0, 0, longest - x.shape[SEQ_DIM])).contiguous()
        parts = [torch.empty_like(padded) for _ in lens]
        dist.all_gather(parts, padded, group=ring.group)
        return torch.cat([p.narrow(SEQ_DIM, 0, n) for p, n in zip(parts, lens)], dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        longest = max(ctx.lens)
        parts = [F.pad(g, (0, 0, 0, longest - g.shape[SEQ_DIM])) for g in grad.split(list(ctx.lens), dim=SEQ_DIM)]
        summed = torch.stack(parts).contiguous()
        dist.all_reduce(summed, group=ctx.ring.group)
        rank = dist.get_rank(ctx.ring.group)
        return summed[rank].narrow(SEQ_DIM, 0, ctx.lens[rank]), None, None


@dataclass(frozen=True)
class GatheredSequence:
    """How a bidirectional module's sequence lies over its CP group (the vision tower: ``shard_vision_batch``)."""

    part_lens: tuple[int, ...]
    """Positions each CP rank holds, in rank order (contiguous parts of the sequence)."""
    segment_lens: tuple[int, ...]
    """Lengths of the sequence's attention segments (one per image or temporal group), back to back."""
    rank: int
    """This rank's index in the CP group."""

    def query_segments(self) -> list[tuple[int, int, int, int]]:
        """(first query, end of queries) of this rank's part and (first key, end of keys) of the whole sequence,
        for each segment the rank's part meets, in order."""
        start = sum(self.part_lens[:self.rank])
        end = start + self.part_lens[self.rank]
        spans, a = [], 0
        for length in self.segment_lens:
            b = a + length
            if a < end and b > start:
                spans.append((max(a, start) - start, min(b, end) - start, a, b))
            a = b
        return spans


def gathered_bidirectional_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ring: RingGroup,
                                     layout: GatheredSequence, scaling: float | None) -> torch.Tensor:
    """Bidirectional attention of this rank's [B, H, S_c, Dh] queries over the CP group's keys and values, each
    query attending its own segment (module docstring); returns [B, H, S_c, Dh]."""
    key, value = (_GatherParts.apply(t, ring, layout.part_lens) for t in (key, value))
    outs = [F.scaled_dot_product_attention(query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], scale=scaling)
            for q0, q1, k0, k1 in layout.query_segments()]
    return torch.cat(outs, dim=SEQ_DIM)


def segment_causal_mask(positions: list[torch.Tensor], segment_of: torch.Tensor, rank: int) -> torch.Tensor:
    """[S, cp * S] booleans: which positions of the gathered sequence (every CP rank's, in rank order) each of CP rank
    ``rank``'s positions attends to: those of its own sample (``segment_of``: the sample of every position of the
    row), at or before it."""
    mine, every = positions[rank], torch.cat(positions)
    same = segment_of[mine][:, None] == segment_of[every][None, :]
    return same & (every[None, :] <= mine[:, None])


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: None, *, ring: RingGroup, scaling: float | None = None,
                           segment_mask: torch.Tensor | None = None, gathered: GatheredSequence | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """Causal ring attention under SDPA's contract (q/k/v [B, H, S, Dh] in, [B, S, H, Dh] out); grouped-query KV
    heads are repeated to the query heads first. A packed row (``segment_mask``, ``segment_causal_mask``) gathers
    the group's keys and values instead and attends them under the mask in one SDPA call: torch's ring loops pass one
    mask to every block, and a sample's boundary falls anywhere in them. A bidirectional module (the vision tower)
    attends per segment over the gathered sequence (``gathered``: ``gathered_bidirectional_attention``)."""
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    if not getattr(module, "is_causal", True):
        if gathered is None:
            raise NotImplementedError("bidirectional attention over CP needs its sequence's layout (GatheredSequence)")
        return gathered_bidirectional_attention(query, key, value, ring, gathered, scaling).transpose(1, 2), None
    if segment_mask is not None:
        key, value = (_GatherParts.apply(t, ring, (t.shape[SEQ_DIM],) * ring.degree) for t in (key, value))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=segment_mask.to(query.device),
                                             scale=scaling)
        return out.transpose(1, 2), None
    if not torch_cp._cp_options.enable_load_balance:
        raise RuntimeError("torch's context-parallel load balancing is off: the head-tail layout needs it on")
    out = _RingAttention.apply(query.contiguous(), key.contiguous(), value.contiguous(), ring, scaling)
    return out.transpose(1, 2), None

"""Hand vision outputs to the LLM's layout and their gradients back, by point-to-point messages.

One global micro-batch of ``B`` samples, ``T`` merged image tokens each, is split two ways: vision DP replica
``d`` (with its SP ranks ``k``) produced the tokens of samples ``[d*mb_v, (d+1)*mb_v)``, window-ordered; LLM
replica ``e`` needs those of samples ``[e*mb_l, (e+1)*mb_l)`` in sample order. Each piece (d, k) is sent by the
piece's first TP rank to every LLM rank whose samples it touches; the LLM rank places the rows it needs.
Gradients go back from one rank of each LLM replica (its first cp/sp/tp rank: the others hold the same values)
to every TP rank of the piece, which sums what it receives. Works the same for colocated placement (messages
to oneself are copies) and disjoint placement (vision and LLM on different ranks).

Shape legend: m rows of one piece, D LLM hidden size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from runtime.parallel_dims import ParallelDims

FORWARD_TAG = 1 << 20
BACKWARD_TAG = 2 << 20


@dataclass(kw_only=True, frozen=True)
class Piece:
    """The merged tokens one vision SP rank emits for one micro-batch."""

    replica: int
    """Vision DP replica d."""
    sp_rank: int
    """SP index k within the replica."""
    positions: torch.Tensor
    """Global (micro-batch) token index of each row."""
    producer: int
    """Rank that sends the rows (the piece's first TP rank)."""
    owners: tuple[int, ...]
    """Ranks that ran the piece and take its gradient (all its TP ranks)."""


def build_pieces(vision: ParallelDims, positions_per_rank: list[torch.Tensor], tokens_per_replica: int) -> list[Piece]:
    """Every vision piece of a micro-batch, given each SP rank's replica-order positions."""
    pieces = []
    for d in range(vision.dp):
        for k in range(vision.sp):
            owners = tuple(vision.ranks_where(dp=d, sp=k))
            pieces.append(
                Piece(replica=d, sp_rank=k, positions=positions_per_rank[k] + d * tokens_per_replica,
                      producer=owners[0], owners=owners)
            )
    return pieces


@dataclass
class Posted:
    """Messages in flight for one micro-batch in one direction; ``Handoff.wait`` completes them."""

    works: list
    """Outstanding point-to-point operations."""
    finish: Callable[[], torch.Tensor | None]
    """Assembles what was received (None when this rank receives nothing)."""


class Handoff:
    """Routes one micro-batch's vision pieces to LLM ranks and their gradients back; tracks time spent waiting.

    Each direction has its own process group, and a rank posts all its sends and receives of one direction
    and micro-batch in one ``batch_isend_irecv``: with NCCL (which ignores tags and runs a pair's messages in
    order on one stream) this keeps forward sends from queueing behind backward receives, and a colocated
    rank's simultaneous send and receive with the same peer from deadlocking.
    """

    def __init__(self, *, vision: ParallelDims, llm: ParallelDims, pieces: list[Piece], tokens_per_sample: int,
                 vision_trainable: bool, hidden: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.rank, self.hidden, self.dtype, self.device = rank, hidden, dtype, device
        self.vision_trainable = vision_trainable
        self.pieces = pieces
        self.span = llm.micro_batch * tokens_per_sample
        self.llm = llm
        self.groups = {FORWARD_TAG: dist.new_group(), BACKWARD_TAG: dist.new_group()}
        if device.type == "cuda":  # create the NCCL communicators now, on every rank together
            for group in self.groups.values():
                dist.barrier(group=group, device_ids=[device.index or 0])
        self._mailbox: dict[int, torch.Tensor] = {}
        self.comm_seconds = 0.0

    def _llm_range(self, llm_rank: int) -> tuple[int, int]:
        start = self.llm.coordinate(llm_rank)["dp"] * self.span
        return start, start + self.span

    def _kept(self, piece: Piece, llm_rank: int) -> torch.Tensor:
        """Mask of the piece's rows that LLM rank ``llm_rank`` uses."""
        start, end = self._llm_range(llm_rank)
        return (piece.positions >= start) & (piece.positions < end)

    def _is_gradient_sender(self, llm_rank: int) -> bool:
        coord = self.llm.coordinate(llm_rank)
        return coord["cp"] == 0 and coord["sp"] == 0 and coord["tp"] == 0

    def _my_piece(self) -> Piece:
        return next(p for p in self.pieces if self.rank in p.owners)

    def _buffer(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.hidden, dtype=self.dtype, device=self.device)

    def _post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], direction: int,
              micro: int) -> list:
        """Messages to oneself are copies; the rest go out in one batch on the direction's group."""
        group, tag, ops = self.groups[direction], direction + micro, []
        for tensor, dst in sends:
            if dst == self.rank:
                self._mailbox[tag] = tensor.detach().clone()
            else:
                ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), dst, group=group, tag=tag))
        for buffer, src in recvs:
            if src == self.rank:
                buffer.copy_(self._mailbox.pop(tag))
            else:
                ops.append(dist.P2POp(dist.irecv, buffer, src, group=group, tag=tag))
        return dist.batch_isend_irecv(ops) if ops else []

    def activations(self, rows_mD: torch.Tensor | None, micro: int) -> Posted:
        """Post this rank's part of the hand-off: its piece's rows if it produces one (``rows_mD``), and the
        receives of the pieces its LLM replica needs if it holds the LLM. ``finish`` gives the replica's image
        tokens [B_l*T, D] in sample order (a leaf; set requires_grad to collect its gradient)."""
        sends, recvs = [], []
        if rows_mD is not None and self.rank == self._my_piece().producer:
            rows = rows_mD.to(self.dtype)  # receivers allocate buffers of the hand-off dtype
            sends = [(rows, dst) for dst in self.llm.ranks if self._kept(self._my_piece(), dst).any()]
        receive = self.rank in self.llm.ranks
        if receive:
            needed = [p for p in self.pieces if self._kept(p, self.rank).any()]
            recvs = [(self._buffer(len(p.positions)), p.producer) for p in needed]
        works = self._post(sends, recvs, FORWARD_TAG, micro)

        def finish() -> torch.Tensor | None:
            if not receive:
                return None
            start = self._llm_range(self.rank)[0]
            embeds = self._buffer(self.span)
            received = dict((src, buf) for buf, src in recvs)
            for piece in self.pieces:
                if piece.producer in received:
                    keep = self._kept(piece, self.rank)
                    rows = received[piece.producer][keep.to(self.device)]
                    embeds[(piece.positions[keep] - start).to(self.device)] = rows
            return embeds

        return Posted(works=works, finish=finish)

    def gradients(self, grad_MD: torch.Tensor | None, micro: int) -> Posted:
        """Post this rank's part of the hand-back: the gradient of every piece its LLM replica used (from the
        replica's gradient sender, ``grad_MD``), and, on vision ranks, the receives of its own piece's
        gradient. ``finish`` gives that gradient [m, D], summed over senders."""
        sends, recvs = [], []
        if self.vision_trainable and grad_MD is not None and self._is_gradient_sender(self.rank):
            start = self._llm_range(self.rank)[0]
            for piece in self.pieces:
                keep = self._kept(piece, self.rank)
                if keep.any():
                    grad = torch.zeros(len(piece.positions), self.hidden, dtype=grad_MD.dtype, device=grad_MD.device)
                    grad[keep.to(self.device)] = grad_MD[(piece.positions[keep] - start).to(self.device)]
                    sends += [(grad, dst) for dst in piece.owners]
        receive = self.vision_trainable and any(self.rank in p.owners for p in self.pieces)
        if receive:
            piece = self._my_piece()
            senders = [r for r in self.llm.ranks if self._is_gradient_sender(r) and self._kept(piece, r).any()]
            recvs = [(self._buffer(len(piece.positions)), src) for src in senders]
        works = self._post(sends, recvs, BACKWARD_TAG, micro)
        return Posted(works=works, finish=lambda: torch.stack([b for b, _ in recvs]).sum(0) if receive else None)

    def wait(self, posted: Posted) -> torch.Tensor | None:
        """Complete posted messages (timed as communication) and return what was received."""
        start = time.perf_counter()
        for work in posted.works:
            work.wait()
        self.comm_seconds += time.perf_counter() - start
        return posted.finish()

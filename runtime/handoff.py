"""Hand vision outputs to the LLM's layout and their gradients back, by point-to-point messages.

One global micro-batch of ``B`` samples, ``T`` merged image tokens each, is split two ways: vision DP replica
``d`` (with its SP ranks ``k``) produced the tokens of samples ``[d*mb_v, (d+1)*mb_v)``, window-ordered; LLM
rank (dp ``e``, sp ``j``) needs, of samples ``[e*mb_l, (e+1)*mb_l)``, the image tokens its sequence slice holds
(all of them without LLM SP), in sample order (``llm_needs``). Each piece (d, k) is sent by the piece's first TP
rank to every LLM rank that needs some of its rows, and only those rows. Gradients go back from the first TP
rank of every LLM (dp, sp) coordinate (its TP ranks hold the same values) to every TP rank of each piece it
used, which places the rows it receives (every row comes from exactly one sender). Works the same for colocated
placement (messages to oneself are copies) and disjoint placement (vision and LLM on different ranks).

Shape legend: m rows of one piece, n image tokens of one LLM rank, D LLM hidden size.
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


def llm_needs(
    llm: ParallelDims, slots_per_sp_rank: list[torch.Tensor], tokens_per_sample: int
) -> dict[int, torch.Tensor]:
    """Global (micro-batch) index of every image token each LLM rank places, in its local order (sample-major).

    Args:
        llm: the LLM's degrees.
        slots_per_sp_rank: for each LLM SP rank, which of a sample's ``tokens_per_sample`` image tokens its
            slice holds (runtime.llm.image_slots_per_rank).
        tokens_per_sample: merged image tokens per sample.
    """
    needs = {}
    for rank in llm.ranks:
        coord = llm.coordinate(rank)
        samples = coord["dp"] * llm.micro_batch + torch.arange(llm.micro_batch)
        needs[rank] = (samples[:, None] * tokens_per_sample + slots_per_sp_rank[coord["sp"]][None, :]).flatten()
    return needs


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

    def __init__(self, *, llm: ParallelDims, pieces: list[Piece], needs: dict[int, torch.Tensor],
                 vision_trainable: bool, hidden: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.rank, self.hidden, self.dtype, self.device = rank, hidden, dtype, device
        self.vision_trainable = vision_trainable
        self.pieces = pieces
        self.llm = llm
        self.needs = needs
        routes = (((i, r), self._route(p, needs[r])) for i, p in enumerate(pieces) for r in llm.ranks)
        self.routes = {key: route for key, route in routes if route is not None}
        """(piece index, LLM rank) -> (mask of the piece's rows that rank needs, their index among its own rows)."""
        self.groups = {FORWARD_TAG: dist.new_group(), BACKWARD_TAG: dist.new_group()}
        if device.type == "cuda":  # create the NCCL communicators now, on every rank together
            for group in self.groups.values():
                dist.barrier(group=group, device_ids=[device.index or 0])
        self._mailbox: dict[int, torch.Tensor] = {}
        self.comm_seconds = 0.0

    def _route(self, piece: Piece, needed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Which of the piece's rows an LLM rank needs (mask) and where they go among its own rows; None if none."""
        keep = torch.isin(piece.positions, needed)
        if not keep.any():
            return None
        return keep.to(self.device), torch.searchsorted(needed, piece.positions[keep]).to(self.device)

    def _is_gradient_sender(self, llm_rank: int) -> bool:
        coord = self.llm.coordinate(llm_rank)
        return coord["cp"] == 0 and coord["tp"] == 0

    def _my_piece(self) -> int:
        return next(i for i, p in enumerate(self.pieces) if self.rank in p.owners)

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
        """Post this rank's part of the hand-off: its piece's rows if it produces one (``rows_mD``), each LLM rank
        getting the rows it needs, and the receives of the rows this rank needs if it holds the LLM. ``finish``
        gives this LLM rank's image tokens [n, D] in its local order (a leaf; set requires_grad to collect its
        gradient)."""
        sends, recvs = [], []
        if rows_mD is not None and self.rank == self.pieces[self._my_piece()].producer:
            rows = rows_mD.to(self.dtype)  # receivers allocate buffers of the hand-off dtype
            mine = self._my_piece()
            sends = [(rows[keep], dst) for (i, dst), (keep, _) in self.routes.items() if i == mine]
        receive = self.rank in self.llm.ranks
        if receive:
            mine = [(i, route) for (i, dst), route in self.routes.items() if dst == self.rank]
            recvs = [(self._buffer(int(keep.sum())), self.pieces[i].producer) for i, (keep, _) in mine]
        works = self._post(sends, recvs, FORWARD_TAG, micro)

        def finish() -> torch.Tensor | None:
            if not receive:
                return None
            embeds = self._buffer(len(self.needs[self.rank]))
            for (_, (_, rows)), (buffer, _) in zip(mine, recvs):
                embeds[rows] = buffer
            return embeds

        return Posted(works=works, finish=finish)

    def gradients(self, grad_nD: torch.Tensor | None, micro: int) -> Posted:
        """Post this rank's part of the hand-back: on a gradient sender, the gradient rows (of ``grad_nD``) of
        every piece it used, to all the piece's ranks; on vision ranks, the receives of their own piece's rows.
        ``finish`` gives that piece's gradient [m, D]."""
        sends, recvs = [], []
        if self.vision_trainable and grad_nD is not None and self._is_gradient_sender(self.rank):
            for (i, dst), (_, rows) in self.routes.items():
                if dst == self.rank:
                    sends += [(grad_nD[rows], owner) for owner in self.pieces[i].owners]
        receive = self.vision_trainable and any(self.rank in p.owners for p in self.pieces)
        if receive:
            mine = self._my_piece()
            routes = [(r, keep) for (i, r), (keep, _) in self.routes.items()
                      if i == mine and self._is_gradient_sender(r)]
            recvs = [(self._buffer(int(keep.sum())), r) for r, keep in routes]
        works = self._post(sends, recvs, BACKWARD_TAG, micro)

        def finish() -> torch.Tensor | None:
            if not receive:
                return None
            grad = torch.zeros(len(self.pieces[mine].positions), self.hidden, dtype=self.dtype, device=self.device)
            for (_, keep), (buffer, _) in zip(routes, recvs):
                grad[keep] = buffer
            return grad

        return Posted(works=works, finish=finish)

    def wait(self, posted: Posted) -> torch.Tensor | None:
        """Complete posted messages (timed as communication) and return what was received."""
        start = time.perf_counter()
        for work in posted.works:
            work.wait()
        self.comm_seconds += time.perf_counter() - start
        return posted.finish()

"""Hand vision outputs to the LLM's layout and their gradients back, by point-to-point messages.

One global micro-batch of ``B`` samples (or packs) is split two ways: vision DP replica ``d`` (with its SP ranks
``k``) produced the image tokens of samples ``[d*mb_v, (d+1)*mb_v)`` (a dataset plan: of the images the per-step
assignment gave it, from any LLM replica's packs, and a filler's that go nowhere), window-ordered; LLM rank (dp
``e``, cp ``c``, sp ``j``) needs, of samples ``[e*mb_l, (e+1)*mb_l)``, the image tokens its sequence slice holds (all
of them without LLM SP or CP), in its local order (``llm_needs``). Samples may differ in images and lengths: the routes
(``Routes``) are built per micro-batch from its image grids and image-token positions, which every rank knows
before any data is read.
Each piece (d, k) is sent by the piece's first TP rank to every LLM rank that needs some of its rows, and only
those rows. Gradients go back from the first TP rank of every LLM (dp, cp, sp) coordinate (its TP ranks hold the same
values) to every TP rank of each piece it used, which places the rows it receives (every row comes from exactly
one sender). Works the same for colocated placement (messages to oneself are copies) and disjoint placement
(vision and LLM on different ranks).

A row is an image token's hand-off: its merged output, followed by its injected features where the family has
them (runtime.models.families ``handoff_tensors``), ``width`` values in all.

Shape legend: m rows of one piece, n image tokens of one LLM rank, W row width.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from runtime.parallel.parallel_dims import ParallelDims

FORWARD_TAG = 1 << 20
BACKWARD_TAG = 2 << 20


@dataclass(kw_only=True, frozen=True)
class Piece:
    """The merged tokens one vision sequence rank (CP x SP) emits for one micro-batch."""

    replica: int
    """Vision DP replica d."""
    sp_rank: int
    """Sequence index k within the replica (``ParallelDims.sequence_rank``)."""
    positions: torch.Tensor
    """Global (micro-batch) token index of each row."""
    producer: int
    """Rank that sends the rows (the piece's first TP rank)."""
    owners: tuple[int, ...]
    """Ranks that ran the piece and take its gradient (all its TP ranks)."""


def build_pieces(vision: ParallelDims, positions: list[list[torch.Tensor]], orders: list[torch.Tensor]
                 ) -> list[Piece]:
    """Every vision piece of a micro-batch, given each replica's sequence ranks' replica-order positions
    (``positions[d][k]``) and the micro-batch index of each of a replica's tokens in replica order (``orders[d]``;
    -1: a filler's, which no LLM rank takes)."""
    pieces = []
    for d in range(vision.dp):
        for k in range(vision.sequence_ranks):
            owners = tuple(vision.ranks_where(dp=d, cp=k // vision.sp, sp=k % vision.sp))
            pieces.append(Piece(replica=d, sp_rank=k, positions=orders[d][positions[d][k]], producer=owners[0],
                                owners=owners))
    return pieces


def llm_needs(llm: ParallelDims, slots: list[list[torch.Tensor]], offsets: list[int]) -> dict[int, torch.Tensor]:
    """Global (micro-batch) index of every image token each LLM rank places, in its local order.

    Args:
        llm: the LLM's degrees.
        slots: ``slots[e][j]``, which of replica ``e``'s image tokens (in its own order) sequence rank ``j`` (CP rank
            ``j // sp``'s SP rank ``j % sp``) holds (runtime.models.llm.image_slots_per_rank).
        offsets: where replica ``e``'s image tokens start in the micro-batch.
    """
    needs = {}
    for rank in llm.ranks:
        replica = llm.coordinate(rank)["dp"]
        needs[rank] = slots[replica][llm.sequence_rank(rank)] + offsets[replica]
    return needs


@dataclass(kw_only=True, frozen=True)
class Routes:
    """Who sends which rows of one micro-batch to whom."""

    pieces: list[Piece]
    needs: dict[int, torch.Tensor]
    """LLM rank -> global index of each image token it places (``llm_needs``)."""
    table: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(piece index, LLM rank) -> (mask of the piece's rows that rank needs, their index among its own rows)."""

    @classmethod
    def build(cls, vision: ParallelDims, llm: ParallelDims, vision_positions: list[list[torch.Tensor]],
              llm_slots: list[list[torch.Tensor]], device: torch.device,
              vision_orders: list[torch.Tensor] | None = None) -> Routes:
        """The routes of a micro-batch whose vision replica ``d``'s SP rank ``k`` emits the tokens
        ``vision_positions[d][k]`` of the replica's images, and whose LLM replica ``e``'s SP rank ``j`` places the
        replica's image tokens ``llm_slots[e][j]``. The micro-batch's image tokens are the LLM replicas' in replica
        order; ``vision_orders[d]`` gives the micro-batch index of each of vision replica ``d``'s tokens (-1: a
        filler's), by default the replicas' tokens following each other in replica order."""
        if vision_orders is None:
            produced = [sum(len(p) for p in replica) for replica in vision_positions]
            vision_orders = [torch.arange(a, a + n) for a, n in zip(itertools.accumulate(produced, initial=0),
                                                                    produced)]
        placed = [sum(len(s) for s in replica) for replica in llm_slots]
        emitted = torch.sort(torch.cat(vision_orders)).values
        emitted = emitted[emitted >= 0]
        assert torch.equal(emitted, torch.arange(sum(placed))), (
            f"vision emits {len(emitted)} image tokens (each once: {len(emitted.unique()) == len(emitted)}), "
            f"the LLM places {sum(placed)}")
        pieces = build_pieces(vision, vision_positions, vision_orders)
        needs = llm_needs(llm, llm_slots, list(itertools.accumulate(placed[:-1], initial=0)))
        table = {}
        for i, piece in enumerate(pieces):
            for rank in llm.ranks:
                keep = torch.isin(piece.positions, needs[rank])
                if keep.any():
                    rows = torch.searchsorted(needs[rank], piece.positions[keep])
                    table[(i, rank)] = (keep.to(device), rows.to(device))
        return cls(pieces=pieces, needs=needs, table=table)


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

    def __init__(self, *, llm: ParallelDims, encoder_trainable: bool, width: int, rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.rank, self.width, self.dtype, self.device = rank, width, dtype, device
        self.encoder_trainable = encoder_trainable
        self.llm = llm
        self.groups = {FORWARD_TAG: dist.new_group(), BACKWARD_TAG: dist.new_group()}
        if device.type == "cuda":  # create the NCCL communicators now, on every rank together
            for group in self.groups.values():
                dist.barrier(group=group, device_ids=[device.index or 0])
        self._mailbox: dict[int, torch.Tensor] = {}
        self.comm_seconds = 0.0
        self.waits: list[tuple[float, float]] = []
        """(start, end) perf_counter seconds of each wait of the step (runtime.observability.trace)."""

    def _is_gradient_sender(self, llm_rank: int) -> bool:
        return self.llm.coordinate(llm_rank)["tp"] == 0

    def _my_piece(self, routes: Routes) -> int:
        return next(i for i, p in enumerate(routes.pieces) if self.rank in p.owners)

    def _buffer(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.width, dtype=self.dtype, device=self.device)

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

    def activations(self, rows_mW: torch.Tensor | None, micro: int, routes: Routes) -> Posted:
        """Post this rank's part of the hand-off: its piece's rows if it produces one (``rows_mW``), each LLM rank
        getting the rows it needs, and the receives of the rows this rank needs if it holds the LLM. ``finish``
        gives this LLM rank's image tokens [n, D] in its local order (a leaf; set requires_grad to collect its
        gradient)."""
        sends, recvs = [], []
        if rows_mW is not None and self.rank == routes.pieces[self._my_piece(routes)].producer:
            rows = rows_mW.to(self.dtype)  # receivers allocate buffers of the hand-off dtype
            mine = self._my_piece(routes)
            sends = [(rows[keep], dst) for (i, dst), (keep, _) in routes.table.items() if i == mine]
        receive = self.rank in self.llm.ranks
        if receive:
            placed = [(i, route) for (i, dst), route in routes.table.items() if dst == self.rank]
            recvs = [(self._buffer(int(keep.sum())), routes.pieces[i].producer) for i, (keep, _) in placed]
        works = self._post(sends, recvs, FORWARD_TAG, micro)

        def finish() -> torch.Tensor | None:
            if not receive:
                return None
            embeds = self._buffer(len(routes.needs[self.rank]))
            for (_, (_, rows)), (buffer, _) in zip(placed, recvs):
                embeds[rows] = buffer
            return embeds

        return Posted(works=works, finish=finish)

    def gradients(self, grad_nW: torch.Tensor | None, micro: int, routes: Routes) -> Posted:
        """Post this rank's part of the hand-back: on a gradient sender, the gradient rows (of ``grad_nW``) of
        every piece it used, to all the piece's ranks; on vision ranks, the receives of their own piece's rows.
        ``finish`` gives that piece's gradient [m, D]."""
        sends, recvs = [], []
        if self.encoder_trainable and grad_nW is not None and self._is_gradient_sender(self.rank):
            for (i, dst), (_, rows) in routes.table.items():
                if dst == self.rank:
                    sends += [(grad_nW[rows], owner) for owner in routes.pieces[i].owners]
        receive = self.encoder_trainable and any(self.rank in p.owners for p in routes.pieces)
        if receive:
            mine = self._my_piece(routes)
            senders = [(r, keep) for (i, r), (keep, _) in routes.table.items()
                       if i == mine and self._is_gradient_sender(r)]
            recvs = [(self._buffer(int(keep.sum())), r) for r, keep in senders]
        works = self._post(sends, recvs, BACKWARD_TAG, micro)

        def finish() -> torch.Tensor | None:
            if not receive:
                return None
            grad = torch.zeros(len(routes.pieces[mine].positions), self.width, dtype=self.dtype, device=self.device)
            for (_, keep), (buffer, _) in zip(senders, recvs):
                grad[keep] = buffer
            return grad

        return Posted(works=works, finish=finish)

    def wait(self, posted: Posted) -> torch.Tensor | None:
        """Complete posted messages (timed as communication) and return what was received."""
        start = time.perf_counter()
        for work in posted.works:
            work.wait()
        end = time.perf_counter()
        self.comm_seconds += end - start
        self.waits.append((start, end))
        return posted.finish()

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


class Handoff:
    """Routes one micro-batch's vision pieces to LLM ranks and their gradients back; tracks time spent waiting."""

    def __init__(self, *, vision: ParallelDims, llm: ParallelDims, pieces: list[Piece], tokens_per_sample: int,
                 gradients: bool, hidden: int, rank: int, dtype: torch.dtype, device: torch.device):
        self.rank = rank
        self.gradients = gradients
        self.hidden = hidden
        self.dtype = dtype
        self.device = device
        self.pieces = pieces
        self.span = llm.micro_batch * tokens_per_sample
        self.llm_ranks = llm.ranks
        self.llm = llm
        self._mailbox: dict[int, torch.Tensor] = {}
        self._in_flight: list[torch.Tensor] = []
        self.comm_seconds = 0.0

    def _llm_range(self, llm_rank: int) -> tuple[int, int]:
        start = self.llm.coordinate(llm_rank)["dp"] * self.span
        return start, start + self.span

    def _touches(self, piece: Piece, llm_rank: int) -> bool:
        start, end = self._llm_range(llm_rank)
        return bool(((piece.positions >= start) & (piece.positions < end)).any())

    def _is_gradient_sender(self, llm_rank: int) -> bool:
        coord = self.llm.coordinate(llm_rank)
        return coord["cp"] == 0 and coord["sp"] == 0 and coord["tp"] == 0

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> list[dist.Work]:
        if dst == self.rank:
            self._mailbox[tag] = tensor.detach().clone()
            return []
        tensor = tensor.detach().contiguous()
        self._in_flight.append(tensor)  # kept alive until the send is waited on
        return [dist.isend(tensor, dst, tag=tag)]

    def _recv(self, buffer: torch.Tensor, src: int, tag: int) -> list[dist.Work]:
        if src == self.rank:
            buffer.copy_(self._mailbox.pop(tag))
            return []
        return [dist.irecv(buffer, src, tag=tag)]

    def _wait(self, works: list[dist.Work]) -> None:
        start = time.perf_counter()
        for work in works:
            work.wait()
        self.comm_seconds += time.perf_counter() - start

    def _my_piece(self) -> Piece:
        return next(p for p in self.pieces if self.rank in p.owners)

    def send_activations(self, rows_mD: torch.Tensor, micro: int) -> list[dist.Work]:
        """Vision side: post the sends of this rank's piece (only its producer sends). Returns works to wait on."""
        piece = self._my_piece()
        if self.rank != piece.producer:
            return []
        return [w for dst in self.llm_ranks if self._touches(piece, dst) for w in self._send(rows_mD, dst, FORWARD_TAG + micro)]

    def recv_activations(self, micro: int) -> torch.Tensor:
        """LLM side: this replica's image tokens [B_l*T, D] in sample order (a leaf; set requires_grad to collect
        its gradient)."""
        start, end = self._llm_range(self.rank)
        buffers = {p.producer: torch.empty(len(p.positions), self.hidden, dtype=self.dtype, device=self.device)
                   for p in self.pieces if self._touches(p, self.rank)}
        self._wait([w for src, buf in buffers.items() for w in self._recv(buf, src, FORWARD_TAG + micro)])
        embeds = torch.empty(self.span, self.hidden, dtype=self.dtype, device=self.device)
        for piece in self.pieces:
            if piece.producer in buffers:
                keep = (piece.positions >= start) & (piece.positions < end)
                embeds[piece.positions[keep] - start] = buffers[piece.producer][keep]
        return embeds

    def send_gradients(self, grad_MD: torch.Tensor, micro: int) -> list[dist.Work]:
        """LLM side: post the gradient of every piece this replica used back to the piece's owners."""
        if not self.gradients or not self._is_gradient_sender(self.rank):
            return []
        start, end = self._llm_range(self.rank)
        works = []
        for piece in self.pieces:
            keep = (piece.positions >= start) & (piece.positions < end)
            if keep.any():
                grad = torch.zeros(len(piece.positions), self.hidden, dtype=grad_MD.dtype, device=grad_MD.device)
                grad[keep] = grad_MD[piece.positions[keep] - start]
                works += [w for dst in piece.owners for w in self._send(grad, dst, BACKWARD_TAG + micro)]
        return works

    def recv_gradients(self, micro: int) -> torch.Tensor:
        """Vision side: the summed gradient of this rank's piece [m, D]."""
        piece = self._my_piece()
        senders = [r for r in self.llm_ranks if self._is_gradient_sender(r) and self._touches(piece, r)]
        buffers = [torch.empty(len(piece.positions), self.hidden, dtype=self.dtype, device=self.device) for _ in senders]
        self._wait([w for src, buf in zip(senders, buffers) for w in self._recv(buf, src, BACKWARD_TAG + micro)])
        return torch.stack(buffers).sum(0)

    def wait(self, works: list[dist.Work]) -> None:
        """Wait for posted sends, counting the time as communication."""
        self._wait(works)

    def release(self) -> None:
        """Drop the buffers of sends already waited on (call once per step, after all waits)."""
        self._in_flight.clear()

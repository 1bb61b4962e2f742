"""The LLM's next-token cross-entropy, whole or chunked.

Chunked (a plan's ``loss_chunk_tokens``): the final hidden states go through lm_head and the loss a chunk of
tokens at a time, each chunk under ``torch.utils.checkpoint``, so only one chunk's logits (bf16, their fp32 upcast
and log-softmax) live at once, in forward and again in backward, which recomputes them. At 100K+ tokens per rank
the whole slice's logits would take tens of GiB (Hsu et al. 2024, "Liger Kernel", Sec. 3.3: fused linear
cross-entropy; priced by ``planner.cost.memory.chunked_loss_logits_bytes``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.data.samples import IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` [..., V] (fp32 log-softmax; vocab-parallel DTensors under ``loss_parallel``)
    against ``targets`` [...], summed over the positions that have a target."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def _chunk_loss(lm_head: nn.Module, hidden_TD: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    return cross_entropy_sum(lm_head(hidden_TD), targets_T)


def chunked_cross_entropy_sum(lm_head: nn.Module, hidden_BLD: torch.Tensor, targets_BL: torch.Tensor,
                              chunk_tokens: int) -> torch.Tensor:
    """``cross_entropy_sum(lm_head(hidden_BLD), targets_BL)`` formed ``chunk_tokens`` tokens at a time, each chunk's
    logits recomputed in backward rather than saved."""
    hidden_TD, targets_T = hidden_BLD.flatten(0, 1), targets_BL.flatten()
    losses = [checkpoint(_chunk_loss, lm_head, hidden, targets, use_reentrant=False)
              for hidden, targets in zip(hidden_TD.split(chunk_tokens), targets_T.split(chunk_tokens))]
    return sum(losses[1:], losses[0])

"""The runtime's attention kernel, registered with transformers' attention interface.

transformers dispatches every attention module of a model to the function named by
``config._attn_implementation``; the runtime builds its model with ``ATTENTION`` (below), which is SDPA exactly,
plus two options the parallel plans switch on per module:

- ``ulysses_group=UlyssesGroup`` passed as a call kwarg (vision full-attention blocks and every LLM decoder layer
  under sequence parallelism): heads are exchanged by all-to-all around the SDPA call
  (runtime.parallel.ulysses). The mask transformers built for the local slice is not used: the SDPA runs per
  segment of the whole sequence, causal exactly when the module is (the runtime passes no padding masks);
- ``module.recompute_attention_core = True`` (selective recomputation): the SDPA call runs under
  ``torch.utils.checkpoint``, so only the attention core is recomputed in backward.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from runtime.parallel import ulysses

ATTENTION = "dhplan_sdpa"
"""Name the runtime's attention function is registered under."""

RECOMPUTE_FLAG = "recompute_attention_core"
"""Attribute set on attention modules whose core is recomputed in backward (selective recomputation)."""


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ulysses_group: ulysses.UlyssesGroup | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with optional Ulysses head exchange and optional core recomputation; same contract as
    transformers' ``sdpa_attention_forward``: q/k/v [B, H, S, Dh] in, output [B, S, H, Dh]."""
    core = sdpa_attention_forward
    if getattr(module, RECOMPUTE_FLAG, False):
        core = functools.partial(checkpoint, sdpa_attention_forward, use_reentrant=False)
    if ulysses_group is None or ulysses_group.degree == 1:
        return core(module, query, key, value, attention_mask, **kwargs)
    return ulysses.attention(core, module, query, key, value, ulysses_group, **kwargs), None


def register() -> str:
    """Register the kernel (and SDPA's mask format for it) with transformers; returns its name."""
    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION

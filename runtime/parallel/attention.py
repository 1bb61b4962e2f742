"""The runtime's attention kernel, registered with transformers' attention interface.

transformers dispatches every attention module of a model to the function named by
``config._attn_implementation``; the runtime builds its model with ``ATTENTION`` (below), which is SDPA exactly
(flash-attn 2 instead on GPU when installed and no explicit mask is passed: ``attention_core``), plus two options
the parallel plans switch on per module:

- ``ulysses_group=UlyssesGroup`` passed as a call kwarg (vision full-attention blocks and every LLM decoder layer
  under sequence parallelism): heads are exchanged by all-to-all around the SDPA call
  (runtime.parallel.ulysses). The mask transformers built for the local slice is not used: the SDPA runs per
  segment of the whole sequence, causal exactly when the module is (the runtime passes no padding masks);
- ``module.recompute_attention_core = True`` (selective recomputation): the SDPA call runs under
  ``torch.utils.checkpoint``, so only the attention core is recomputed in backward.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

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

FLASH_ATTENTION_INSTALLED = importlib.util.find_spec("flash_attn") is not None
"""flash-attn 2 (the ``gpu`` extra) is importable."""


def flash_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """flash-attn 2 under SDPA's contract (q/k/v [B, H, S, Dh] in, [B, S, H, Dh] out); grouped-query KV heads
    are native to it, so they are not repeated."""
    from flash_attn import flash_attn_func

    causal = module.is_causal if is_causal is None else is_causal
    out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout,
                          softmax_scale=scaling, causal=causal)
    return out, None


def attention_core(query: torch.Tensor, attention_mask: torch.Tensor | None) -> Callable[..., tuple]:
    """flash-attn 2 where it applies (installed, CUDA, half precision, no explicit mask), else SDPA."""
    flash = FLASH_ATTENTION_INSTALLED and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    return flash_attention_forward if flash and attention_mask is None else sdpa_attention_forward


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
    sequence_parallel = ulysses_group is not None and ulysses_group.degree > 1
    core = attention_core(query, None if sequence_parallel else attention_mask)  # SP runs unmasked segments
    if getattr(module, RECOMPUTE_FLAG, False):
        core = functools.partial(checkpoint, core, use_reentrant=False)
    if not sequence_parallel:
        return core(module, query, key, value, attention_mask, **kwargs)
    return ulysses.attention(core, module, query, key, value, ulysses_group, **kwargs), None


def register() -> str:
    """Register the kernel (and SDPA's mask format for it) with transformers; returns its name."""
    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION

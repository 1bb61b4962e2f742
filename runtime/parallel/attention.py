"""The runtime's attention kernel, registered with transformers' attention interface.

transformers dispatches every attention module of a model to the function named by
``config._attn_implementation``; the runtime builds its model with ``ATTENTION`` (below), which is SDPA exactly
(flash-attn 2 instead on GPU when installed and no explicit mask is passed: ``attention_core``), plus two options
the parallel plans switch on per module:

- ``ulysses_group=UlyssesGroup`` passed as a call kwarg (vision full-attention blocks and every LLM decoder layer
  under sequence parallelism): heads are exchanged by all-to-all around the SDPA call
  (runtime.parallel.ulysses). The mask transformers built for the local slice is not used: the SDPA runs per
  segment of the whole sequence, causal exactly when the module is (the runtime passes no padding masks); with
  the group's ``ring`` (an LLM under context parallelism, runtime.parallel.ring) the SDPA is the causal ring over
  the CP group instead;
- ``module.recompute_attention_core = True`` (selective recomputation): the SDPA call runs under
  ``torch.utils.checkpoint``, so only the attention core is recomputed in backward.

A module planned with ``attention = "varlen"`` (a GPU plan) runs under ``VARLEN_ATTENTION`` instead: one call of
torch's variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``) per layer over all its segments
-- the vision tower's windows or images (transformers passes their ``cu_seqlens`` to an implementation whose
name says flash), an LLM row's packed samples (``packed_segments``: where the text positions restart, as
transformers' packed-sequence mask reads them), a Ulysses rank's whole sequence (``UlyssesGroup.segment_lens``)
-- with no mask built. The kernel is CUDA's; the dry-run traces it with its fake implementation.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable

import torch
from torch.nn.attention.varlen import varlen_attn
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask

from runtime.parallel import ulysses
from runtime.parallel.ring import ring_attention_forward

ATTENTION = "dhplan_sdpa"
"""Name the runtime's attention function is registered under."""
VARLEN_ATTENTION = "dhplan_flash_varlen"
"""Name of the variable-length kernel's registration (``flash`` in it: transformers then passes ``cu_seqlens``)."""

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


def segment_bounds(lengths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(int32 ``cu_seqlens`` [N + 1], longest length) of segments of ``lengths`` [N], back to back."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = lengths.cumsum(0)
    return cu, int(lengths.max())


def packed_segments(position_ids_BL: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Segments of a batch of rows flattened back to back: each row split where its positions do not go up by
    one (a packed row's samples, as transformers' ``find_packed_sequence_indices``), so an unpacked row is one."""
    starts = torch.ones_like(position_ids_BL, dtype=torch.bool)
    starts[:, 1:] = position_ids_BL[:, 1:] - position_ids_BL[:, :-1] != 1
    start_index = starts.flatten().nonzero().flatten()
    ends = torch.cat([start_index[1:], start_index.new_tensor([position_ids_BL.numel()])])
    return segment_bounds(ends - start_index)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """torch's ``varlen_attn`` under SDPA's contract (q/k/v [B, H, S, Dh] in, [B, S, H, Dh] out), the B rows
    back to back, over the segments ``cu_seq_lens_q`` gives, else ``position_ids``' packed samples, else each row;
    grouped-query KV heads are native to it."""
    if attention_mask is not None or dropout:
        raise ValueError("variable-length attention takes no mask and no dropout")
    batch, heads, length, head_dim = query.shape
    if cu_seq_lens_q is None:
        positions = position_ids if position_ids is not None and position_ids.dim() == 2 else (
            torch.arange(length, device=query.device).expand(batch, length))
        cu_seq_lens_q, max_length_q = packed_segments(positions)
    causal = module.is_causal if is_causal is None else is_causal
    window = (-1, 0) if causal else (-1, -1)
    if sliding_window is not None and causal:
        window = (sliding_window - 1, 0)
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (query, key, value))
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                      window_size=window, enable_gqa=key.shape[1] != heads)
    return out.view(batch, length, heads, head_dim), None


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
    sequence_parallel = ulysses_group is not None and (ulysses_group.degree > 1 or ulysses_group.ring is not None)
    core = attention_core(query, None if sequence_parallel else attention_mask)  # SP runs unmasked segments
    if sequence_parallel and ulysses_group.ring is not None:
        core = functools.partial(ring_attention_forward, ring=ulysses_group.ring,
                                 segment_mask=ulysses_group.segment_mask, gathered=ulysses_group.gathered)
    return _run(core, module, query, key, value, attention_mask, ulysses_group if sequence_parallel else None,
                **kwargs)


def varlen_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    ulysses_group: ulysses.UlyssesGroup | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``attention_forward`` with ``varlen_attention_forward`` as the core: one call over every segment."""
    sequence_parallel = ulysses_group is not None and ulysses_group.degree > 1
    if sequence_parallel:  # the exchanged whole sequence's segments, not the rank-local bounds transformers passes
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq_lens", "max_length"))}
        lengths = torch.tensor(ulysses_group.segment_lens, device=query.device)
        kwargs["cu_seq_lens_q"], kwargs["max_length_q"] = segment_bounds(lengths)
    return _run(varlen_attention_forward, module, query, key, value, attention_mask,
                ulysses_group if sequence_parallel else None, segmented=False, **kwargs)


def _run(core: Callable[..., tuple], module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
         value: torch.Tensor, attention_mask: torch.Tensor | None, ulysses_group: ulysses.UlyssesGroup | None,
         segmented: bool = True, **kwargs) -> tuple[torch.Tensor, None]:
    """``core`` on this rank's heads, under the Ulysses exchange when ``ulysses_group`` is given (per segment when
    ``segmented``, else once), checkpointed where the module's core is recomputed (selective recomputation)."""
    if getattr(module, RECOMPUTE_FLAG, False):
        core = functools.partial(checkpoint, core, use_reentrant=False)
    if ulysses_group is None:
        return core(module, query, key, value, attention_mask, **kwargs)
    return ulysses.attention(core, module, query, key, value, ulysses_group, segmented=segmented, **kwargs), None


SUB_CONFIGS = {"vision": "vision_config", "audio": "audio_config", "llm": "text_config"}
"""Each module's part of the model config (what its attention modules read ``_attn_implementation`` from)."""


def use_planned_calls(model: torch.nn.Module, calls: dict[str, str]) -> None:
    """Point each module's attention (module name -> ``planner.contract.schema.AttentionCalls``) at the kernel its plan
    calls. Set on the built model: transformers refuses to build an implementation named flash that it does
    not ship, and reads the name at every forward."""
    for name, module_calls in calls.items():
        getattr(model.config, SUB_CONFIGS[name])._attn_implementation = register(module_calls)


def register(calls: str = "sdpa") -> str:
    """Register the runtime's kernels (each with its mask format) with transformers; returns the name of the one
    a module planned with ``attention = calls`` runs (``planner.contract.schema.AttentionCalls``)."""
    AttentionInterface.register(ATTENTION, attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    AttentionInterface.register(VARLEN_ATTENTION, varlen_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, flash_attention_mask)
    return VARLEN_ATTENTION if calls == "varlen" else ATTENTION

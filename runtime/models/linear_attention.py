"""Gated DeltaNet linear attention (Yang et al. 2025, "Gated Delta Networks"; Qwen3.5's ``Qwen3_5GatedDeltaNet``)
as the runtime runs it: transformers' own submodules and kernels, with two things its forward does not do.

- **Packed rows restart at every sample**: a linear-attention layer carries state along the sequence (the short
  causal conv over q/k/v, the delta rule's recurrent state). transformers passes ``cu_seq_lens_q`` to its torch
  fallbacks (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``), which ignore it, so one sample's state would
  flow into the next. The plan's kernel (``ModulePlan.linear_attention``) runs them: ``torch``, transformers' torch
  fallbacks once per segment of the row, each from a zero state (``torch_kernels``); ``fla``, flash-linear-attention's
  causal conv and chunked rule, one call each over the row's ``cu_seqlens`` (``fla_kernels``: fla-core, CUDA).
  Selective recomputation re-runs the rule under a checkpoint.
- **Ulysses SP**: the projections run on the rank's tokens; their outputs are exchanged (all-to-all) so that each
  SP rank runs ``1 / sp`` of the heads over whole sequences, and the gated norm's output goes back the same way.
- **Tensor parallelism of both head kinds** (``GatedDeltaNetParallel``): each TP rank keeps whole key heads with the
  value heads that read them. The fused ``in_proj_qkv`` rows (and the depthwise conv's channels, the same ones) are
  put in TP layout, [tp, (q_r, k_r, v_r)], so that a column-parallel split gives each rank its own q, k and v heads
  (``linear_qkv_row_order``, which checkpoints undo); ``in_proj_z``/``in_proj_b``/``in_proj_a`` are column-parallel,
  ``out_proj`` row-parallel, the per-head ``A_log``/``dt_bias`` and the conv weight ``Shard(0)`` DTensors read
  through their local shard, the gated norm (over one head's width) replicated with its gradient summed.

Shape legend: B rows, L sequence, H value heads (local), Dk/Dv head widths, C conv channels.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from runtime.parallel.attention import RECOMPUTE_FLAG
from runtime.parallel.tensor_parallel import ReplicatedWeightSummedGradients
from runtime.parallel.ulysses import HeadsToSeq, SeqToHeads, UlyssesGroup

PROJECTIONS_TP_PLAN = {"in_proj_qkv": ColwiseParallel(), "in_proj_z": ColwiseParallel(),
                       "in_proj_b": ColwiseParallel(), "in_proj_a": ColwiseParallel(), "out_proj": RowwiseParallel(),
                       "norm": ReplicatedWeightSummedGradients()}
"""A Gated DeltaNet layer's projections: every head-indexed output split, the output projection row-parallel."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


FLA_MISSING = ("the plan runs its linear-attention layers on flash-linear-attention's kernel (linear_attention fla), "
               "which is not installed here: pip install 'dhplan[gpu]' (fla-core), or re-plan with "
               "--linear-attention torch")
"""Why a plan priced with fla's kernel cannot run where fla-core is not importable."""


def torch_fallback(dispatcher: nn.Module) -> Callable:
    """transformers' torch code behind its kernel dispatch: ``hf.causal_conv1d_fn`` and
    ``hf.torch_chunk_gated_delta_rule`` are modules (``use_kernelized_func``) whose forward calls a wrapper that runs
    causal-conv1d's or fla's kernel instead when it is installed and the inputs are on CUDA
    (``use_kernel_func_from_hub_with_fallback``); the wrapper's ``__wrapped__`` is the torch code a ``torch`` plan
    priced."""
    return inspect.unwrap(inspect.getclosurevars(type(dispatcher).forward).nonlocals["func"])


TORCH_CONV = torch_fallback(hf.causal_conv1d_fn)
"""transformers' torch causal conv (``F.conv1d`` then the activation)."""
TORCH_RULE = torch_fallback(hf.torch_chunk_gated_delta_rule)
"""transformers' torch chunked gated delta rule."""


def _torch_conv(x_BLC: torch.Tensor, weight: torch.Tensor, activation: str, segments: list[int]) -> torch.Tensor:
    """The causal conv once per segment, each from a zero state."""
    parts = x_BLC.transpose(1, 2).split(segments, dim=2)
    return torch.cat([TORCH_CONV(part, weight, None, activation=activation) for part in parts], dim=2).transpose(1, 2)


def _torch_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                segments: list[int]) -> torch.Tensor:
    """The chunked rule once per segment, each from a zero state."""
    parts = zip(*(t.split(segments, dim=1) for t in (query, key, value, g, beta)))
    return torch.cat([TORCH_RULE(q, k, v, g=gs, beta=bs, initial_state=None, output_final_state=False,
                                 use_qk_l2norm_in_kernel=True)[0] for q, k, v, gs, bs in parts], dim=1)


def torch_kernels() -> tuple[Callable, Callable]:
    """(conv, rule) of a ``torch`` plan: transformers' torch fallbacks per segment of the row."""
    return _torch_conv, _torch_rule


def fla_functions() -> tuple[Callable, Callable]:
    """fla-core's causal conv and chunked gated delta rule (0.6: ``fla.modules.causal_conv1d.causal_conv1d``,
    ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``; the dry-run puts its emulations here).

    Raises:
        ValueError: fla-core is not installed (``FLA_MISSING``).
    """
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        raise ValueError(FLA_MISSING) from None
    return causal_conv1d, chunk_gated_delta_rule


def _cu_seqlens(segments: list[int], device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A packed row's cumulative segment lengths (on ``device`` and on the host), None for one segment."""
    if len(segments) == 1:
        return None, None
    cu_cpu = torch.tensor([0, *itertools.accumulate(segments)], dtype=torch.long)
    return cu_cpu.to(device), cu_cpu


def fla_kernels() -> tuple[Callable, Callable]:
    """(conv, rule) of an ``fla`` plan: fla's, one call each over the row's segments (``cu_seqlens``), q and k at
    their own heads (fla repeats them to the value heads inside). Untested on a GPU here (this project's CI has
    none).

    Raises:
        ValueError: fla-core is not installed (``FLA_MISSING``), before any training.
    """
    causal_conv1d, chunk_gated_delta_rule = fla_functions()

    def conv(x_BLC: torch.Tensor, weight: torch.Tensor, activation: str, segments: list[int]) -> torch.Tensor:
        cu, cu_cpu = _cu_seqlens(segments, x_BLC.device)
        return causal_conv1d(x_BLC, weight, activation=activation, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)[0]

    def rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             segments: list[int]) -> torch.Tensor:
        cu, cu_cpu = _cu_seqlens(segments, query.device)
        return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)[0]

    return conv, rule


KERNELS = {"torch": torch_kernels, "fla": fla_kernels}
"""Each plan kernel's (conv, rule), by ``planner.contract.schema.LinearAttentionKernel``."""


def _segments(length: int, cu_seq_lens_q: torch.Tensor | None) -> list[int]:
    """Lengths of a row's samples (``cu_seq_lens_q``'s, a packed row) or the whole row."""
    if cu_seq_lens_q is None:
        return [length]
    return (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()


def _to_heads(x_BsW: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
    """[B, s, W] sequence-sharded, W = sp groups of heads -> [B, S, W / sp]: this rank's group over the whole
    sequence (Ulysses' exchange, runtime.parallel.ulysses)."""
    batch, length, width = x_BsW.shape
    x = x_BsW.reshape(batch, length, ug.degree, width // ug.degree).transpose(1, 2)
    return SeqToHeads.apply(x.contiguous(), ug).squeeze(1)


def _to_sequence(y_BSw: torch.Tensor, ug: UlyssesGroup) -> torch.Tensor:
    """Inverse of ``_to_heads``: [B, S, w] of this rank's heads -> [B, s, sp * w]."""
    y = HeadsToSeq.apply(y_BSw.unsqueeze(1).contiguous(), ug)
    return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)


def gated_delta_net_forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                            attention_mask: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                            ulysses_group: UlyssesGroup | None = None, **kwargs) -> torch.Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` in training (no cache), its conv and delta rule on the plan's kernel
    (``linear_kernels``), each sample of the row (``cu_seq_lens_q``: a packed row of one row's samples) from a zero
    state, on this rank's heads. Under Ulysses SP
    (``ulysses_group``) the projections' outputs are exchanged so that each rank runs ``1 / sp`` of the heads over
    the whole sequence (its segments: the group's), and the gated norm's output is exchanged back."""
    if cache is not None:
        raise NotImplementedError("the runtime's Gated DeltaNet runs in training, without a cache")
    hidden_states = hf.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch = hidden_states.shape[0]
    mixed_qkv = self.in_proj_qkv(hidden_states)
    z, b, a = self.in_proj_z(hidden_states), self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    A_log, dt_bias = _local(self.A_log), _local(self.dt_bias)
    conv_weight = _local(self.conv1d.weight).squeeze(1)
    value_dim, length = self.value_dim_local, mixed_qkv.shape[1]
    segments = _segments(length, cu_seq_lens_q)
    sp = ulysses_group.degree if ulysses_group is not None else 1
    if sp > 1:  # each SP rank its own (q, k, v) head group: the TP layout's order, over sp groups
        order = linear_qkv_row_order((mixed_qkv.shape[-1] - value_dim) // 2, value_dim, sp).to(mixed_qkv.device)
        mixed_qkv, z, b, a = (_to_heads(t, ulysses_group) for t in (mixed_qkv[..., order], z, b, a))
        conv_weight = conv_weight[order].chunk(sp)[ulysses_group.rank]
        A_log, dt_bias = (t.chunk(sp)[ulysses_group.rank] for t in (A_log, dt_bias))
        value_dim, length, segments = value_dim // sp, mixed_qkv.shape[1], list(ulysses_group.segment_lens)
    if len(segments) > 1 and batch != 1:
        raise ValueError(f"a packed row is one row of samples, got {batch} rows")
    conv, rule = self.linear_kernels
    mixed_qkv = conv(mixed_qkv, conv_weight, self.activation, segments)
    key_dim = (mixed_qkv.shape[-1] - value_dim) // 2
    query, key, value = torch.split(mixed_qkv, [key_dim, key_dim, value_dim], dim=-1)
    query, key = (t.reshape(batch, length, -1, self.head_k_dim) for t in (query, key))
    value = value.reshape(batch, length, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    if getattr(self, RECOMPUTE_FLAG, False):  # selective recomputation: the rule's inputs kept, the rule re-run
        rule = functools.partial(checkpoint, rule, use_reentrant=False)
    core_BLHD = rule(query, key, value, g, beta, segments)
    core = self.norm(core_BLHD.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)).reshape(batch, length, -1)
    if sp > 1:
        core = _to_sequence(core, ulysses_group)
    return self.out_proj(core)


def run_by_segments(layer: nn.Module, kernel: str) -> None:
    """Point a ``Qwen3_5GatedDeltaNet`` at ``gated_delta_net_forward`` on ``kernel``'s conv and rule (``KERNELS``).

    Raises:
        ValueError: an ``fla`` plan where fla-core is not installed (``FLA_MISSING``).
    """
    layer.value_dim_local = layer.value_dim
    layer.linear_kernels = KERNELS[kernel]()
    layer.forward = types.MethodType(gated_delta_net_forward, layer)


def linear_qkv_row_order(key_dim: int, value_dim: int, tp: int) -> torch.Tensor:
    """HF row of each row of a fused ``in_proj_qkv`` (or conv channel) stored in TP layout: rank r's block holds its
    query rows, then its key rows, then its value rows."""
    q, k, v = torch.arange(key_dim), torch.arange(key_dim, 2 * key_dim), torch.arange(2 * key_dim,
                                                                                       2 * key_dim + value_dim)
    return torch.cat([torch.cat([part.chunk(tp)[r] for part in (q, k, v)]) for r in range(tp)])


class GatedDeltaNetParallel(ParallelStyle):
    """Tensor parallelism of a ``Qwen3_5GatedDeltaNet`` over both its head kinds (see the module docstring), on the
    meta model: its shards are filled in TP row order (``linear_attention_row_order``) when materialised. Its forward
    must already be ``gated_delta_net_forward`` (``run_by_segments``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        parallelize_module(module, device_mesh, PROJECTIONS_TP_PLAN)
        for owner, name in ((module.conv1d, "weight"), (module, "A_log"), (module, "dt_bias")):
            param = getattr(owner, name)
            sharded = distribute_tensor(param.data, device_mesh, [Shard(0)])
            owner.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.value_dim_local = module.value_dim // tp
        return module


def linear_attention_row_order(local_name: str, config: Any, tp: int) -> torch.Tensor | None:
    """HF row of each stored row of an LLM parameter TP stores in another order (a linear-attention layer's fused
    ``in_proj_qkv`` and its conv), else None."""
    if tp == 1 or not local_name.endswith((".linear_attn.in_proj_qkv.weight", ".linear_attn.conv1d.weight")):
        return None
    text = config.get_text_config()
    return linear_qkv_row_order(text.linear_num_key_heads * text.linear_key_head_dim,
                                text.linear_num_value_heads * text.linear_value_head_dim, tp)

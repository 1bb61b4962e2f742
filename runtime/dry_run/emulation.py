"""The fake-tensor world a dry-run step runs in (``runtime.dry_run``'s docstring says what runs and why)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any
from unittest import mock

import torch
from torch._subclasses.fake_impls import _is_tensor_constructor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import _sharding_prop as sharding_prop
from torch.utils._pytree import tree_flatten
from transformers.distributed.expert_parallel import AllToAllEP, EPImplementationInterface, _AllToAllState
from transformers.integrations import moe as moe_integration

from planner.contract.schema import Plan
from runtime.data.samples import Sample, SampleLayout, token_sequence
from runtime.models import linear_attention as linear_attention_module
from runtime.models import vision as vision_module
from runtime.parallel import experts as experts_module
from runtime.training import trainer as trainer_module
from runtime.training.step_inputs import StepInputs
from runtime.training.trainer import RunOptions, Trainer

REAL_TENSOR_LIMIT_BYTES = 16 * 1024**2
"""Integer and boolean factories at most this large make real tensors (indices, masks); larger ones are fake."""
MICRO_BATCHES_RUN = 3
"""Micro-batches of the step actually run: the first (no gradients yet), the second (gradients accumulated; any
later one but the last repeats its memory) and the last (gradient reduction). Disjoint plans reach their
steady state (MAX_ENCODER_IN_FLIGHT forwards ahead) within these too."""


# ---- the fake mode ----------------------------------------------------------------------------------------------
def _is_fake(x: Any) -> bool:
    return isinstance(x, FakeTensor)


def _on_meta(kwargs: dict) -> bool:
    """A factory's tensor goes to the ``meta`` device (shapes only: it stays a real meta tensor)."""
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _materializes_meta(flat: list, kwargs: dict) -> bool:
    """An op makes a tensor off ``meta`` from a ``meta`` tensor."""
    device = kwargs.get("device")
    return (device is not None and torch.device(device).type != "meta"
            and any(isinstance(x, torch.Tensor) and x.is_meta for x in flat))


def _integer_indices(indices: list) -> list:
    """Boolean-mask indices (real) as the integer indices they select, so the result's shape needs no data."""
    out = []
    for index in indices:
        if isinstance(index, torch.Tensor) and not _is_fake(index) and index.dtype in (torch.bool, torch.uint8):
            out += list(index.nonzero(as_tuple=True))
        else:
            out.append(index)
    return out


class DataDependentFakeMode(FakeTensorMode):
    """FakeTensorMode in which real tensors stay real: an op runs for real when none of its inputs is fake (a
    factory only when it makes integers or booleans of at most ``REAL_TENSOR_LIMIT_BYTES``, a factory on ``meta``
    always); ops on fake tensors, and an op giving a ``meta`` tensor storage (the model's shards), are faked.

    Floating-point factories are fake whatever their size: the receive buffers of collectives are such factories
    (e.g. Ulysses' all-to-all outputs under SP8, a few MiB each), and the fake process group leaves them as they
    are, so a real buffer would carry the rest of the forward and backward onto real tensors."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True, allow_fallback_kernels=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if any(_is_fake(x) for x in flat):
            return self._fake(func, types, args, kwargs)
        if _materializes_meta(flat, kwargs):  # ``to_empty``: the model's shards, however small, are fake
            return self._fake(func, types, args, kwargs)
        if _is_tensor_constructor(func) and not _on_meta(kwargs):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out.dtype.is_floating_point or out.numel() * out.element_size() > REAL_TENSOR_LIMIT_BYTES:
                return out
        return func(*args, **kwargs)

    def _fake(self, func, types, args, kwargs):
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            if args[0].dtype.is_floating_point:
                return 0.0
            raise NotImplementedError("dry-run: an integer is read from a fake tensor (data-dependent control flow)")
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default):
            args = (args[0], _integer_indices(list(args[1])), *args[2:])
        elif func is aten.masked_select.default and not _is_fake(args[1]):
            mask = args[1].expand(torch.broadcast_shapes(args[0].shape, args[1].shape))
            func, args = aten.index.Tensor, (args[0].expand(mask.shape), list(mask.nonzero(as_tuple=True)))
        return super().__torch_dispatch__(func, types, args, kwargs)


# ---- the trainer, as on the GPU -------------------------------------------------------------------------------
class PlannedShapes:
    """Samples of the planned shape: real token sequences (the trainer computes positions from them) and fake
    zero pixel values (no image is synthesised)."""

    def __init__(self, layout: SampleLayout):
        self.layout = layout
        self.tokens = token_sequence([], layout)
        patch = 3 * layout.temporal_patch_size * layout.patch_size**2
        grids = torch.tensor(layout.grids()).view(-1, 3)
        images = len(layout.image_sizes)
        self.visual = {}
        for pixels, grid_key, grid in (("pixel_values", "image_grid_thw", grids[:images]),
                                       ("pixel_values_videos", "video_grid_thw", grids[images:])):
            if len(grid):
                self.visual[pixels] = (int(grid.prod(-1).sum()), patch)
                self.visual[grid_key] = grid

    def sample(self, index: int) -> Sample:
        return {**{k: torch.zeros(v) if isinstance(v, tuple) else v.clone() for k, v in self.visual.items()},
                **{k: v.clone() for k, v in self.tokens.items()}}


class ZeroWeights:
    """A weight source (runtime.checkpoints.hf_folder.TensorSource) of zeros: under the fake mode, fake storage of the slice's
    shape; nothing is drawn or read."""

    def read(self, hf_name: str, index: tuple[slice, ...], shape: torch.Size) -> torch.Tensor:
        return torch.zeros(torch.empty(shape, device="meta")[index].shape)


class PlannedInputs(StepInputs):
    """A step's inputs of the planned shape (``PlannedShapes``), every micro-batch of the step prepared and counted,
    ``MICRO_BATCHES_RUN`` of them (the last one last) run: all of them under a pipeline schedule."""

    def __init__(self, plan: Plan, **kwargs: Any):
        self.whole_step = True
        micro_batches = range(plan.module("llm").grad_accum)
        self._run_micro_batches = list(micro_batches) if plan.module("llm").pp > 1 else sorted(
            {*micro_batches[:MICRO_BATCHES_RUN - 1], micro_batches[-1]})
        """Micro-batch of the step that each micro-batch run stands for."""
        super().__init__(plan, **kwargs)
        self.source = PlannedShapes(self.layout)

    @property
    def num_micro_batches(self) -> int:
        """The plan's micro-batches while the step's inputs are prepared and counted, ``MICRO_BATCHES_RUN`` of
        them (the last one last) while it runs."""
        return self.dims["llm"].grad_accum if self.whole_step else len(self._run_micro_batches)

    def prepare(self, position: int) -> float:
        self.whole_step = True
        seconds = super().prepare(position)
        self.whole_step = False
        return seconds

    def count_target_tokens(self) -> torch.Tensor:
        self.whole_step = True
        try:
            return super().count_target_tokens()
        finally:
            self.whole_step = False

    def samples(self, micro: int, name: str) -> Sample:
        return super().samples(micro if self.whole_step else self._run_micro_batches[micro], name)

    def llm_shard(self, micro: int):
        return super().llm_shard(micro if self.whole_step else self._run_micro_batches[micro])


class DryRunTrainer(Trainer):
    """The runtime's Trainer with zero weights and planned-shape inputs (``PlannedInputs``)."""

    inputs_type = PlannedInputs

    def __init__(self, plan: Plan, *, rank: int, options: RunOptions):
        super().__init__(plan, rank=rank, options=options, weights=ZeroWeights())


def _windows_as_one_segment(shard_vision_batch):
    """runtime.models.vision.shard_vision_batch with the window-attention blocks' windows run as one segment.

    transformers runs non-flash attention window by window (hundreds of SDPA calls per block, minutes of fake
    dispatch for a 32B plan). A flash-style kernel keeps the output and one logsumexp per head and token whatever
    the segmenting (the CPU kernel, ``_scaled_dot_product_flash_attention_for_cpu``, as the GPU ones), so one
    segment has the same memory; only FLOPs, which are not simulated, differ.
    """

    def shard(*args, **kwargs):
        out = shard_vision_batch(*args, **kwargs)
        whole = torch.tensor([0, len(out.pixel_values_nP)], dtype=out.cu_windows.dtype)
        return dataclasses.replace(out, cu_windows=whole)

    return shard


def _vote_alone(schedule, stages, has_backward: bool, p2p_done: bool) -> None:
    """A pipeline schedule's start-up vote on static metadata, by this rank's stages alone.

    The stages vote (through point-to-point sends) whether every one has its metadata; the fake process group
    delivers nothing, so a received vote would read "no". The runtime builds every stage with its metadata
    (runtime.models.pipeline ``stage_metadata``), so each stage's own vote is the pipeline's."""
    for stage in stages:
        dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
        stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC


BALANCED_EP = "dry_run_balanced"
"""The dry-run's entry in transformers' ``EPImplementationInterface``."""


class BalancedAllToAllEP(AllToAllEP):
    """transformers' ``AllToAllEP`` with balanced routing: where tokens go is data (fake here, so the real split
    sizes would read 0), so each rank of the EP group sends every peer an equal share of its (token, expert) pairs
    and receives as many. Memory is the exchange's at the mean load (the planner's ``moe_load_imbalance`` adds the
    busiest rank's excess)."""

    def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
        num_tokens = hidden_states.size(0)
        if self.tp_mesh.size() > 1:  # the TP rank's slice of the tokens (a local chunk, as the parent's)
            hidden_states, top_k_index, top_k_weights = (
                DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                .redistribute(self.tp_mesh, [Shard(0)]).to_local() for t in (hidden_states, top_k_index, top_k_weights))
        ep_size, top_k = self.ep_mesh.size(), top_k_index.size(-1)
        order = torch.argsort(top_k_index.reshape(-1))
        pairs = top_k_index.numel()
        sizes = [pairs // ep_size + (peer < pairs % ep_size) for peer in range(ep_size)]
        received = all_to_all_single_autograd(hidden_states[order // top_k], sizes, sizes, self.ep_mesh.get_group())
        expert_ids = (torch.arange(pairs) % self.num_local_experts).unsqueeze(-1)
        weights = torch.ones(pairs, 1, dtype=received.dtype)
        return received, expert_ids, weights, _AllToAllState(top_k_weights, order, sizes, sizes, num_tokens)


EPImplementationInterface.register(BALANCED_EP, BalancedAllToAllEP)


def _fp32_grouped_mm_by_fallback(can_use_grouped_mm):
    """transformers' choice of ``torch._grouped_mm`` for the experts, but fp32 ones (a CPU plan's recipe) through its
    own ``grouped_mm_fallback`` op: the grouped kernel's fake (meta) implementation takes bf16 only, the fallback's
    gives the same output and keeps the same inputs for its backward."""

    def can_use(input, weight, offs) -> bool:
        return weight.dtype != torch.float32 and can_use_grouped_mm(input, weight, offs)

    return can_use


FLA_CHUNK = 64
"""Tokens per chunk of fla's gated delta rule and of its conv's backward (their default ``chunk_size``)."""


def _chunks(tokens: int, rows: int, cu_seqlens_cpu: torch.Tensor | None) -> int:
    """Chunks fla's kernels run: each row's, or each packed sample's (``cu_seqlens``), rounded up."""
    if cu_seqlens_cpu is None:
        return rows * math.ceil(tokens / FLA_CHUNK)
    return sum(math.ceil(int(n) / FLA_CHUNK) for n in cu_seqlens_cpu.diff())


class EmulatedCausalConv1d(torch.autograd.Function):
    """fla's ``CausalConv1dFunction`` with SiLU (fla-core 0.6.0, ``fla/modules/causal_conv1d/ops.py``) as the
    dry-run sees it: its Triton kernels cannot run on fake tensors, so this allocates what they allocate and saves
    what they save, and computes nothing. Forward: the output ``y``, saving the input ``x`` and the weight.
    Backward (``causal_conv1d_bwd``): the conv's output recomputed before SiLU, ``dx`` and the weight's fp32
    gradient per chunk ``[B * NT, D, W]``, summed."""

    @staticmethod
    def forward(ctx, x_BTD: torch.Tensor, weight_DW: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None):
        ctx.save_for_backward(x_BTD, weight_DW)
        ctx.chunks = _chunks(x_BTD.shape[1], x_BTD.shape[0], cu_seqlens_cpu)
        return torch.empty_like(x_BTD, memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, dy_BTD: torch.Tensor):
        x_BTD, weight_DW = ctx.saved_tensors
        recomputed = torch.empty_like(x_BTD)
        dx = torch.empty_like(x_BTD)
        dw = weight_DW.new_empty(ctx.chunks, *weight_DW.shape, dtype=torch.float32)
        del recomputed
        return dx, dw.sum(0).to(weight_DW.dtype), None


def emulated_causal_conv1d(x, weight, *, activation, cu_seqlens=None, cu_seqlens_cpu=None):
    """``fla.modules.causal_conv1d.causal_conv1d``'s call as the runtime makes it, on ``EmulatedCausalConv1d``."""
    assert activation in ("silu", "swish"), activation
    return EmulatedCausalConv1d.apply(x, weight, cu_seqlens_cpu), None


class EmulatedChunkGatedDeltaRule(torch.autograd.Function):
    """fla's ``ChunkGatedDeltaRuleFunction`` with ``use_qk_l2norm_in_kernel`` (fla-core 0.6.0,
    ``fla/ops/gated_delta_rule/chunk.py``) as the dry-run sees it: allocates what its Triton kernels allocate,
    saves what it saves, computes nothing. Shapes: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g and beta
    ``[B, T, HV]``; every new tensor in k's dtype but the fp32 inverse norms and decays.

    Forward: ``input_guard``'s contiguous copies of q, k, v (held for the call), ``l2norm_fwd``'s normed q and k
    and fp32 ``rstd`` ``[B, T, H]``, the fp32 cumulative decay, ``chunk_gated_delta_rule_fwd_intra``'s ``A``
    ``[B, T, HV, C]`` and WY factors ``w`` ``[B, T, HV, K]`` and ``u``, ``chunk_gated_delta_rule_fwd_h``'s chunk
    states ``h`` ``[B, NT, HV, K, V]`` and ``v_new``, the output ``o``; it saves q, q_rstd, k, k_rstd, v, g, beta
    and A (``ctx.save_for_backward``). Backward (``chunk_gated_delta_rule_bwd``, at ``prepare_wy_repr_bwd``, where
    most is alive): ``w``, ``u``, ``h``, ``v_new`` recomputed, ``dh`` (as ``h``), ``du``, ``dw``, ``dq`` and ``dk``
    summed to the key heads, ``prepare_wy_repr_bwd``'s ``dk`` ``[B, T, HV, K]``, ``dv``, ``db`` and fp32 ``dg``
    beside the first fp32 ``dg``; then the inputs' gradients (``l2norm_bwd``'s dq and dk, the reverse cumsum's
    dg)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens_cpu):
        q, k, v = (t.contiguous() for t in (q, k, v))
        batch, tokens, heads, k_dim = k.shape
        value_heads, v_dim = v.shape[2:]
        chunks = _chunks(tokens, batch, cu_seqlens_cpu)
        states = (batch, chunks // batch, value_heads, k_dim, v_dim)
        q_normed, k_normed = torch.empty_like(q), torch.empty_like(k)
        q_rstd, k_rstd = (q.new_empty(q.shape[:-1], dtype=torch.float32) for _ in range(2))
        g_cumsum = torch.empty_like(g, dtype=torch.float32)
        a = k.new_empty(batch, tokens, value_heads, FLA_CHUNK)
        w, u, h, v_new = k.new_empty(batch, tokens, value_heads, k_dim), torch.empty_like(v), k.new_empty(states), \
            torch.empty_like(v)
        o = torch.empty_like(v)
        del w, u, h, v_new
        ctx.save_for_backward(q_normed, q_rstd, k_normed, k_rstd, v, g_cumsum, beta, a)
        ctx.states = states
        return o

    @staticmethod
    def backward(ctx, do):
        q, _, k, _, v, g, beta, _ = ctx.saved_tensors
        batch, tokens, heads, k_dim = k.shape
        value_heads = v.shape[2]
        w, u, h, v_new = k.new_empty(batch, tokens, value_heads, k_dim), torch.empty_like(v), k.new_empty(ctx.states), \
            torch.empty_like(v)
        dh, du, dw = torch.empty_like(h), torch.empty_like(v), torch.empty_like(w)
        dq_keys, dk_keys = torch.empty_like(q), torch.empty_like(k)
        dk_values, dv, db = torch.empty_like(w), torch.empty_like(v), torch.empty_like(beta)
        dg, dg_wy = torch.empty_like(g), torch.empty_like(g)
        del w, u, h, v_new, dh, du, dw, dk_values, dg_wy
        dq, dk, dg_out = torch.empty_like(dq_keys), torch.empty_like(dk_keys), torch.empty_like(dg)
        return dq, dk, dv, dg_out, db, None


def emulated_chunk_gated_delta_rule(q, k, v, *, g, beta, use_qk_l2norm_in_kernel, cu_seqlens=None,
                                    cu_seqlens_cpu=None):
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule``'s call as the runtime makes it, on
    ``EmulatedChunkGatedDeltaRule``."""
    assert use_qk_l2norm_in_kernel
    return EmulatedChunkGatedDeltaRule.apply(q, k, v, g, beta, cu_seqlens_cpu), None


@contextlib.contextmanager
def emulation():
    """The trainer's tensors on CPU, vision windows as one segment, a pipeline's stages voting alone, experts'
    tokens exchanged as if routed evenly (``BalancedAllToAllEP``), fp32 experts' grouped GEMMs through transformers'
    fallback op (``_fp32_grouped_mm_by_fallback``), fla's linear-attention kernels (an ``fla`` plan's) by their
    allocations (``EmulatedCausalConv1d``, ``EmulatedChunkGatedDeltaRule``); DTensor's
    sharding propagation in its own fake mode (it allocates tensors of global shapes, which must neither be real
    nor counted)."""
    propagation = FakeTensorMode()
    with mock.patch.object(trainer_module, "device_for", lambda _: torch.device("cpu")), \
            mock.patch.object(vision_module, "shard_vision_batch",
                              _windows_as_one_segment(vision_module.shard_vision_batch)), \
            mock.patch.object(sharding_prop, "detect_fake_mode", lambda *_: propagation), \
            mock.patch.object(_PipelineSchedule, "_warmup_p2p", _vote_alone), \
            mock.patch.object(experts_module, "EP_IMPLEMENTATION", BALANCED_EP), \
            mock.patch.object(moe_integration, "_can_use_grouped_mm",
                              _fp32_grouped_mm_by_fallback(moe_integration._can_use_grouped_mm)), \
            mock.patch.object(linear_attention_module, "fla_functions",
                              lambda: (emulated_causal_conv1d, emulated_chunk_gated_delta_rule)):
        yield

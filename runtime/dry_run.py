"""Dry-run: the runtime's own memory at full size, on CPU, without real memory or compute.

``dry_run(plan, options)`` runs the runtime's real ``Trainer`` (construction, then one ``train_step``) for one
rank of every distinct role of the plan, under a fake tensor mode and torch's fake process group of the plan's
world size (no memory, no communication), measures peak tensor memory by category with torch's ``MemTracker``,
and puts it beside the planner's prediction: FITS / DOES NOT FIT for the plan's device. ``format_report`` prints
it; ``report.fits`` is the verdict (``python -m runtime plan.json --dry-run`` exits 0 / 1 on it).

What runs, documented because it is what the numbers mean:

- The trainer's own code on fake CPU tensors (this torch is a CPU build: FakeTensorMode cannot fake ``cuda``
  tensors here). The trainer picks its numeric recipe from the plan's device (``numerics_device_type``), so a GPU
  plan runs the GPU recipe of runtime.parallel.precision: for bf16_mixed fp32 weights, gradients and Adam states
  with FSDP2's ``MixedPrecisionPolicy`` (bf16 all-gathers, fp32 reduction) where FSDP wraps a module and bf16
  autocast elsewhere; bf16 parameters for bf16_pure; a bf16 hand-off.
- Start-up is the trainer's: the model on ``meta``, sharded there, then ``materialize`` gives the local shards
  (fake) storage; their values come from ``ZeroWeights`` instead of the random init (nothing is drawn).
- ``DataDependentFakeMode``: data and index tensors stay real (they are small and the trainer computes indices
  from them: window order, M-RoPE positions, ``cu_seqlens.tolist()``); a floating-point factory, an integer one
  allocating more than ``REAL_TENSOR_LIMIT_BYTES``, the model's shards and every op touching a fake tensor are
  fake. Boolean-mask indexing of a fake
  tensor by a real mask is rewritten to integer indexing (same shape), and a Python scalar read from a fake
  tensor (the loss and the gradient norm, which only feed logging and clipping) reads 0.0.
- Pixel values are fake zeros of the planned shape (``PlannedShapes``), so no image is synthesised.
- A pipeline schedule's stages take their static metadata without the start-up vote (``_vote_alone``: the fake
  process group delivers no message).
- Mixture-of-experts layers: where tokens are routed is data, so each rank of an EP group sends every peer an equal
  share of its (token, expert) pairs (``BalancedAllToAllEP``: the mean load; the planner adds its
  ``moe_load_imbalance``); fp32 experts (a CPU plan) run transformers' grouped-GEMM fallback op, whose fake
  implementation takes fp32.
- Window-attention blocks run their windows as one segment (``_windows_as_one_segment``): same memory with a
  flash-style kernel, hundreds of times fewer fake ops.
- Of a step's micro-batches, ``MICRO_BATCHES_RUN`` run (the first two and the last); every micro-batch's inputs
  are still prepared, as the trainer holds the whole step's inputs on the device. A pipelined plan runs them all:
  its schedule is one call over the step, and what a stage holds in flight depends on how many there are.

Roles: ranks that run the same code on tensors of the same shapes need the same memory. A rank's role is the
set of modules it holds and, per module, the length of its sequence slice (uneven SP splits differ) and its
pipeline stage (stages hold different layers and keep different numbers of micro-batches in flight). DP, ZeRO
and TP peers hold equal shards; among TP peers only coordinate 0 sends the hand-off / hand-back (copies of what
it sends), so the lowest rank of each role, which has TP coordinate 0, is the one run. A disjoint plan has at
least one role per group.

Adam creates its states at its first step; they are created before the measured step
(``init_optimizer_states``), so the step measured has the steady state's peak. Peaks are of tensor memory only;
the planner's prediction adds its framework overhead (CUDA context, workspaces:
``plan.predicted.memory_breakdown_gib.overhead``) and compares with the usable fraction of the device
(``usable_memory_fraction`` of planner.cost.assumptions). FITS uses the same rule: measured peak + overhead <=
usable memory.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_impls import _is_tensor_constructor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState, _UpdateType
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import _sharding_prop as sharding_prop
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_flatten, tree_map_only
from transformers.distributed.expert_parallel import AllToAllEP, EPImplementationInterface, _AllToAllState
from transformers.integrations import moe as moe_integration

from planner.contract.schema import ZERO_BUBBLE_SCHEDULES, Plan
from runtime.training import trainer as trainer_module
from runtime.data.samples import Sample, SampleLayout, token_sequence
from runtime.models.families import family_of
from runtime.models.model import hf_config_from_dict
from runtime.parallel.ulysses import split_sequence, split_windows
from runtime.parallel.parallel_dims import forget_earlier_worlds, plan_dims
from runtime.models.pipeline import PipelinedLanguageModel
from runtime.training.step_inputs import StepInputs
from runtime.parallel.precision import module_precision
from runtime.models.parallelize import uses_fsdp
from runtime.models import vision as vision_module
from runtime.parallel import experts as experts_module
from runtime.run.preflight import module_names
from runtime.training.trainer import RunOptions, Trainer, numerics_device_type
from runtime.models.vision import window_layout
from planner.contract.units import GIB

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


@contextlib.contextmanager
def _emulation():
    """The trainer's tensors on CPU, vision windows as one segment, a pipeline's stages voting alone, experts'
    tokens exchanged as if routed evenly (``BalancedAllToAllEP``), fp32 experts' grouped GEMMs through transformers'
    fallback op (``_fp32_grouped_mm_by_fallback``); DTensor's
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
                              _fp32_grouped_mm_by_fallback(moe_integration._can_use_grouped_mm)):
        yield


# ---- roles ------------------------------------------------------------------------------------------------------
def _slice_lengths(plan: Plan, name: str, layout: SampleLayout, config: Any) -> list[int]:
    """Sequence positions each SP rank of module ``name`` holds per micro-batch."""
    dims = plan_dims(plan, name)
    if name == "llm":
        bounds = split_sequence(layout.seq_len, dims.sp)
        return [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    _, cu_windows = window_layout(torch.tensor(layout.grids() * dims.micro_batch), config.vision_config)
    bounds = split_windows(cu_windows, dims.sp)
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def role_keys(plan: Plan) -> dict[int, tuple]:
    """Each rank's role: per module it holds, (module, the length of its sequence slice, its pipeline stage)."""
    config = hf_config_from_dict(plan.model.hf_config)
    layout = family_of(config).encoder.layout_from_plan(plan.workload, config)
    lengths = {name: _slice_lengths(plan, name, layout, config) for name in module_names(plan)}
    dims = {name: plan_dims(plan, name) for name in module_names(plan)}
    keys = {}
    for rank in sorted({r for m in plan.modules for r in m.ranks}):
        key = []
        for name in module_names(plan):
            if rank in dims[name].ranks:
                coord = dims[name].coordinate(rank)
                key.append((name, lengths[name][coord["sp"]], coord["pp"]))
        keys[rank] = tuple(key)
    return keys


def roles(plan: Plan) -> dict[int, list[int]]:
    """The lowest rank of each role -> all ranks of that role. The lowest rank has TP coordinate 0: it is the one
    that sends the hand-off and the hand-back (the copies it sends are extra memory; its TP peers hold none)."""
    groups: dict[tuple, list[int]] = {}
    for rank, key in role_keys(plan).items():
        groups.setdefault(key, []).append(rank)
    return {ranks[0]: ranks for ranks in groups.values()}


# ---- measuring one role -----------------------------------------------------------------------------------------
def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (local shards of DTensors)."""
    storages = {}
    for t in tensors:
        storage = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


@dataclass(kw_only=True)
class ModuleMemory:
    """One module's measured memory on one rank, in bytes."""

    weights: int
    """Its parameters (local shards) after the step."""
    gradients: int
    """Its gradients (local shards) after the step."""
    optimizer: int
    """Its Adam states after the step."""
    activations: int
    """Activation memory its forward leaves alive for backward (one micro-batch)."""


@dataclass(kw_only=True)
class RoleMemory:
    """One rank's measured memory, in bytes."""

    rank: int
    """The rank run."""
    ranks: list[int]
    """All ranks of the same role."""
    modules: dict[str, ModuleMemory]
    """Per module it holds."""
    peak: dict[str, int]
    """Peak tensor memory of the step by MemTracker category (``Total`` the sum)."""
    startup_peak: int
    """Peak tensor memory while the Trainer was built."""
    peak_at: str
    """Where the step's peak was reached: the innermost module running and the pass, e.g.
    ``LanguageModel.lm_head (forward)``."""
    seconds: float
    """Wall time of this role's dry-run."""


def _module_states(trainer: Trainer, name: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes of module ``name`` on this rank."""
    params = list(trainer.modules[name].parameters())
    grads = [p.grad for p in params if p.grad is not None]
    optimizer = 0
    if name in trainer.optimizers:
        states = trainer.optimizers[name][0].state.values()
        optimizer = _storage_bytes(v for state in states for v in state.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    return _storage_bytes(params), _storage_bytes(grads), optimizer


def _leaf_inputs_detached(pre_hook):
    """ModTracker's forward pre-hook, given a module's autograd-leaf inputs detached (the same storages, so the same
    memory): on the inputs that need a gradient it registers a hook that asks the engine whether each will be
    reached, which torch refuses for a leaf inside ``autograd.grad`` -- a zero-bubble stage's input-gradient pass
    over the activations it received. A module whose inputs are all leaves leaves its backward at the end of the
    backward instead (hierarchy labels only)."""
    def detached(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if t.is_leaf and t.requires_grad else t

    return lambda module, inputs: pre_hook(module, tree_map_only(torch.Tensor, detached, inputs))


class StepMemTracker(MemTracker):
    """MemTracker across several steps and micro-batches (it refuses a second call of a root module), which also
    records, per module, the most memory one forward call left alive, parameters aside (``forward_activations``;
    of a pipelined module, one model chunk's forward)."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        super().__init__()
        self._mod_tracker._fw_pre_hook = _leaf_inputs_detached(self._mod_tracker._fw_pre_hook)
        self.forward_activations = dict.fromkeys(modules, 0)
        self.peak_at = "no operation"
        self._before: dict[str, int] = {}
        for name, module in modules.items():
            for called in module.chunks if isinstance(module, PipelinedLanguageModel) else [module]:
                called.register_forward_pre_hook(lambda *_, name=name: self._before.__setitem__(name, self._kept()))
                called.register_forward_hook(lambda *_, name=name: self._record(name))

    def forget(self, tensors) -> None:
        """Stop counting ``tensors``' storages (host-side data; each call forgets only what is still counted). Popping
        the entry drops its weak reference too, so the storage's deletion subtracts nothing later."""
        for tensor in tensors:
            for storage in get_untyped_storages(tensor):
                winfo, _ = self._WINFO.pop(storage, (None, None))
                if winfo is not None and winfo.mem_consumed > 0:
                    self._update_snap(_UpdateType.DEL, winfo)

    def _kept(self) -> int:
        """Tracked memory other than parameters (ZeRO-3 gathers and frees them inside a forward)."""
        snapshot = _device_snapshot(self.get_tracker_snapshot())
        return snapshot.get("Total", 0) - snapshot.get("Parameter", 0)

    def _record(self, name: str) -> None:
        if not self._mod_tracker.is_bw:
            kept = self._kept() - self._before[name]
            self.forward_activations[name] = max(self.forward_activations[name], kept)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """Only the global peak: MemTracker's per-module peaks cost a pass over every module per op."""
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)
                innermost = max(self._mod_tracker.parents, key=lambda fqn: fqn.count("."), default="Global")
                self.peak_at = f"{innermost} ({'backward' if self._mod_tracker.is_bw else 'forward'})"

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True
                                         ) -> tuple[int, int]:
        """MemTracker's, with gradient hooks on trainable parameters only: a frozen module's parameters cannot
        take one (torch refuses a hook on a tensor that does not require grad)."""
        def on_grad(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        for param in module.parameters() if install_grad_hooks else []:
            if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(on_grad), param.register_post_accumulate_grad_hook(lambda p: on_grad(p.grad)))
        return memory

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:  # a later micro-batch or step
            stats, snapshot = self.memory_tracking[module], self.get_tracker_snapshot()
            stats.local_peak = {dev: dev_snap["Total"] for dev, dev_snap in snapshot.items()}
            stats.snapshots.setdefault(_ModState.PEAK_FW, []).append(snapshot)
            stats.snapshots.setdefault(_ModState.PRE_FW, []).append(copy.deepcopy(snapshot))
            return
        super()._pre_fw_hook(module, inputs)


@torch.no_grad()
def init_optimizer_states(trainer: Trainer) -> None:
    """Create every optimizer's states as its first step does (a step on zero gradients at learning rate 0),
    then drop the gradients: the state a later step starts from."""
    for optimizer, _ in trainer.optimizers.values():
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def measure_role(plan: Plan, rank: int, options: RunOptions) -> RoleMemory:
    """Build rank ``rank``'s Trainer and run one step in a fresh fake world; its peak tensor memory."""
    start = time.perf_counter()
    world = len({r for m in plan.modules for r in m.ranks})
    forget_earlier_worlds()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with DataDependentFakeMode(), _emulation():
            with MemTracker() as startup:
                trainer = DryRunTrainer(plan, rank=rank, options=options)
            init_optimizer_states(trainer)
            tracker = StepMemTracker(trainer.modules)
            tracker.track_external(*trainer.modules.values(), *(o for o, _ in trainer.optimizers.values()))
            trainer.on_host_data = tracker.forget
            with tracker:
                trainer.train_step()
            peak = _device_snapshot(tracker.get_tracker_snapshot("peak"))
            modules = {}
            for name, module in trainer.modules.items():
                weights, grads, optimizer = _module_states(trainer, name)
                modules[name] = ModuleMemory(weights=weights, gradients=grads, optimizer=optimizer,
                                             activations=tracker.forward_activations[name])
            startup_peak = _device_snapshot(startup.get_tracker_snapshot("peak")).get("Total", 0)
    finally:
        dist.destroy_process_group()
    return RoleMemory(rank=rank, ranks=[], modules=modules, peak=peak, startup_peak=startup_peak,
                      peak_at=tracker.peak_at, seconds=time.perf_counter() - start)


def _device_snapshot(snapshot: dict) -> dict[str, int]:
    """Sum a MemTracker snapshot over devices but ``meta`` (shapes only: the trainer's meta model), keyed by
    category name."""
    out: dict[str, int] = {}
    for device, dev_snap in snapshot.items():
        if torch.device(device).type == "meta":
            continue
        for key, value in dev_snap.items():
            name = getattr(key, "value", key)
            out[name] = out.get(name, 0) + value
    return out


# ---- the plan ---------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DryRunReport:
    """Every role's measured memory beside the planner's prediction, in bytes."""

    plan: Plan
    """The plan dry-run."""
    roles: list[RoleMemory]
    """One entry per distinct role."""
    usable_bytes: int
    """Device memory the planner lets a plan use: memory x usable_memory_fraction."""
    numerics: str
    """How tensors were emulated, in words."""
    seconds: float = 0.0
    """Wall time of the whole dry-run."""

    def overhead_bytes(self, role: RoleMemory) -> int:
        """The planner's framework allowance of the role's GPU group (not measurable on fake tensors)."""
        group = self.predicted_group(role) or self.plan.predicted.memory_breakdown_gib
        return round(group.overhead * GIB)

    def predicted_group(self, role: RoleMemory):
        """The planner's memory breakdown (GiB) of the GPU group the role's rank belongs to: of its pipeline stage's
        GPUs when the LLM is pipelined there (a plan written before stages were recorded: only the largest
        stage's, else None)."""
        stage = _pipeline_stage(self.plan, role.rank)
        stages = self.plan.predicted.stage_memory_breakdown_gib
        if stage is not None and stages:
            return stages[stage]
        if stage is not None and stage != _binding_stage(self.plan):
            return None
        if self.plan.placement == "colocated":
            return self.plan.predicted.memory_breakdown_gib
        (name,) = role.modules
        return self.plan.module(name).predicted.memory_gib

    def role_total(self, role: RoleMemory) -> int:
        """Measured peak tensor memory + the planner's overhead: what the rank needs of its device."""
        return role.peak.get("Total", 0) + self.overhead_bytes(role)

    @property
    def fits(self) -> bool:
        """Every role fits in the usable device memory."""
        return all(self.role_total(role) <= self.usable_bytes for role in self.roles)


def usable_bytes(plan: Plan) -> int:
    """Device memory the planner lets a plan use (its default usable_memory_fraction)."""
    from planner.cost.assumptions import DEFAULT_ASSUMPTIONS  # pure Python, no solver

    return int(plan.cluster.device.memory_bytes * DEFAULT_ASSUMPTIONS.usable_memory_fraction)


def numerics(plan: Plan) -> str:
    """The trainer's numeric recipe per module for the plan's device (runtime.parallel.precision), in words."""
    device = numerics_device_type(plan)
    if device == "cpu":
        return "fake CPU tensors, fp32 (as the runtime trains on CPU)"
    parts = []
    for name in module_names(plan):
        recipe = module_precision(plan.training.precision, device,
                                  fsdp=uses_fsdp(plan_dims(plan, name)))
        compute = ("FSDP2 bf16 all-gathers" if recipe.fsdp_policy is not None
                   else "bf16 autocast" if recipe.autocast_dtype is not None else "")
        dtype = str(recipe.param_dtype).removeprefix("torch.")
        parts.append(f"{name} {dtype} params" + (f", {compute}" if compute else ""))
    return f"fake CPU tensors, the {device} recipe: " + "; ".join(parts) + "; bf16 hand-off"


def dry_run(plan: Plan, options: RunOptions, *, log=None) -> DryRunReport:
    """Run one step of one rank of every distinct role of ``plan`` on fake tensors; their peak memory.

    Args:
        plan: the plan to check.
        options: the run's options (seed; ``data`` and ``checkpoint`` are not read: shapes are the plan's).
        log: called with one line per role as it finishes (e.g. ``print``), or None.

    Raises:
        ValueError / NotImplementedError: the plan cannot run (as ``python -m runtime`` would say), or has an
            audio encoder (measured by real runs only, so far).
    """
    if module_names(plan)[0] != "vision":
        raise NotImplementedError(f"--dry-run measures vision-language plans; {plan.model.name} has an "
                                  f"{module_names(plan)[0]} encoder: run it for real (python -m runtime)")
    start = time.perf_counter()
    measured = []
    for rank, ranks in roles(plan).items():
        role = measure_role(plan, rank, RunOptions(seed=options.seed))
        role.ranks = ranks
        measured.append(role)
        if log is not None:
            log(f"dry-run: rank {rank} ({'+'.join(role.modules)}, {len(role.ranks)} ranks): peak "
                f"{role.peak.get('Total', 0) / GIB:.2f} GiB of tensors in {role.seconds:.0f} s")
    return DryRunReport(plan=plan, roles=measured, usable_bytes=usable_bytes(plan), numerics=numerics(plan),
                        seconds=time.perf_counter() - start)


# ---- the table ----------------------------------------------------------------------------------------------------
PEAK_ROWS = (
    ("weights", ("Parameter", "Buffer")),
    ("gradients", ("Gradient",)),
    ("optimizer", ("Optstate",)),
    ("activations", ("Activation",)),
    ("buffers", ("Temp", "Other")),
)
"""Planner category -> MemTracker categories at the rank's peak (gathered ZeRO-3 layers count as Parameter in
MemTracker and as buffers in the planner; gradients not yet accumulated count as Temp)."""


def _ratio(measured: float, predicted: float | None) -> str:
    return f"{measured / predicted:.2f}" if predicted else "-"


def _row(label: str, measured: float, predicted: float | None) -> str:
    """One table row; ``predicted`` None where the plan has no prediction for this rank (a pipeline stage other
    than its largest)."""
    shown = "-" if predicted is None else f"{predicted / GIB:.2f}"
    return f"  {label:<30} {measured / GIB:>9.2f} {shown:>10} {_ratio(measured, predicted):>6}"


def format_report(report: DryRunReport) -> str:
    """The dry-run beside the planner: per role, per module state and activation rows, the rank's peak by
    category, and FITS / DOES NOT FIT."""
    plan = report.plan
    device = plan.cluster.device
    lines = [
        f"dry-run of {plan.model.name} on {plan.cluster.num_devices} x {device.name} ({plan.placement}, "
        f"{plan.training.precision}): {len(report.roles)} role(s) in {report.seconds:.0f} s",
        f"tensors: {report.numerics}; peaks are tensor memory only, the planner's framework overhead is added for "
        f"FITS; usable = {report.usable_bytes / GIB:.1f} GiB of {device.memory_bytes / GIB:.1f} GiB",
    ]
    for role in report.roles:
        lines += ["", f"rank {role.rank} (role of ranks {_ranges(role.ranks)}; built in "
                      f"{role.startup_peak / GIB:.2f} GiB peak, {role.seconds:.0f} s)",
                  f"  {'module / category (GiB)':<30} {'dry-run':>9} {'predicted':>10} {'ratio':>6}"]
        stage = _pipeline_stage(plan, role.rank)
        for name, memory in role.modules.items():
            module = plan.module(name)
            predicted = _module_prediction(plan, name, stage)
            in_flight = _in_flight(plan, name, stage)
            for field_name in ("weights", "gradients", "optimizer"):
                lines.append(_row(f"{name} {field_name}", getattr(memory, field_name),
                                  predicted and getattr(predicted, field_name) * GIB))
            unit = " chunks" if module.pp > 1 else ""
            label = f"{name} activations" + (f" (x{in_flight}{unit} in flight)" if in_flight > 1 else "")
            lines.append(_row(label, memory.activations * in_flight, predicted and predicted.activations * GIB))
        group = report.predicted_group(role)
        for label, categories in PEAK_ROWS:
            measured = sum(role.peak.get(c, 0) for c in categories)
            lines.append(_row(f"peak: {label}", measured, group and getattr(group, label) * GIB))
        overhead = report.overhead_bytes(role)
        predicted_peak = group and (group.total - group.overhead) * GIB
        lines.append(_row("peak tensors", role.peak.get("Total", 0), predicted_peak))
        if stage is not None:
            own = plan.module("llm").predicted.stage_peak_memory_gib
            lines.append(f"  llm pipeline stage {stage}" + (f": the planner's own peak of the stage {own[stage]:.2f} "
                                                            "GiB" if own else "") +
                         ("" if group else " (the plan's breakdown is of its largest stage)"))
        lines.append(f"  runtime peak during {role.peak_at}")
        total = report.role_total(role)
        verdict = "FITS" if total <= report.usable_bytes else "DOES NOT FIT"
        planner = f" (planner: {group.total:.2f} GiB{_planner_phase(report.plan, role)})" if group else ""
        lines.append(f"  + overhead {overhead / GIB:.1f} = {total / GIB:.2f} GiB of {report.usable_bytes / GIB:.1f} "
                     f"GiB usable{planner}  {verdict}")
    lines += ["", "FITS" if report.fits else "DOES NOT FIT"]
    return "\n".join(lines)


def _module_prediction(plan: Plan, name: str, stage: int | None):
    """The planner's breakdown (GiB) of module ``name`` on a rank of pipeline ``stage`` (None: not pipelined there);
    None for a stage a plan written before stages were recorded has no breakdown of."""
    predicted = plan.module(name).predicted
    if stage is None or plan.module(name).pp == 1:
        return predicted.memory_gib
    if predicted.stage_memory_gib:
        return predicted.stage_memory_gib[stage]
    return predicted.memory_gib if stage == _binding_stage(plan) else None


def _planner_phase(plan: Plan, role: RoleMemory) -> str:
    """`` at the llm forward``: the moment of the step the planner puts the peak at, where the plan records it (for
    the role's group: a disjoint group other than the peak one has its own; a pipeline stage its own)."""
    stage, phases = _pipeline_stage(plan, role.rank), plan.predicted.stage_peak_phases
    if stage is not None and phases:
        return f" at the {phases[stage]}"
    phase = plan.predicted.peak_phase
    if phase is None or (plan.placement == "disjoint" and not phase.startswith(next(iter(role.modules)) + " ")):
        return ""
    return f" at the {phase}"


def _in_flight(plan: Plan, name: str, stage: int | None) -> int:
    """Micro-batches (of a pipelined module: model chunks) whose activations a module holds at once: a pipeline
    stage holds what its schedule keeps in flight (the planner's count, planner.cost.pipeline); the vision tower
    feeding a pipeline runs every forward before the schedule; the vision group of a disjoint plan runs
    MAX_ENCODER_IN_FLIGHT forwards ahead (as the planner's 1F1B model)."""
    from planner.cost.pipeline import in_flight_chunks  # pure Python, no solver

    module = plan.module(name)
    if module.pp > 1:
        return in_flight_chunks(stage, module.pp, module.grad_accum, module.virtual_stages,
                                module.pp_schedule in ZERO_BUBBLE_SCHEDULES)
    if plan.module("llm").pp > 1:
        return module.grad_accum
    if plan.placement == "disjoint" and name != "llm":
        return min(trainer_module.MAX_ENCODER_IN_FLIGHT, module.grad_accum)
    return 1


def _pipeline_stage(plan: Plan, rank: int) -> int | None:
    """The LLM pipeline stage ``rank`` runs (None: the LLM is not pipelined or not on this rank)."""
    dims = plan_dims(plan, "llm")
    return dims.stage_of(rank) if dims.pp > 1 and rank in dims.ranks else None


def _binding_stage(plan: Plan) -> int | None:
    """The pipeline stage the plan's LLM memory breakdown is of (its largest own peak)."""
    own = plan.module("llm").predicted.stage_peak_memory_gib
    return None if not own else own.index(max(own))


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)

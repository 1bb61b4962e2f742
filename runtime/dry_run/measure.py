"""One role's step measured: peak tensor memory by category (torch's ``MemTracker``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from planner.contract.schema import Plan
from runtime.dry_run.emulation import DataDependentFakeMode, DryRunTrainer, emulation
from runtime.models.pipeline import PipelinedLanguageModel
from runtime.observability.memory import TensorMemory, device_snapshot
from runtime.parallel.parallel_dims import forget_earlier_worlds
from runtime.training.trainer import RunOptions, Trainer


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


class StepMemTracker(TensorMemory):
    """``TensorMemory`` that also records, per module, the most memory one forward call left alive, parameters aside
    (``forward_activations``; of a pipelined module, one model chunk's forward)."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        super().__init__()
        self.forward_activations = dict.fromkeys(modules, 0)
        self._before: dict[str, int] = {}
        for name, module in modules.items():
            for called in module.chunks if isinstance(module, PipelinedLanguageModel) else [module]:
                called.register_forward_pre_hook(lambda *_, name=name: self._before.__setitem__(name, self._kept()))
                called.register_forward_hook(lambda *_, name=name: self._record(name))

    def _kept(self) -> int:
        """Tracked memory other than parameters (ZeRO-3 gathers and frees them inside a forward)."""
        snapshot = device_snapshot(self.get_tracker_snapshot())
        return snapshot.get("Total", 0) - snapshot.get("Parameter", 0)

    def _record(self, name: str) -> None:
        if not self._mod_tracker.is_bw:
            kept = self._kept() - self._before[name]
            self.forward_activations[name] = max(self.forward_activations[name], kept)


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
        with DataDependentFakeMode(), emulation():
            with MemTracker() as startup:
                trainer = DryRunTrainer(plan, rank=rank, options=options)
            init_optimizer_states(trainer)
            tracker = StepMemTracker(trainer.modules)
            tracker.track_external(*trainer.modules.values(), *(o for o, _ in trainer.optimizers.values()))
            trainer.on_host_data = tracker.forget
            with tracker:
                trainer.train_step()
            peak = device_snapshot(tracker.get_tracker_snapshot("peak"))
            modules = {}
            for name, module in trainer.modules.items():
                weights, grads, optimizer = _module_states(trainer, name)
                modules[name] = ModuleMemory(weights=weights, gradients=grads, optimizer=optimizer,
                                             activations=tracker.forward_activations[name])
            startup_peak = device_snapshot(startup.get_tracker_snapshot("peak")).get("Total", 0)
    finally:
        dist.destroy_process_group()
    return RoleMemory(rank=rank, ranks=[], modules=modules, peak=peak, startup_peak=startup_peak,
                      peak_at=tracker.peak_at, seconds=time.perf_counter() - start)

"""A step's tensor memory as torch's ``MemTracker`` counts it (the dry-run's measure, and a CPU run's memory cap), and
the error a step that ran out of memory ends with.

``TensorMemory`` is ``MemTracker`` made fit for whole training steps: it keeps only the global peak (its per-module
peaks cost a pass over every module per op), takes several calls of a root module (micro-batches, steps), puts
gradient hooks on trainable parameters only (torch refuses one on a frozen parameter) and lets a pipeline stage's
input-gradient pass run over its received activations. ``CappedTensorMemory`` also fails the operation that takes
the tracked tensors past a cap with ``torch.OutOfMemoryError``, as a device of that size would: a CPU run's stand-in
for a GPU's memory (``--memory-cap-gib``).
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState, _UpdateType
from torch.utils._pytree import tree_map_only

from planner.contract.units import GIB

warnings.filterwarnings("ignore", message="The module hierarchy tracking", category=UserWarning)
"""ModTracker's warning when a step's modules run again (micro-batches, recomputation): the peak is what is kept."""


def _leaf_inputs_detached(pre_hook):
    """ModTracker's forward pre-hook, given a module's autograd-leaf inputs detached (the same storages, so the same
    memory): on the inputs that need a gradient it registers a hook that asks the engine whether each will be
    reached, which torch refuses for a leaf inside ``autograd.grad`` -- a zero-bubble stage's input-gradient pass
    over the activations it received. A module whose inputs are all leaves leaves its backward at the end of the
    backward instead (hierarchy labels only)."""
    def detached(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if t.is_leaf and t.requires_grad else t

    return lambda module, inputs: pre_hook(module, tree_map_only(torch.Tensor, detached, inputs))


def device_snapshot(snapshot: dict) -> dict[str, int]:
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


class TensorMemory(MemTracker):
    """MemTracker across several steps and micro-batches (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker._fw_pre_hook = _leaf_inputs_detached(self._mod_tracker._fw_pre_hook)
        self.peak_at = "no operation"

    def peak(self) -> dict[str, int]:
        """The peak's bytes by category (``Total`` the sum)."""
        return device_snapshot(self.get_tracker_snapshot("peak"))

    def forget(self, tensors) -> None:
        """Stop counting ``tensors``' storages (host-side data; each call forgets only what is still counted). Popping
        the entry drops its weak reference too, so the storage's deletion subtracts nothing later."""
        for tensor in tensors:
            for storage in get_untyped_storages(tensor):
                winfo, _ = self._WINFO.pop(storage, (None, None))
                if winfo is not None and winfo.mem_consumed > 0:
                    self._update_snap(_UpdateType.DEL, winfo)

    def _update_peak_stats(self, peak_state: Any) -> None:
        """Only the global peak, and where it was reached."""
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)
                innermost = max(self._mod_tracker.parents, key=lambda fqn: fqn.count("."), default="Global")
                self.peak_at = f"{innermost} ({'backward' if self._mod_tracker.is_bw else 'forward'})"

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True
                                         ) -> tuple[int, int]:
        """MemTracker's, with gradient hooks on trainable parameters only."""
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


class CappedTensorMemory(TensorMemory):
    """``TensorMemory`` whose tracked tensors may not exceed ``cap_bytes`` on any device: the operation that takes
    them past it raises ``torch.OutOfMemoryError`` (its outputs already counted, as the allocator's failed request
    would have been)."""

    def __init__(self, cap_bytes: int) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes

    def _update_peak_stats(self, peak_state: Any) -> None:
        super()._update_peak_stats(peak_state)
        for dev_snap in self._curr_mem_snap.values():
            if dev_snap["Total"] > self.cap_bytes:
                raise torch.OutOfMemoryError(
                    f"memory cap: {self.peak_at} took this rank's tensors to {dev_snap['Total'] / GIB:.4g} GiB, over "
                    f"the cap of {self.cap_bytes / GIB:.4g} GiB")


class StepOutOfMemory(Exception):
    """Rank ``rank`` (holding ``modules``) ran out of memory in step ``step``: ``tensor_bytes`` of tensors when the
    allocation failed (counting the request), on a device that holds ``capacity_bytes`` of them."""

    def __init__(self, rank: int, modules: list[str], step: int, tensor_bytes: int, capacity_bytes: int) -> None:
        super().__init__(rank, modules, step, tensor_bytes, capacity_bytes)
        self.rank, self.modules, self.step = rank, modules, step
        self.tensor_bytes, self.capacity_bytes = tensor_bytes, capacity_bytes

    def __str__(self) -> str:
        return (f"rank {self.rank} ({'+'.join(self.modules)}) ran out of memory in step {self.step}: "
                f"{self.tensor_bytes / GIB:.4g} GiB of tensors on a device that holds {self.capacity_bytes / GIB:.4g}")


def requested_bytes(message: str) -> int:
    """The request a CUDA out-of-memory message names ("Tried to allocate 2.00 GiB"), 0 when it names none."""
    match = re.search(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", message)
    if match is None:
        return 0
    unit = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[match.group(2)]
    return round(float(match.group(1)) * unit)

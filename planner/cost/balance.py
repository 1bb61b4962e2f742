"""Each module's replicas balanced on their own work, every step, and the price of the imbalance that is left.

A dataset plan's samples differ wildly per module: one 4K screenshot costs a full-attention vision block what ~100
thumbnails cost, while their LLM tokens differ far less. So each module is balanced on its own work:

- **The work of a sample** (``SampleWork``) is the cost model's device time of running it alone through a module on
  one of its ranks (every layer's forward, backward and recomputation, ``planner.cost.layers.layer_terms``), the
  per-call host and launch overheads left out (a rank pays those per micro-batch, not per sample). Vision items are
  images and clips (patches; attention on each image's or temporal group's own length, and on its windows); LLM
  items are packs (tokens; attention on each packed sample's length, or the whole row under a dense mask).
- **Per step, per module** (``assign_lpt``, ``balance_packs``): the LLM's replicas take the step's packs by LLM work
  (longest processing time first with equal counts, each replica's costliest first, so micro-batch ``m`` holds every
  replica's ``m``-th), and for each micro-batch the vision replicas take its images by vision work (longest
  processing time first, any count), independently; the hand-off routes carry each image's tokens to the LLM row
  that holds its text. The assignment is a function of the step's packs alone, so every rank computes the same one
  without communication.
- **Its price** (``StepBalance``, ``balanced_workload``): the expected imbalance of a module, the sum over a step's
  micro-batches of its busiest replica's work over the sum of the mean replica's (``step_imbalance``; replicas meet
  in collectives every micro-batch), estimated by simulating the assignment on steps drawn from the dataset's packs.
  Simulation rather than an order-statistics formula: the busiest replica under LPT depends on the whole shape of
  the per-item cost distribution (a heavy tail of large images or clips, how many items a replica gets), which the
  dataset's own packs give exactly and a closed form would have to assume. The cost model then prices the slowest
  replica: the mean pack's work scaled by the imbalance.
- **Its memory** (``StepBalance.heaviest_replica``, ``heaviest_replica_workload``): what the replica with the most
  tokens holds in a micro-batch: a vision replica the images the simulated assignment gave it (by LPT a replica
  can hold more than the mean, up to about the mean plus its largest image, and the heaviest pack's images are
  split), an LLM replica its micro-batch's whole packs (at most the epoch's heaviest).

Pure Python (no torch): the runtime imports the same work and the same assignment.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, CostAssumptions
from planner.cost.comm import Link
from planner.cost.layers import Shard, layer_terms
from planner.cost.rank_cost import backward_mode, segment_stats
from planner.contract.families import model_from_hf_config
from planner.contract.hardware import DeviceSpec
from planner.contract.models import ModelSpec
from planner.contract.packing import balance_packs
from planner.contract.schema import Plan
from planner.contract.workload import ModuleTokens, Workload, image_windows

Grid = tuple[int, int, int]
"""(temporal patches or groups, rows, cols) in patches of one image or clip."""

BALANCED_MODULES = ("vision", "llm")
"""The modules a dataset plan balances per step."""
SIMULATED_ITEMS = 4096
"""Packs the price of a module's imbalance simulates at least (drawn as whole micro-batches or steps); more give a
steadier estimate, each costs an LPT insertion."""
SIMULATED_RANGE = (4, 32)
"""The fewest and most micro-batches (vision) or steps (LLM) simulated."""
_FREE_LINK = Link(bandwidth=1.0, latency=0.0)
"""A sample's work leaves the collectives out (they move with the micro-batch, not the sample): any link."""


@dataclass(kw_only=True, frozen=True)
class ModuleDegrees:
    """The degrees of a module that split one sample's work on a rank."""

    tp: int = 1
    """Tensor-parallel degree."""
    sp: int = 1
    """Ulysses degree."""
    recompute: str = "none"
    """none / selective / full."""


def module_work(model: ModelSpec, module: str, tokens: ModuleTokens, device: DeviceSpec,
                assumptions: CostAssumptions, degrees: ModuleDegrees) -> float:
    """Device seconds of one sample's ``tokens`` through ``module`` on one of its ranks: the sum over its layers of
    ``layer_terms``' forward, backward and recomputation at micro-batch 1 (the cost model's formulas: GEMMs per
    Narayanan et al. 2021 eq. 3, attention per segment and window), without collectives."""
    seg_len, seg_count = segment_stats(tokens)
    shard = Shard(
        tp=degrees.tp, sp=degrees.sp, cp=1, micro_batch=1, tokens=tokens.tokens / degrees.sp,
        segment_tokens=seg_len, segments=seg_count,
        window_tokens=tokens.tokens / tokens.windows if tokens.windows else 0.0, windows=float(tokens.windows),
        recompute=degrees.recompute, backward=backward_mode(model, module), tp_link=_FREE_LINK, sp_link=_FREE_LINK,
        cp_link=_FREE_LINK, ep_link=_FREE_LINK, device=device, assumptions=assumptions,
    )
    total = 0.0
    for layer in model.module(module).layers:
        terms = layer_terms(layer, shard)
        total += layer.count * (terms.forward_s + terms.backward_s + terms.recompute_s)
    return total


def items_tokens(grids: Sequence[Grid], model: ModelSpec) -> ModuleTokens:
    """What vision items of ``grids`` put through the tower together (``planner.contract.workload.vision_tokens``'
    accounting): ``t`` full-attention segments of ``h * w`` patches per item, their windows, and the merged tokens
    handed to the LLM."""
    merge = model.vision_input.spatial_merge_size**2
    segments = tuple(h * w for t, h, w in grids for _ in range(t))
    return ModuleTokens(tokens=sum(segments), segments=segments,
                        windows=sum(t * image_windows(h, w, model) for t, h, w in grids),
                        output_tokens=sum(t * h * w // merge for t, h, w in grids))


class SampleWork:
    """The work of one vision item or one LLM pack (``module_work``), memoised by what determines it."""

    def __init__(self, model: ModelSpec, device: DeviceSpec, assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
                 degrees: Mapping[str, ModuleDegrees] | None = None):
        self.model = model
        self.device = replace(device, kernel_launch_latency=0.0)
        """The device without per-kernel launch latency: a sample's work is its kernels' work."""
        self.assumptions = replace(assumptions, host_seconds_per_op=0.0, dtensor_seconds_per_op=0.0)
        """No host dispatch: it is paid per operator call of a micro-batch, not per sample."""
        self.degrees = dict(degrees or {})
        self._memo: dict[tuple, float] = {}

    def vision(self, grid: Grid) -> float:
        """One image (``t = 1``) or clip (``t`` temporal groups): ``t`` full-attention segments of ``h * w``
        patches, and their windows (``planner.contract.workload.vision_tokens``' accounting)."""
        return self._work("vision", tuple(grid), items_tokens([grid], self.model))

    def llm(self, lengths: Sequence[int]) -> float:
        """One pack of samples of ``lengths`` tokens: one attention segment each."""
        total, squares = int(sum(lengths)), int(sum(n * n for n in lengths))
        return self._work("llm", (total, squares), ModuleTokens(tokens=total, segments=(), segment_squares=squares))

    def _work(self, module: str, key: tuple, tokens: ModuleTokens) -> float:
        found = self._memo.get((module, key))
        if found is None:
            degrees = self.degrees.get(module, ModuleDegrees())
            found = self._memo[(module, key)] = module_work(self.model, module, tokens, self.device,
                                                            self.assumptions, degrees)
        return found


def plan_sample_work(plan: Plan) -> SampleWork:
    """The work a plan's runtime balances on: the plan's model (its frozen modules frozen), device, attention calls
    and each module's TP, SP and recomputation; the default cost-model assumptions otherwise."""
    model = model_from_hf_config(plan.model.hf_config, plan.model.name)
    model = model.with_frozen([m.name for m in plan.modules if m.frozen and m.name in model.module_names])
    assumptions = replace(DEFAULT_ASSUMPTIONS, attention_calls=plan.module("llm").attention)
    degrees = {m.name: ModuleDegrees(tp=m.tp, sp=m.sp, recompute=m.recompute) for m in plan.modules}
    return SampleWork(model, plan.cluster.device, assumptions, degrees)


def assign_lpt(costs: Sequence[float], bins: int) -> list[list[int]]:
    """Indexes of ``costs`` assigned to ``bins`` by longest processing time first: each item, costliest first (ties:
    the lower index), to the least-loaded bin (ties: the lower bin); each bin lists its items in index order.
    Graham 1969, "Bounds on multiprocessing timing anomalies": a makespan at most 4/3 - 1/(3 bins) of the best.
    Deterministic: every rank computes the same assignment from the same costs."""
    heap = [(0.0, b) for b in range(bins)]
    assigned: list[list[int]] = [[] for _ in range(bins)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(heap)
        assigned[b].append(index)
        heapq.heappush(heap, (load + costs[index], b))
    return [sorted(items) for items in assigned]


def step_imbalance(loads: Sequence[Sequence[float]]) -> float:
    """A step's imbalance over a module's replicas: ``sum_m max_r loads[m][r] / sum_m mean_r loads[m][r]`` (the
    replicas meet in their collectives every micro-batch ``m``, so each waits for the busiest); 1 with no work."""
    busiest = sum(max(micro) for micro in loads)
    mean = sum(sum(micro) / len(micro) for micro in loads)
    return busiest / mean if mean > 0 else 1.0


def llm_micro_loads(pack_loads: Sequence[float], dealt: list[list[int]], per_replica: int) -> list[list[float]]:
    """Per micro-batch, each LLM replica's work, from the packs ``dealt`` to it (``balance_packs``: micro-batch
    ``m`` is its packs ``m * per_replica`` to ``(m + 1) * per_replica``)."""
    micro_batches = len(dealt[0]) // per_replica
    return [[sum(pack_loads[k] for k in mine[m * per_replica:(m + 1) * per_replica]) for mine in dealt]
            for m in range(micro_batches)]


@dataclass(eq=False)
class StepBalance:
    """A dataset's packs as the per-step assignment sees them, and the expected imbalance it leaves per module."""

    pack_grids: tuple[tuple[Grid, ...], ...]
    """Each pack's vision items (images, then clips, sample by sample)."""
    pack_lengths: tuple[tuple[int, ...], ...]
    """Each pack's samples' LLM tokens."""
    seed: int = 0
    """Seed of the simulated steps."""
    _memo: dict = field(default_factory=dict, repr=False)

    def expected_imbalance(self, module: str, replicas: int, per_replica: int, micro_batches: int,
                           work: SampleWork) -> float:
        """``step_imbalance`` of ``module`` expected under the per-step assignment, ``replicas`` replicas taking
        ``per_replica`` packs' worth per micro-batch: the mean over simulated micro-batches (vision: each of
        ``replicas * per_replica`` packs drawn from the epoch, their images assigned by ``assign_lpt``) or steps
        (LLM: ``micro_batches`` such micro-batches, dealt by ``balance_packs`` on LLM work)."""
        return self._simulated(module, replicas, per_replica, micro_batches, work)[0]

    def heaviest_replica(self, module: str, replicas: int, per_replica: int, micro_batches: int,
                         work: SampleWork) -> ModuleTokens:
        """What one replica of ``module`` holds in its heaviest micro-batch under the per-step assignment (the most
        tokens, then the largest squared segments), per pack (the cost model multiplies a pack by the micro-batch's
        ``per_replica``). LLM: its micro-batch is ``per_replica`` whole packs, so at most the epoch's
        ``per_replica`` heaviest. Vision: the images of the heaviest replica in the micro-batches simulated for
        ``expected_imbalance`` (LPT can give a replica more than the mean: about the mean plus its largest image,
        or many small images of the same work as a large one) or the dataset's largest item alone, whichever holds
        more; with one replica, its ``per_replica`` heaviest packs' images."""
        if module == "vision" and replicas > 1:
            heaviest = self._simulated(module, replicas, per_replica, micro_batches, work)[1]
            largest = max(([g] for grids in self.pack_grids for g in grids), key=_weight)
            heaviest = max(heaviest, items_tokens(largest, work.model), key=_heft)
        elif module == "vision":
            packs = sorted(self.pack_grids, key=_weight, reverse=True)
            heaviest = items_tokens([g for grids in _repeated(packs, per_replica) for g in grids], work.model)
        else:
            packs = sorted(self.pack_lengths, key=lambda n: (sum(n), sum(k * k for k in n)), reverse=True)
            lengths = [n for pack in _repeated(packs, per_replica) for n in pack]
            heaviest = ModuleTokens(tokens=sum(lengths), segments=tuple(lengths))
        return ModuleTokens(tokens=heaviest.tokens / per_replica, segments=(), windows=heaviest.windows / per_replica,
                            output_tokens=heaviest.output_tokens / per_replica,
                            segment_squares=heaviest.squared_segments / per_replica)

    def _simulated(self, module: str, replicas: int, per_replica: int, micro_batches: int, work: SampleWork
                   ) -> tuple[float, ModuleTokens | None]:
        """(the expected imbalance, vision: the heaviest replica's items seen), memoised."""
        key = (module, replicas, per_replica, micro_batches, id(work))
        if key not in self._memo:
            self._memo[key] = self._simulate(module, replicas, per_replica, micro_batches, work)
        return self._memo[key]

    def _simulate(self, module: str, replicas: int, per_replica: int, micro_batches: int, work: SampleWork
                  ) -> tuple[float, ModuleTokens | None]:
        if replicas == 1:
            return 1.0, None
        rng = np.random.default_rng(self.seed)
        low, high = SIMULATED_RANGE
        if module == "vision":
            packs = replicas * per_replica
            loads, heaviest = [], ModuleTokens(tokens=0, segments=())
            for _ in range(min(max(math.ceil(SIMULATED_ITEMS / packs), low), high)):
                grids = [g for k in self._draw(rng, packs) for g in self.pack_grids[k]]
                costs = [work.vision(g) for g in grids]
                assigned = assign_lpt(costs, replicas)
                loads.append([sum(costs[i] for i in mine) for mine in assigned])
                mine = max(assigned, key=lambda mine: _weight([grids[i] for i in mine]))
                heaviest = max(heaviest, items_tokens([grids[i] for i in mine], work.model), key=_heft)
            return step_imbalance(loads), heaviest
        step = replicas * per_replica * micro_batches
        ratios = []
        for _ in range(min(max(math.ceil(SIMULATED_ITEMS / step), low), high)):
            pack_loads = [work.llm(self.pack_lengths[k]) for k in self._draw(rng, step)]
            dealt = balance_packs(pack_loads, replicas, per_replica * micro_batches)
            ratios.append(step_imbalance(llm_micro_loads(pack_loads, dealt, per_replica)))
        return float(np.mean(ratios)), None

    def _draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` packs of a step: without replacement within an epoch, as the runtime's seeded order visits
        them (with replacement only when a step holds more packs than an epoch)."""
        return rng.choice(len(self.pack_lengths), size=count, replace=count > len(self.pack_lengths))


def _heft(tokens: ModuleTokens) -> tuple[float, float]:
    """What orders what a replica holds by memory: the most tokens, then the largest squared segments."""
    return tokens.tokens, tokens.squared_segments


def _weight(grids: Sequence[Grid]) -> tuple[int, int]:
    """``_heft`` of vision items, from their grids alone."""
    return sum(t * h * w for t, h, w in grids), sum(t * (h * w) ** 2 for t, h, w in grids)


def _repeated(packs: list, count: int) -> list:
    """The first ``count`` of ``packs`` (heaviest first), each once per epoch a micro-batch of ``count`` packs can
    span (it repeats a pack only when it holds more than an epoch)."""
    return (packs * math.ceil(count / len(packs)))[:count]


_WORK: dict[tuple, SampleWork] = {}
_BALANCED: dict[tuple, tuple[Workload, Workload, float]] = {}
_HEAVIEST: dict[tuple, tuple[Workload, Workload]] = {}


def _work(model: ModelSpec, device: DeviceSpec, assumptions: CostAssumptions) -> SampleWork:
    """The ``SampleWork`` of a model, device and assumptions, kept per their identity."""
    key = (id(model), id(device), id(assumptions))
    if key not in _WORK or _WORK[key].model is not model:
        _WORK[key] = SampleWork(model, device, assumptions)
    return _WORK[key]


def balanced_workload(workload: Workload, model: ModelSpec, module: str, dp: int, micro_batch: int, grad_accum: int,
                      device: DeviceSpec, assumptions: CostAssumptions) -> tuple[Workload, float | None]:
    """The workload whose mean pack is the slowest replica's share of ``module`` under the per-step assignment, and
    the expected imbalance it is scaled by (``StepBalance.expected_imbalance``): every token count, window and
    squared segment of the module's mean pack times the imbalance (the slowest replica does that much more of the
    same mix). The workload itself, and None, without a dataset's packs or for another module. Memoised by identity,
    so the cost model's own memos keep working."""
    packs = workload.packs
    if packs is None or packs.balance is None or module not in BALANCED_MODULES:
        return workload, None
    key = (id(workload), id(model), module, dp, micro_batch, grad_accum, id(device), id(assumptions))
    found = _BALANCED.get(key)
    if found is not None and found[0] is workload:
        return found[1], found[2]
    work = _work(model, device, assumptions)
    factor = packs.balance.expected_imbalance(module, dp, micro_batch, grad_accum, work)
    scaled = tuple((m, _scaled(t, factor) if m == module else t) for m, t in packs.mean)
    balanced = replace(workload, packs=replace(packs, mean=scaled))
    if len(_BALANCED) >= 256:
        _BALANCED.clear()
    _BALANCED[key] = (workload, balanced, factor)
    return balanced, factor


def heaviest_replica_workload(workload: Workload, model: ModelSpec, module: str, dp: int, micro_batch: int,
                              grad_accum: int, device: DeviceSpec, assumptions: CostAssumptions) -> Workload | None:
    """The workload whose one pack is what memory must hold for ``module``: its heaviest pack (``Workload.heaviest``)
    with the module's tokens replaced, for a dataset's packs under the per-step assignment, by those of the
    module's heaviest replica micro-batch per pack (``StepBalance.heaviest_replica``). Memoised by identity."""
    heaviest = workload.heaviest()
    packs = workload.packs
    if heaviest is None or packs.balance is None or module not in BALANCED_MODULES:
        return heaviest
    key = (id(workload), id(model), module, dp, micro_batch, grad_accum, id(device), id(assumptions))
    found = _HEAVIEST.get(key)
    if found is None or found[0] is not workload:
        tokens = packs.balance.heaviest_replica(module, dp, micro_batch, grad_accum, _work(model, device, assumptions))
        mine = tuple((m, tokens if m == module else t) for m, t in heaviest.packs.mean)
        found = (workload, replace(heaviest, packs=replace(heaviest.packs, mean=mine, heaviest=mine)))
        if len(_HEAVIEST) >= 256:
            _HEAVIEST.clear()
        _HEAVIEST[key] = found
    return found[1]


def _scaled(tokens: ModuleTokens, factor: float) -> ModuleTokens:
    return replace(tokens, tokens=tokens.tokens * factor, windows=tokens.windows * factor,
                   output_tokens=tokens.output_tokens * factor, segment_squares=tokens.squared_segments * factor)

"""Which strategies a module can run: the valid ``ModuleStrategy`` values on a number of GPUs, before any is
costed (planner.search.candidates costs and prunes them).

Strategy space of one module on ``gpus`` GPUs, for a global batch B:

* ``grad_accum`` divides B; ``dp`` divides B / grad_accum and ``gpus``; ``micro_batch = B / (dp * grad_accum)``;
* ``tp`` divides the GPUs of a node; ``sp`` divides the attention heads of a TP rank; ``cp`` fills the rest
  (``gpus = pp * dp * tp * sp * cp``) and is searched only with ``Problem.allow_ring_cp`` or a pinned cp; ZeRO 0-3
  (only 0 when nothing is reduced); recompute none/selective/full;
* ``ep`` (a module with mixture-of-experts layers) divides dp * cp * sp, and ep * tp its experts (``expert_degrees``);
* ``pp`` (the LLM, with ``Problem.allow_pp`` or a pinned pp) divides its GPUs, with 1F1B, interleaved 1F1B or
  interleaved zero-bubble (``PIPELINE_CHUNKS``); encoders are then candidates twice (costed once), for an LLM that
  is pipelined (they hold every micro-batch's activations across its schedule) and one that is not, and the solver
  keeps a plan consistent;
* ``planner.cost.check_strategy`` decides validity (heads, node size, encoder/LLM axes, windows, tokens).

Group sizes: colocated, every module spans all N GPUs. Disjoint (exactly one encoder): the encoder takes
either less than one node or whole nodes, the LLM the rest; the LLM starts at rank 0, the encoder at
N - g_encoder (``Strategy.first_ranks``).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace
from typing import AbstractSet, Iterable, Iterator, Mapping, NamedTuple

from planner.cost import check_strategy
from planner.contract.models import ENCODER_MODULES, ModelSpec
from planner.problem import Problem
from planner.contract.rules import expert_parallel_rule
from planner.contract.schema import ZERO_BUBBLE_SCHEDULES, zero_bubble_reasons
from planner.contract.strategy import RECOMPUTE_CHOICES, ModuleStrategy, Placement


DENSE_NODE_COUNTS = 16
"""Disjoint encoder groups may take any whole number of nodes up to this many; beyond, a geometric grid."""

@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of ``n``, ascending (memoised: the enumeration asks for the same few numbers often)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def encoder_names(model: ModelSpec) -> list[str]:
    """The model's encoder modules, in model order."""
    return [name for name in model.module_names if name in ENCODER_MODULES]


def sp_degrees(model: ModelSpec, module: str) -> tuple[int, ...]:
    """Ulysses degrees worth trying: divisors of the module's attention heads."""
    heads = [l.attention.num_heads for l in model.module(module).layers if l.attention is not None]
    return divisors(math.gcd(*heads)) if heads else (1,)


def encoder_node_counts(num_nodes: int) -> list[int]:
    """Whole-node counts an encoder group may take: every count up to ``DENSE_NODE_COUNTS``, then k * 2^j nodes
    with k in {1, 3} (24, 32, 48, 64, 96, ...), a grid at most 1.5x apart that keeps 1,024-GPU plans fast."""
    counts = set(range(1, min(num_nodes, DENSE_NODE_COUNTS + 1)))
    power = 1
    while power < num_nodes:
        counts.update(c for c in (power, 3 * power) if c < num_nodes)
        power *= 2
    return sorted(counts)


def group_sizes(problem: Problem, module: str, placement: Placement) -> list[int]:
    """GPU counts the module may occupy: all N colocated; disjoint, the encoder takes any count below one node or
    whole nodes (``encoder_node_counts``) and the LLM the rest.

    Raises:
        NotImplementedError: disjoint placement of a model with more than one encoder.
    """
    n = problem.num_gpus
    if placement == "colocated":
        return [n]
    encoders = encoder_names(problem.model)
    if len(encoders) != 1:
        raise NotImplementedError(
            f"disjoint placement needs exactly one encoder; {problem.model.name} has {len(encoders)} "
            f"({', '.join(encoders) or 'none'}): use --placement colocated"
        )
    node = problem.cluster.devices_per_node
    encoder = sorted({g for g in range(1, min(node, n))} | {k * node for k in encoder_node_counts(-(-n // node))
                                                            if k * node < n})
    return encoder if module in ENCODER_MODULES else sorted(n - g for g in encoder)


def _choices(values: Iterable, fixed: Mapping[str, int | str], name: str) -> list:
    """``values``, or only the pinned value when ``name`` is fixed."""
    return [fixed[name]] if name in fixed else list(values)


def pipeline_degrees(problem: Problem, module: str, gpus: int, fixed: Mapping[str, int | str]) -> list[int]:
    """Pipeline degrees to try: 1, and when PP is searched (``Problem.searches_pp``) or pinned, for the LLM every
    divisor of its GPUs (``check_strategy`` rules out more stages than decoder layers); only the pinned one when
    pinned."""
    degrees = [1]
    if module not in ENCODER_MODULES and (problem.searches_pp or "pp" in fixed):
        degrees = divisors(gpus)
    return [d for d in degrees if fixed.get("pp", d) == d]


PIPELINE_CHUNKS = (1, 2)
"""Model chunks per pipeline rank searched: 1F1B, and the interleaved schedules with 2 (``--fix
llm.virtual_stages=N`` pins another)."""


def _schedules(pp: int, fixed: Mapping[str, int | str]) -> list[tuple[str, int]]:
    """(pp_schedule, virtual_stages) to try for ``pp`` stages: 1F1B with one chunk per rank, interleaved 1F1B and
    interleaved zero-bubble with more."""
    if pp == 1:
        options = [("1f1b", 1)]
    else:
        options = [(schedule, v) for v in _choices(PIPELINE_CHUNKS, fixed, "virtual_stages")
                   for schedule in (("interleaved_1f1b", "interleaved_zb") if v > 1 else ("1f1b",))]
    return [(schedule, v) for schedule, v in options
            if fixed.get("pp_schedule", schedule) == schedule and fixed.get("virtual_stages", v) == v]


def _layouts(problem: Problem, module: str, gpus: int, fixed: Mapping[str, int | str]) -> list[tuple[int, ...]]:
    """(pp, dp, tp, sp, cp) grids of ``gpus`` GPUs whose dp divides the global batch, honouring ``fixed``; Ulysses
    SP inside pipeline stages only with ``sp`` pinned (``--fix llm.sp=K``): searched, it nearly doubles the PP
    search (1,024 GPUs: 13.1 s against 6.5 s here) for plans that pay only on long LLM sequences; never on a
    dataset's packs (``api.check_pipelined_dataset``); ring CP inside pipeline stages only with one of them pinned
    (``check_strategy`` refuses it, and says why)."""
    batch = problem.workload.global_batch
    sp_in_stages = "sp" in fixed and problem.dataset is None
    grids = [(dp, tp, sp) for dp in _choices(divisors(batch), fixed, "dp")
             for tp in _choices(divisors(problem.cluster.devices_per_node), fixed, "tp")
             for sp in _choices(sp_degrees(problem.model, module), fixed, "sp")]
    layouts = []
    for pp in pipeline_degrees(problem, module, gpus, fixed):
        for dp, tp, sp in grids:
            if batch % dp or gpus % (pp * dp * tp * sp) or (pp > 1 and sp > 1 and not sp_in_stages):
                continue
            cp = gpus // (pp * dp * tp * sp)
            if cp > 1 and not (problem.allow_ring_cp or "cp" in fixed):
                continue
            if cp > 1 and pp > 1 and not ("cp" in fixed or "pp" in fixed):  # refused (check_strategy)
                continue
            if fixed.get("cp", cp) == cp:
                layouts.append((pp, dp, tp, sp, cp))
    return layouts


Verdicts = dict[tuple[int, ...], list[str]]
"""(tp, sp, cp, micro_batch[, pp, pp_schedule, virtual_stages, grad_accum]) -> check_strategy's reasons (empty:
valid)."""


def _verdict(problem: Problem, module: str, probe: ModuleStrategy, verdicts: Verdicts) -> list[str]:
    """``check_strategy`` of ``probe``, memoised: once the GPU count and batch are right (``module_strategies``
    guarantees both) validity depends on (tp, sp, cp, micro_batch) only, and with PP on (pp, pp_schedule,
    virtual_stages, grad_accum); a zero-bubble schedule's ZeRO and recomputation rules are applied by the caller."""
    key = (probe.tp, probe.sp, probe.cp, probe.micro_batch)
    if probe.pp > 1:
        key += (probe.pp, probe.pp_schedule, probe.virtual_stages, probe.grad_accum)
    if key not in verdicts:
        verdicts[key] = check_strategy(problem.model, module, probe, problem.cluster, problem.workload)
    return verdicts[key]


LayoutOption = tuple[tuple[int, int, int, int, int], str, int, list[int], list[tuple[int, str]], list[int]]
"""((pp, dp, tp, sp, cp), pp_schedule, virtual_stages, valid grad_accum values descending, valid (zero, recompute),
valid expert-parallel degrees)."""


def expert_degrees(problem: Problem, module: str, dp: int, tp: int, sp: int, cp: int,
                   fixed: Mapping[str, int | str], reasons: list[str]) -> list[int]:
    """Expert-parallel degrees of a layout: 1, and on a module with mixture-of-experts layers every divisor of its
    experts and of dp * cp * sp that ``expert_parallel_rule`` allows (ep * tp divides the experts); only the pinned one
    when pinned. A refused pinned degree, or a tp that leaves none (it refuses ep=1 too), appends its reason to
    ``reasons``."""
    spec = problem.model.module(module)
    experts = next((layer.moe.num_experts for layer in spec.layers if layer.moe is not None), None)
    degrees = divisors(math.gcd(experts, dp * cp * sp)) if experts is not None else (1,)
    if "ep" not in fixed:
        allowed = [ep for ep in degrees if expert_parallel_rule(ep, tp, dp, sp, cp, experts, module) is None]
        if not allowed:
            reasons.append(expert_parallel_rule(1, tp, dp, sp, cp, experts, module))
        return allowed
    problem_with_pin = expert_parallel_rule(fixed["ep"], tp, dp, sp, cp, experts, module)
    if problem_with_pin:
        reasons.append(problem_with_pin)
        return []
    return [fixed["ep"]]


def _layout_options(
    problem: Problem,
    module: str,
    gpus: int,
    fixed: Mapping[str, int | str],
    verdicts: Verdicts,
    accums: set[int] | None,
    reasons: list[str],
    known: AbstractSet[int] = frozenset(),
) -> Iterator[LayoutOption]:
    """Each layout and schedule of ``module`` on ``gpus`` GPUs with a valid strategy (``module_strategies``), what
    varies within it (grad_accum values in ``known`` are not tried); the reasons ``check_strategy`` gives for
    rejecting one without pipeline parallelism, or with a pinned pipeline, are appended to ``reasons``."""
    batch = problem.workload.global_batch
    pinned_pipeline = any(name in fixed for name in ("pp", "pp_schedule", "virtual_stages"))
    for pp, dp, tp, sp, cp in _layouts(problem, module, gpus, fixed):
        per_replica = batch // dp
        expert_choices = expert_degrees(problem, module, dp, tp, sp, cp, fixed, reasons)
        if not expert_choices:
            continue
        for schedule, chunks in _schedules(pp, fixed):
            settings = _zero_recompute_settings(schedule, dp * sp * cp, fixed, reasons if pinned_pipeline else [])
            if not settings:
                continue
            usable_accums = []
            for ga in sorted(_choices(divisors(per_replica), fixed, "grad_accum"), reverse=True):
                if (accums is not None and ga not in accums) or ga in known:
                    continue
                mb = per_replica // ga if per_replica % ga == 0 else 0
                if not mb or fixed.get("micro_batch", mb) != mb:
                    continue
                probe = ModuleStrategy(dp=dp, tp=tp, sp=sp, cp=cp, pp=pp, pp_schedule=schedule, virtual_stages=chunks,
                                       micro_batch=mb, grad_accum=ga)
                problems = _verdict(problem, module, probe, verdicts)
                if problems and (pp == 1 or pinned_pipeline):  # a searched pipeline's rules are no reason to give
                    reasons.append(problems[0])
                if not problems:
                    usable_accums.append(ga)
            if usable_accums:
                yield (pp, dp, tp, sp, cp), schedule, chunks, usable_accums, settings, expert_choices


def _zero_recompute_settings(schedule: str, sharding_ranks: int, fixed: Mapping[str, int | str],
                             reasons: list[str]) -> list[tuple[int, str]]:
    """The (zero, recompute) pairs a layout may take under ``fixed``: ZeRO needs ``sharding_ranks`` (dp * sp * cp)
    above 1, and a zero-bubble ``schedule`` rules out some (``zero_bubble_reasons``, appended to ``reasons``).
    Checked before any grad_accum, so that a pinned ZeRO stage a pinned zero-bubble schedule cannot take is the
    reason given, not a micro-batch count that was never the obstacle."""
    settings = []
    for zero in _choices((0, 1, 2, 3) if sharding_ranks > 1 else (0,), fixed, "zero"):
        for rc in _choices(RECOMPUTE_CHOICES, fixed, "recompute"):
            conflicts = zero_bubble_reasons(zero, rc) if schedule in ZERO_BUBBLE_SCHEDULES else []
            reasons += conflicts[:1]
            if not conflicts:
                settings.append((zero, rc))
    return settings


class SettingsGroup(NamedTuple):
    """Valid strategies that differ only in ZeRO stage and recomputation: ``base`` under each (zero, recompute) of
    ``settings``."""

    base: ModuleStrategy
    settings: tuple[tuple[int, str], ...]

    def strategies(self) -> tuple[ModuleStrategy, ...]:
        return tuple(replace(self.base, zero=zero, recompute=rc) for zero, rc in self.settings)

    def least_demanding(self) -> ModuleStrategy:
        """``base`` at the group's highest ZeRO stage (the least model states) and lightest recomputation (the
        least time)."""
        zero, rc = _least_demanding(self.settings)
        return replace(self.base, zero=zero, recompute=rc)


@functools.lru_cache(maxsize=64)
def _least_demanding(settings: tuple[tuple[int, str], ...]) -> tuple[int, str]:
    """(highest ZeRO stage, lightest recomputation) of ``settings`` (shared by every layout of a module)."""
    return max(zero for zero, _ in settings), min((rc for _, rc in settings), key=RECOMPUTE_CHOICES.index)


def module_strategies(
    problem: Problem,
    module: str,
    gpus: int,
    fixed: Mapping[str, int | str],
    verdicts: Verdicts,
    accums: set[int] | None = None,
    context_parallel: list[SettingsGroup] | None = None,
) -> tuple[list[list[ModuleStrategy]], str | None]:
    """Every valid strategy of ``module`` on exactly ``gpus`` GPUs that consumes the global batch and honours
    ``fixed`` (and uses one of ``accums`` when given), as series that differ only in micro-batch size (ascending;
    grad_accum = batch / (dp * micro_batch)); and the first reason ``check_strategy`` gave for rejecting one without
    pipeline parallelism, or with a pinned pipeline (None if none was rejected). With ``context_parallel`` given,
    the context-parallel strategies are appended to it instead, one ``SettingsGroup`` per layout, expert degree and
    micro-batch (the search bounds them before it builds them: most never are)."""
    batch = problem.workload.global_batch
    series, reasons = [], []
    for (pp, dp, tp, sp, cp), schedule, chunks, usable_accums, settings, expert_choices in _layout_options(
            problem, module, gpus, fixed, verdicts, accums, reasons):
        if context_parallel is not None and cp > 1:
            (zero, rc), settings = settings[0], tuple(settings)
            context_parallel += [
                SettingsGroup(ModuleStrategy(dp=dp, tp=tp, sp=sp, cp=cp, pp=pp, ep=ep, pp_schedule=schedule,
                                             virtual_stages=chunks, zero=zero, recompute=rc,
                                             micro_batch=batch // (dp * ga), grad_accum=ga), settings)
                for ep in expert_choices for ga in usable_accums]
            continue
        for (zero, rc), ep in itertools.product(settings, expert_choices):
            series.append([
                ModuleStrategy(dp=dp, tp=tp, sp=sp, cp=cp, pp=pp, ep=ep, pp_schedule=schedule, virtual_stages=chunks,
                               zero=zero, recompute=rc, micro_batch=batch // (dp * ga), grad_accum=ga)
                for ga in usable_accums
            ])
    return series, next(iter(reasons), None)


def valid_accums(problem: Problem, module: str, gpus: int, fixed: Mapping[str, int | str], verdicts: Verdicts
                 ) -> set[int]:
    """The grad_accum values of ``module_strategies``' strategies, without building them (a value found valid is
    not tried again)."""
    found: set[int] = set()
    for *_, usable_accums, _, _ in _layout_options(problem, module, gpus, fixed, verdicts, None, [], found):
        found.update(usable_accums)
    return found

"""CP-SAT model that picks one candidate strategy per module: minimum step time under the per-GPU memory limit.

Data (``planner.search.candidates``: integers, ns and bytes) -> ``CpModel`` -> variables -> one function per constraint
family -> objective -> parameters -> status -> typed ``Solution``s. The objective reproduces
``planner.cost.combine`` exactly (up to 0.5 ns rounding per term):

* colocated: ``step = sum_m (grad_accum * per_micro_batch_m + bubble_m + tail_m)`` (tail = exposed DP comm +
  optimizer, bubble = a pipelined LLM's fill and drain); memory on every GPU at every phase of the step
  ``sum_m memory_m[phase] + overhead <= usable`` (``planner.cost.phases``); encoders costed for a pipelined LLM
  are chosen exactly when the LLM is pipelined.
* disjoint (one encoder, one LLM, 1F1B over grad_accum micro-batches): ``step = max_k sum_m path_m[k] +
  max_m tail_m``, the longest critical path of the runtime's schedule (``planner.cost.pipeline``), linear because
  each candidate carries its own terms for its grad_accum, one shared choice; each group fits by itself
  (candidates are filtered); the groups use exactly N GPUs.

Integers: the candidates carry nanoseconds and bytes. CP-SAT checks that no linear expression can overflow 64-bit
integers, and reads the objective back as a double; so the model counts time and memory in units (``Units``) large
enough that the sum of every coefficient of a family stays below ``MAX_MODEL_INTEGER`` (2^53, exact in a double).
For every plan a user can ask for on real hardware that unit is 1 ns and 1 byte; only extreme inputs (a step of
days on thousands of candidates) coarsen it, then times are rounded to the nearest unit and memory rounded up
(never admitting a plan that does not fit). The reported step time is re-added from the chosen candidates' exact
nanoseconds, so it never carries the coarser rounding.

Ties are broken deterministically by a second solve that fixes the optimal step time and minimises a
mixed-radix index of the chosen candidates (each module's list is ordered best first), so the same inputs
give the same plan with any number of workers. (Only a solve cut short by the time limit -- status FEASIBLE, or
a tie-break left unproven or without any plan -- can depend on thread timing.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping

from ortools.sat.python import cp_model

from planner.search.candidates import Candidate, Candidates
from planner.cost.pipeline import NUM_PATHS

Status = Literal["OPTIMAL", "FEASIBLE"]


@dataclass(kw_only=True, frozen=True)
class SolverSettings:
    """CP-SAT parameters."""

    time_limit_s: float = 20.0
    """Wall-clock limit of each solve; a plan found but not proven optimal by then is reported FEASIBLE."""
    num_workers: int = 8
    """Search workers (8 enables CP-SAT's parallel portfolio; it pays off even on 2 cores)."""
    seed: int = 0
    """Random seed of the search."""


DEFAULT_SETTINGS = SolverSettings()


@dataclass(kw_only=True, frozen=True)
class Solution:
    """One chosen candidate per module."""

    status: Status
    """OPTIMAL when proven optimal (for top-k: optimal among plans not yet listed), else FEASIBLE."""
    choice: Mapping[str, Candidate]
    """Module -> chosen candidate, in model order."""
    objective_ns: int
    """Predicted step time in nanoseconds, as the solver computed it."""


class SolverTimeout(ValueError):
    """No plan was found within the time limit."""


Vars = dict[tuple[str, int], cp_model.IntVar]
"""(module, candidate index) -> boolean."""
Coefficient = Callable[[Candidate], int]
"""A candidate's coefficient in one constraint family, in the model's units."""

MAX_MODEL_INTEGER = 2**53
"""Bound on the sum of all coefficients of a family: far below CP-SAT's int64 overflow checks, and exact as the
double CP-SAT reports the objective in."""


@dataclass(kw_only=True, frozen=True)
class Units:
    """The model's integer units: nanoseconds and bytes per unit (1 unless the inputs are extreme)."""

    ns: int
    """Nanoseconds per time unit."""
    bytes: int
    """Bytes per memory unit."""

    def time(self, ns: int) -> int:
        """Nanoseconds in time units, rounded to the nearest."""
        return (ns + self.ns // 2) // self.ns

    def memory(self, num_bytes: int) -> int:
        """Bytes in memory units, rounded up."""
        return -(-num_bytes // self.bytes)


def model_units(cands: Candidates, memory_budget_bytes: int) -> Units:
    """The smallest units keeping the sum of every family's coefficients within ``MAX_MODEL_INTEGER``: time (every
    term of every candidate, which bounds the step, the paths and the tails) and memory (with the budget)."""
    every = [c for cs in cands.by_module.values() for c in cs]
    time_total = sum(c.step_ns + sum(c.path_ns) + c.tail_ns for c in every)
    memory_total = sum(c.memory_bytes for c in every) + max(memory_budget_bytes, 0)  # each one's largest phase
    return Units(ns=-(-time_total // MAX_MODEL_INTEGER) or 1, bytes=-(-memory_total // MAX_MODEL_INTEGER) or 1)


def weighted(x: Vars, cands: Candidates, coefficient: Coefficient, modules: list[str] | None = None) -> cp_model.LinearExpr:
    """sum over candidates c of the given modules of coefficient(c) * x[m,c]."""
    pairs = [
        (x[m, i], coefficient(c))
        for m in (modules or list(cands.by_module))
        for i, c in enumerate(cands.by_module[m])
    ]
    return cp_model.LinearExpr.weighted_sum([v for v, _ in pairs], [w for _, w in pairs])


# --- Constraint families ----------------------------------------------------------------------------------------


def add_shared_grad_accum(model: cp_model.CpModel, x: Vars, cands: Candidates) -> None:
    """For every module m and grad-accum value a: sum_{c in C_m, ga_c = a} x[m,c] == y[a]; sum_a y[a] == 1.

    This also makes every module choose exactly one candidate.
    """
    accums = sorted({c.grad_accum for cs in cands.by_module.values() for c in cs})
    y = {a: model.new_bool_var(f"ga_{a}") for a in accums}
    model.add_exactly_one(y.values())
    for m, cs in cands.by_module.items():
        for a in accums:
            model.add(cp_model.LinearExpr.sum([x[m, i] for i, c in enumerate(cs) if c.grad_accum == a]) == y[a])


def add_colocated_memory(model: cp_model.CpModel, x: Vars, cands: Candidates, budget_bytes: int, units: Units) -> None:
    """Every GPU holds every module, and every moment of the step must fit: for each phase p,
    sum_m sum_c x[m,c] * memory_c[p] <= usable - overhead (memory rounded up, the budget down)."""
    num_phases = len(next(c for cs in cands.by_module.values() for c in cs).phase_bytes)
    for p in range(num_phases):
        model.add(weighted(x, cands, lambda c: units.memory(c.phase_bytes[p])) <= budget_bytes // units.bytes)


def add_disjoint_gpus(model: cp_model.CpModel, x: Vars, cands: Candidates, num_gpus: int) -> None:
    """The groups tile the cluster: sum_m sum_c x[m,c] * gpus_c == N; with one bool z[g] per split (encoder on
    g GPUs, LLM on N - g): sum_{c in C_enc, gpus_c = g} x == z[g] == sum_{c in C_llm, gpus_c = N - g} x, which
    tightens the relaxation (a two-module model is what disjoint placement supports)."""
    model.add(weighted(x, cands, lambda c: c.gpus) == num_gpus)
    encoder, llm = list(cands.by_module)
    splits = sorted({c.gpus for c in cands.by_module[encoder]})
    z = {g: model.new_bool_var(f"split_{g}") for g in splits}
    model.add_exactly_one(z.values())
    for module, size in ((encoder, lambda g: g), (llm, lambda g: num_gpus - g)):
        for g in splits:
            chosen = [x[module, i] for i, c in enumerate(cands.by_module[module]) if c.gpus == size(g)]
            model.add(cp_model.LinearExpr.sum(chosen) == z[g])


def add_max_over_modules(model: cp_model.CpModel, x: Vars, cands: Candidates, coefficient: Coefficient, name: str) -> cp_model.IntVar:
    """A variable t with t >= sum_c x[m,c] * coefficient_c for every module m (the objective pushes it down to the
    max)."""
    top = max(coefficient(c) for cs in cands.by_module.values() for c in cs)
    t = model.new_int_var(0, top, name)
    for m in cands.by_module:
        model.add(t >= weighted(x, cands, coefficient, [m]))
    return t


def add_longest_path(model: cp_model.CpModel, x: Vars, cands: Candidates, units: Units) -> cp_model.IntVar:
    """A variable p with p >= sum_m sum_c x[m,c] * path_c[k] for every critical path k of the disjoint pipeline
    (``planner.cost.pipeline``; the objective pushes it down to the longest)."""
    top = sum(max(units.time(max(c.path_ns)) for c in cs) for cs in cands.by_module.values())
    p = model.new_int_var(0, top, "pipeline")
    for k in range(NUM_PATHS):
        pairs = [(x[m, i], units.time(c.path_ns[k])) for m, cs in cands.by_module.items() for i, c in enumerate(cs)]
        model.add(p >= cp_model.LinearExpr.weighted_sum([v for v, _ in pairs], [w for _, w in pairs]))
    return p


def add_pipeline_link(model: cp_model.CpModel, x: Vars, cands: Candidates) -> None:
    """Encoders are costed for the LLM they feed: for every encoder m,
    sum_{c in C_m, c pipelined} x[m,c] == sum_{c in C_llm, pp_c > 1} x[llm,c]."""
    llm = [x["llm", i] for i, c in enumerate(cands.by_module.get("llm", [])) if c.pipelined]
    if not any(c.pipelined for cs in cands.by_module.values() for c in cs):
        return
    for m, cs in cands.by_module.items():
        if m != "llm":
            model.add(cp_model.LinearExpr.sum([x[m, i] for i, c in enumerate(cs) if c.pipelined])
                      == cp_model.LinearExpr.sum(llm))


def add_no_good_cuts(model: cp_model.CpModel, x: Vars, cuts: list[Mapping[str, int]]) -> None:
    """Exclude plans already listed: for each, sum_m x[m, chosen_m] <= M - 1."""
    for cut in cuts:
        model.add(cp_model.LinearExpr.sum([x[m, i] for m, i in cut.items()]) <= len(cut) - 1)


# --- Model ------------------------------------------------------------------------------------------------------


def build_model(
    cands: Candidates, num_gpus: int, memory_budget_bytes: int, cuts: list[Mapping[str, int]]
) -> tuple[cp_model.CpModel, Vars, cp_model.LinearExpr]:
    """The CP-SAT model of one placement, and its step-time expression (in ``model_units``), not yet minimised."""
    units = model_units(cands, memory_budget_bytes)
    model = cp_model.CpModel()
    x: Vars = {
        (m, i): model.new_bool_var(f"x_{m}_{i}") for m, cs in cands.by_module.items() for i in range(len(cs))
    }
    add_shared_grad_accum(model, x, cands)
    add_no_good_cuts(model, x, cuts)
    if cands.placement == "colocated":
        add_colocated_memory(model, x, cands, memory_budget_bytes, units)
        add_pipeline_link(model, x, cands)
        step = weighted(x, cands, lambda c: units.time(c.step_ns))
    else:
        add_disjoint_gpus(model, x, cands, num_gpus)
        add_pipeline_link(model, x, cands)
        pipeline = add_longest_path(model, x, cands, units)
        tail = add_max_over_modules(model, x, cands, lambda c: units.time(c.tail_ns), "tail_max")
        step = pipeline + tail
    return model, x, step


def mixed_radix_index(x: Vars, cands: Candidates) -> cp_model.LinearExpr:
    """sum_m R_m * (index chosen in m), R_m = product of the list lengths after m: unique per plan."""
    variables, weights, radix = [], [], 1
    for m in reversed(list(cands.by_module)):
        count = len(cands.by_module[m])
        variables += [x[m, i] for i in range(1, count)]
        weights += [radix * i for i in range(1, count)]
        radix *= count
    return cp_model.LinearExpr.weighted_sum(variables, weights)


def _solver(settings: SolverSettings) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = settings.time_limit_s
    solver.parameters.num_workers = settings.num_workers
    solver.parameters.random_seed = settings.seed
    return solver


def _run(model: cp_model.CpModel, settings: SolverSettings) -> tuple[cp_model.CpSolver, str]:
    """Solve; return the solver and its status name. MODEL_INVALID is a bug here, not a user error."""
    solver = _solver(settings)
    status = solver.solve(model)
    name = solver.status_name(status)
    assert status != cp_model.MODEL_INVALID, f"invalid CP-SAT model: {model.validate()}"
    return solver, name


def _chosen(solver: cp_model.CpSolver, x: Vars, cands: Candidates) -> dict[str, int]:
    return {m: next(i for i in range(len(cs)) if solver.boolean_value(x[m, i])) for m, cs in cands.by_module.items()}


def step_ns(cands: Candidates, chosen: Mapping[str, int]) -> int:
    """The step time of a choice in exact nanoseconds, by the model's formula: colocated the sum of the step terms,
    disjoint the longest critical path plus the longest tail."""
    picked = [cands.by_module[m][i] for m, i in chosen.items()]
    if cands.placement == "colocated":
        return sum(c.step_ns for c in picked)
    return max(sum(c.path_ns[k] for c in picked) for k in range(NUM_PATHS)) + max(c.tail_ns for c in picked)


def solve_one(
    cands: Candidates,
    num_gpus: int,
    memory_budget_bytes: int,
    cuts: list[Mapping[str, int]],
    settings: SolverSettings,
) -> tuple[Status, dict[str, int], int] | None:
    """Best plan not among ``cuts``: (status, module -> candidate index, exact step ns), or None if there is none.

    Raises:
        SolverTimeout: neither a plan nor a proof that none exists within the time limit.
    """
    if cands.empty:
        return None
    model, x, step = build_model(cands, num_gpus, memory_budget_bytes, cuts)
    model.minimize(step)
    solver, status = _run(model, settings)
    if status == "INFEASIBLE":
        return None
    if status == "UNKNOWN":
        raise SolverTimeout(
            f"CP-SAT found no {cands.placement} plan within {settings.time_limit_s:g} s; raise --time-limit"
        )
    chosen, best = _chosen(solver, x, cands), round(solver.objective_value)
    if status != "OPTIMAL":
        return "FEASIBLE", chosen, step_ns(cands, chosen)
    chosen = _break_ties(cands, num_gpus, memory_budget_bytes, cuts, best, chosen, settings)
    return "OPTIMAL", chosen, step_ns(cands, chosen)


def _break_ties(
    cands: Candidates,
    num_gpus: int,
    memory_budget_bytes: int,
    cuts: list[Mapping[str, int]],
    best: int,
    chosen: dict[str, int],
    settings: SolverSettings,
) -> dict[str, int]:
    """Among plans of step time ``best`` (model units), the one with the smallest mixed-radix index; ``chosen`` (of
    the same step time) when the time limit stops the search before it finds one."""
    model, x, step = build_model(cands, num_gpus, memory_budget_bytes, cuts)
    model.add(step == best)
    model.minimize(mixed_radix_index(x, cands))
    for m, i in chosen.items():
        for j in range(len(cands.by_module[m])):
            model.add_hint(x[m, j], j == i)
    solver, status = _run(model, settings)
    if status == "UNKNOWN":  # the time limit ran out before the tie-break found any plan: keep the first solve's
        return dict(chosen)
    assert status in ("OPTIMAL", "FEASIBLE"), f"tie-break lost the optimum: {status}"
    return _chosen(solver, x, cands)


def solve(
    cands: Candidates,
    num_gpus: int,
    memory_budget_bytes: int,
    *,
    top_k: int = 1,
    settings: SolverSettings = DEFAULT_SETTINGS,
) -> list[Solution]:
    """Up to ``top_k`` distinct plans of one placement, best first; [] when none fits.

    Args:
        cands: Candidates of one placement.
        num_gpus: GPUs of the cluster (disjoint groups must use exactly this many).
        memory_budget_bytes: Usable memory minus the framework overhead (colocated constraint; disjoint
            candidates are already filtered).
        top_k: How many distinct plans (no-good cuts between them).
        settings: CP-SAT parameters.

    Raises:
        SolverTimeout: the first plan could not be found within the time limit.
    """
    solutions: list[Solution] = []
    cuts: list[Mapping[str, int]] = []
    for _ in range(top_k):
        found = solve_one(cands, num_gpus, memory_budget_bytes, cuts, settings)
        if found is None:
            break
        status, chosen, step = found
        solutions.append(Solution(
            status=status, choice={m: cands.by_module[m][i] for m, i in chosen.items()}, objective_ns=step
        ))
        cuts.append(chosen)
    return solutions

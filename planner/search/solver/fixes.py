"""``--fix``: pinned degrees, checked for contradictions, and the exact strategy when everything is pinned.

``MODULE.FIELD=VALUE`` (fields ``candidates.FIX_FIELDS``) restricts that module's candidates; ``placement=...``
restricts the placements solved. Fixes that determine every field of every module name one strategy, which is
evaluated instead of solved.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from planner.search.candidates import FIX_FIELDS, Fixes
from planner.search.enumeration import PIPELINE_CHUNKS, encoder_names
from planner.problem import Problem
from planner.contract.models import ModelSpec
from planner.contract.strategy import PIPELINE_SCHEDULES, PLACEMENTS, RECOMPUTE_CHOICES, ModuleStrategy, Placement, Strategy

PLACEMENT_CHOICES = ("auto", *PLACEMENTS)
"""What ``placement`` accepts; auto solves both and keeps the faster."""


def parse_fixes(items: Iterable[str] | Mapping[str, Any], model: ModelSpec, num_gpus: int, *,
                allow_pp: bool = True) -> tuple[str | None, Fixes]:
    """``MODULE.FIELD=VALUE`` / ``placement=VALUE`` items (or a {"vision.tp": 2, ...} mapping) into
    (pinned placement or None, module -> {field: value}); ``allow_pp``: pipeline parallelism is searched (an
    unpinned pp may fill the GPUs the other degrees leave).

    Raises:
        ValueError: unknown module or field, bad value, or fixes that contradict each other, in one line.
    """
    pairs = list(items.items()) if isinstance(items, Mapping) else [_split_fix(item) for item in items]
    placement: str | None = None
    fixes: dict[str, dict[str, int | str]] = {}
    for key, raw in pairs:
        if key == "placement":
            if raw not in PLACEMENTS:
                raise ValueError(f"--fix placement={raw}: placement must be one of {', '.join(PLACEMENTS)}")
            if placement not in (None, raw):
                raise ValueError(f"contradictory --fix: placement={placement} and placement={raw}")
            placement = raw
            continue
        module, _, fieldname = key.partition(".")
        if module not in model.module_names:
            raise ValueError(f"--fix {key}: {model.name} has modules {', '.join(model.module_names)} (or placement=)")
        if fieldname not in FIX_FIELDS:
            raise ValueError(f"--fix {key}: field must be one of {', '.join(FIX_FIELDS)}")
        value = _fix_value(key, fieldname, raw)
        if fieldname == "ep" and value > 1 and not model.module(module).has_experts:
            raise ValueError(f"--fix {key}={value}: {module} of {model.name} has no mixture-of-experts layers, so "
                             "its ep is 1")
        previous = fixes.setdefault(module, {}).get(fieldname)
        if previous is not None and previous != value:
            raise ValueError(f"contradictory --fix: {key}={previous} and {key}={value}")
        fixes[module][fieldname] = value
    _check_fix_consistency(placement, fixes, num_gpus, allow_pp)
    return placement, fixes


def _split_fix(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise ValueError(f"--fix {item!r}: write MODULE.FIELD=VALUE (e.g. llm.tp=8) or placement=disjoint")
    return key.strip(), value.strip()


def _fix_value(key: str, fieldname: str, raw: Any) -> int | str:
    for name, choices in (("recompute", RECOMPUTE_CHOICES), ("pp_schedule", PIPELINE_SCHEDULES)):
        if fieldname == name:
            if raw not in choices:
                raise ValueError(f"--fix {key}={raw}: {name} must be one of {', '.join(choices)}")
            return raw
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"--fix {key}={raw}: {fieldname} must be a whole number") from None
    lowest = 0 if fieldname == "zero" else 1
    if value < lowest or (fieldname == "zero" and value > 3):
        allowed = "0, 1, 2 or 3" if fieldname == "zero" else ">= 1"
        raise ValueError(f"--fix {key}={raw}: {fieldname} must be {allowed}")
    return value


def _check_fix_consistency(placement: str | None, fixes: Fixes, num_gpus: int, allow_pp: bool) -> None:
    """Contradictions visible without costing: grad_accum differs between modules; pinned degrees that do not
    multiply to a pinned GPU count; colocated modules pinned to fewer GPUs than the cluster; disjoint groups
    pinned to more GPUs than there are."""
    accums = {m: f["grad_accum"] for m, f in fixes.items() if "grad_accum" in f}
    if len(set(accums.values())) > 1:
        listed = " and ".join(f"{m}.grad_accum={a}" for m, a in accums.items())
        raise ValueError(f"contradictory --fix: {listed} (all modules share one grad_accum)")
    for m, f in fixes.items():
        grid = [f[k] for k in ("dp", "tp", "sp", "cp", "pp") if k in f]
        gpus = f.get("gpus", num_gpus if placement == "colocated" else None)
        complete = all(k in f for k in ("dp", "tp", "sp", "cp")) and ("pp" in f or not allow_pp)
        if gpus is not None and complete and math.prod(grid) != gpus:
            raise ValueError(f"contradictory --fix: {m}.{'pp*' if 'pp' in f else ''}dp*tp*sp*cp = {math.prod(grid)} "
                             f"but {m} has {gpus} GPUs")
        if gpus is not None and math.prod(grid) and gpus % math.prod(grid):
            raise ValueError(f"contradictory --fix: {m} degrees {'*'.join(map(str, grid))} do not divide its {gpus} GPUs")
        if "gpus" in f and f["gpus"] > num_gpus:
            raise ValueError(f"--fix {m}.gpus={f['gpus']}: the cluster has {num_gpus} GPUs")
        if placement == "colocated" and "gpus" in f and f["gpus"] != num_gpus:
            raise ValueError(f"contradictory --fix: placement=colocated spans all {num_gpus} GPUs but {m}.gpus={f['gpus']}")
    for m, f in fixes.items():
        if m != "llm" and (f.get("pp", 1) > 1 or f.get("virtual_stages", 1) > 1 or "pp_schedule" in f):
            raise ValueError(f"--fix {m}.pp / {m}.virtual_stages / {m}.pp_schedule: pipeline parallelism is planned "
                             "for the LLM only")
        if f.get("virtual_stages", 1) > 1 and f.get("pp") == 1:
            raise ValueError(f"contradictory --fix: {m}.virtual_stages={f['virtual_stages']} needs pp > 1")
        interleaved = f.get("pp_schedule", "1f1b") != "1f1b"
        chunks = f.get("virtual_stages", PIPELINE_CHUNKS[-1] if interleaved else 1)
        if "pp_schedule" in f and (interleaved != (chunks > 1) or (interleaved and f.get("pp") == 1)):
            raise ValueError(f"contradictory --fix: {m}.pp_schedule={f['pp_schedule']} runs "
                             f"{'virtual_stages >= 2 with pp > 1' if interleaved else 'virtual_stages=1'}")
    pinned = [f["gpus"] for f in fixes.values() if "gpus" in f]
    if placement == "disjoint" and sum(pinned) > num_gpus:
        raise ValueError(f"contradictory --fix: disjoint groups pinned to {sum(pinned)} GPUs, the cluster has {num_gpus}")


def placements_to_solve(problem: Problem, requested: str, pinned: str | None, fixes: Fixes | None = None
                        ) -> list[Placement]:
    """Placements to solve: the pinned or requested one, or both for auto (disjoint only with one encoder)."""
    if requested not in PLACEMENT_CHOICES:
        raise ValueError(f"--placement must be one of {', '.join(PLACEMENT_CHOICES)}, got {requested!r}")
    if pinned and requested not in ("auto", pinned):
        raise ValueError(f"contradictory: --placement {requested} and --fix placement={pinned}")
    choice = pinned or requested
    chunked = [(m, field) for m, f in (fixes or {}).items() for field in ("virtual_stages", "pp_schedule")
               if f.get(field, 1) not in (1, "1f1b") and "pp" not in f]
    if chunked and not problem.allow_pp:
        module, field = chunked[0]
        raise ValueError(f"--fix {module}.{field} needs pipeline parallelism: drop --no-pp or add --fix {module}.pp=N")
    if choice != "auto":
        return [choice]
    one_encoder = len(encoder_names(problem.model)) == 1 and problem.num_gpus >= 2
    return ["colocated", "disjoint"] if one_encoder else ["colocated"]


def fixed_text(pinned: str | None, fixes: Fixes) -> dict[str, str]:
    """The fixes as the plan file records them: {"llm.tp": "8", "placement": "disjoint"}."""
    text = {f"{m}.{k}": str(v) for m, f in fixes.items() for k, v in f.items()}
    if pinned:
        text["placement"] = pinned
    return dict(sorted(text.items()))


def pinned_strategy(problem: Problem, placement: str, pinned: str | None, fixes: Fixes) -> Strategy | None:
    """The one strategy the parsed fixes (``parse_fixes``) leave when they pin every field of every module
    (grad_accum may follow from the batch; the placement from the GPU counts), else None."""
    modules = {m: _only_strategy(problem, fixes.get(m, {})) for m in problem.model.module_names}
    if any(s is None for s in modules.values()):
        return None
    gpus = [s.gpus for s in modules.values()]
    total = {"colocated": max(gpus) if len(set(gpus)) == 1 else None, "disjoint": sum(gpus)}
    exact = [p for p in placements_to_solve(problem, placement, pinned, fixes) if total[p] == problem.num_gpus]
    if len(exact) != 1:
        return None
    for m, f in fixes.items():
        if "gpus" in f and f["gpus"] != modules[m].gpus:
            raise ValueError(f"contradictory --fix: {m}.gpus={f['gpus']} but its degrees use {modules[m].gpus} GPUs")
    try:
        return Strategy(placement=exact[0], modules=modules, precision=problem.precision)
    except ValueError as e:
        raise ValueError(f"contradictory --fix: {e}") from None


def _only_strategy(problem: Problem, fixed: Mapping[str, Any]) -> ModuleStrategy | None:
    """The module's strategy when ``fixed`` determines every field (grad_accum may follow from the batch; pp, ep and
    virtual_stages are 1 unless pinned, virtual_stages the searched 2 with a pinned interleaved schedule)."""
    needed = ("dp", "tp", "sp", "cp", "zero", "recompute", "micro_batch")
    if not all(k in fixed for k in needed):
        return None
    per_step = fixed["dp"] * fixed["micro_batch"]
    batch = problem.workload.global_batch
    ga = fixed.get("grad_accum", batch // per_step if batch % per_step == 0 else None)
    if ga is None or per_step * ga != batch:
        raise ValueError(f"contradictory --fix: dp*micro_batch*grad_accum must equal the global batch of {batch}")
    interleaved = fixed.get("pp_schedule", "1f1b") != "1f1b"
    chunks = fixed.get("virtual_stages", PIPELINE_CHUNKS[-1] if interleaved else 1)
    try:
        return ModuleStrategy(grad_accum=ga, pp=fixed.get("pp", 1), ep=fixed.get("ep", 1), virtual_stages=chunks,
                              pp_schedule=fixed.get("pp_schedule", "interleaved_1f1b" if chunks > 1 else "1f1b"),
                              **{k: fixed[k] for k in needed})
    except ValueError as e:
        raise ValueError(f"contradictory --fix: {e}") from None

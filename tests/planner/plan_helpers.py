"""Shared helpers of the planner tests: small problems and a brute-force optimum to cross-check CP-SAT."""

from __future__ import annotations

from dataclasses import replace

import functools
import itertools

from planner.catalog import get_model
from planner.cost import DEFAULT_ASSUMPTIONS, check_strategy
from planner.cost import module_cost
from planner.cost.estimate import combine, step_time_s
from planner.dataset import DatasetHistogram, pack_dataset, sample_tokens
from planner.search.enumeration import divisors
from planner.contract.hardware import get_device, make_cluster
from planner.problem import Problem
from planner.contract.strategy import RECOMPUTE_CHOICES, ModuleStrategy, Strategy
from planner.contract.units import GIB
from planner.contract.workload import Workload, packed_workload


def problem(
    model: str = "qwen2.5-vl-tiny",
    gpus: int = 4,
    *,
    device: str = "cpu",
    memory_gib: float | None = None,
    batch: int = 4,
    image: int = 224,
    text: int = 64,
    precision: str = "bf16_mixed",
    overhead_gib: float | None = None,
    allow_ring_cp: bool = False,
    allow_pp: bool = False,
    packed: bool = False,
    gpus_per_node: int | None = None,
) -> Problem:
    """A small problem; ``memory_gib`` shrinks the device so that the memory limit binds; ``packed``: ``batch``
    packs of a mixed-resolution dataset (images ``image`` / 2 to 2 * ``image`` px, ``text`` tokens each) instead
    of one sample shape; ``gpus_per_node`` overrides the device's."""
    spec = get_device(device)
    if memory_gib is not None:
        spec = replace(spec, memory_bytes=int(memory_gib * GIB))
    assumptions = DEFAULT_ASSUMPTIONS
    if overhead_gib is not None:
        assumptions = replace(assumptions, framework_overhead_bytes=int(overhead_gib * GIB))
    return Problem(
        model=get_model(model),
        cluster=make_cluster(spec, gpus, gpus_per_node),
        workload=_packed(get_model(model), image, text, batch) if packed else
        Workload(image_sizes=((image, image),), text_tokens=text, global_batch=batch),
        precision=precision,
        assumptions=assumptions,
        allow_ring_cp=allow_ring_cp,
        allow_pp=allow_pp,
    )


def _packed(model, image: int, text: int, packs: int) -> Workload:
    sides = (image // 2, image, 2 * image)
    histogram = DatasetHistogram(source="test", text_tokens="given", skipped={},
                                 shapes=tuple((6 // (i + 1), text, ((s, s),), ()) for i, s in enumerate(sides)))
    tokens = sample_tokens(histogram, model)
    return packed_workload(pack_dataset(tokens, model, int(tokens.llm.max()) * 2).packed, packs)


def all_strategies(p: Problem, module: str, gpus: int, pp_sp: bool = False) -> list[ModuleStrategy]:
    """Every valid strategy of ``module`` on ``gpus`` GPUs: all integer grids, ZeRO 0-3, every recompute mode
    and micro-batch, filtered by ``check_strategy`` only (independent of planner.search.candidates' enumeration); ring CP
    (cp > 1) only when the problem allows it; pipeline parallelism of the LLM (every pp, 1F1B, interleaved 1F1B
    and interleaved zero-bubble with 2 chunks) when it allows that, with SP inside stages only when ``pp_sp``
    (the planner searches it when ``--fix llm.sp`` pins SP); every expert-parallel degree dividing the GPUs
    (``check_strategy`` keeps those of a module with experts that divide its experts and dp * sp)."""
    batch = p.workload.global_batch
    pipelines = [(1, "1f1b", 1)]
    if p.allow_pp and module == "llm":
        pipelines += [(pp, schedule, v) for pp in divisors(gpus) if pp > 1
                      for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2))]
    found = []
    for pp, schedule, chunks in pipelines:
        for dp in divisors(gpus // pp):
            if batch % dp:
                continue
            for ga in divisors(batch // dp):
                for tp in divisors(gpus // (pp * dp)):
                    for sp in divisors(gpus // (pp * dp * tp)):
                        if pp > 1 and sp > 1 and not pp_sp:
                            continue
                        cp = gpus // (pp * dp * tp * sp)
                        if cp > 1 and not p.allow_ring_cp:
                            continue
                        for zero, rc, ep in itertools.product(range(4), RECOMPUTE_CHOICES, divisors(gpus)):
                            s = ModuleStrategy(dp=dp, tp=tp, sp=sp, cp=cp, pp=pp, ep=ep, pp_schedule=schedule,
                                               virtual_stages=chunks, zero=zero, recompute=rc,
                                               micro_batch=batch // (dp * ga), grad_accum=ga)
                            if not check_strategy(p.model, module, s, p.cluster, p.workload):
                                found.append(s)
    return found


def brute_force(p: Problem, placement: str, llm_sp: int | None = None, pipelined: bool | None = None,
                llm_ep: int | None = None) -> tuple[float, Strategy] | None:
    """The fastest fitting strategy of ``placement`` by trying every combination with ``cost.estimate``
    (disjoint: every split of the GPUs between the encoder and the LLM); ``llm_sp``: only LLM strategies of that SP
    degree, SP inside pipeline stages included (as ``--fix llm.sp`` plans); ``pipelined``: only LLM strategies
    that are (or are not) pipelined; ``llm_ep``: only LLM strategies of that expert-parallel degree."""
    n = p.num_gpus
    encoder, llm = p.model.module_names
    splits = [(n, n)] if placement == "colocated" else [(g, n - g) for g in range(1, n)]

    num_stages = 2 if placement == "disjoint" else 1

    @functools.lru_cache(maxsize=None)
    def cost(name: str, s: ModuleStrategy, first_rank: int, feeds_pipeline: bool):
        """One module's cost with the arguments ``cost.module_costs`` gives it inside a plan, memoised: a module
        strategy is costed once, not once per partner (what ``estimate`` adds, its validity checks, is what
        ``all_strategies`` already filtered by)."""
        return module_cost(p.model, name, p.cluster, p.workload, s, placement=placement, precision=p.precision,
                           first_rank=first_rank, num_stages=num_stages,
                           stage_index=num_stages - 1 if name == "llm" else 0, feeds_pipeline=feeds_pipeline,
                           assumptions=p.assumptions)

    best = None
    for g_enc, g_llm in splits:
        llm_by_ga: dict[int, list[ModuleStrategy]] = {}
        for s in all_strategies(p, llm, g_llm, pp_sp=llm_sp is not None):
            if llm_sp in (None, s.sp) and pipelined in (None, s.pp > 1) and llm_ep in (None, s.ep):
                llm_by_ga.setdefault(s.grad_accum, []).append(s)
        for s_enc in all_strategies(p, encoder, g_enc):
            for s_llm in llm_by_ga.get(s_enc.grad_accum, []):
                strategy = Strategy(placement=placement, modules={encoder: s_enc, llm: s_llm},
                                    precision=p.precision)
                firsts = strategy.first_ranks()
                costs = {encoder: cost(encoder, s_enc, firsts[encoder], s_llm.pp > 1),
                         llm: cost(llm, s_llm, firsts[llm], False)}
                if best is not None and step_time_s(placement, costs, p.assumptions) >= best[0]:
                    continue  # combine's step time: this plan cannot be the fastest, fitting or not
                e = combine(p.model, p.cluster, p.workload, placement, costs, p.assumptions)
                if e.fits and (best is None or e.step_time_s < best[0]):
                    best = (e.step_time_s, strategy)
    return best


def with_usable_memory(p: Problem, usable_bytes: int) -> Problem:
    """``p`` on a device whose usable memory is ``usable_bytes``."""
    memory = int(usable_bytes / p.assumptions.usable_memory_fraction) + 1
    device = replace(p.cluster.device, memory_bytes=memory)
    return replace(p, cluster=replace(p.cluster, device=device))

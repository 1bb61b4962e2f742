"""The search's cheap bound on a ring context-parallel micro-batch (``ring_share_floor``) never exceeds the layer
sums it bounds (``per_micro_batch_floor``), over models, workloads, links, recomputation and calibrations: a bound
above them would leave a plan's strategies uncosted that the optimum needs."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace

import pytest
from plan_helpers import problem

from planner.cost import DEFAULT_ASSUMPTIONS, check_strategy
from planner.cost.module import per_micro_batch_floor, ring_share_floor
from planner.contract.strategy import RECOMPUTE_CHOICES, ModuleStrategy
from planner.contract.workload import Workload

CASES = {
    "dense, one image": dict(model="qwen-vl-32b", gpus=512, device="h100-80gb", batch=512, image=1344, text=512),
    "dense, long text on CPUs": dict(model="qwen2.5-vl-tiny", gpus=64, batch=64, text=4096),
    "windowless tower, large image": dict(model="qwen2-vl-7b", gpus=512, device="h100-80gb", batch=512, image=2688),
    "mixture of experts": dict(model="qwen3-vl-235b-a22b", gpus=512, device="h100-80gb", batch=512, text=8192),
    "hybrid linear attention": dict(model="qwen3.5-27b", gpus=512, device="h100-80gb", batch=512, text=8192),
    "packed dataset rows": dict(model="qwen2.5-vl-tiny", gpus=64, batch=64, text=256, packed=True),
}
VIDEO = Workload(image_sizes=(), videos=((64, 720, 1280),), text_tokens=256, global_batch=512)


def _strategies(p, module):
    for tp, sp, cp, mb, recompute in itertools.product((1, 2, 4), (1, 2), (2, 3, 8, 32), (1, 4), RECOMPUTE_CHOICES):
        s = ModuleStrategy(dp=p.workload.global_batch // mb, tp=tp, sp=sp, cp=cp, micro_batch=mb,
                           recompute=recompute, zero=1)
        if not check_strategy(p.model, module, s, replace(p.cluster, num_devices=10 ** 6), p.workload):
            yield s


@pytest.mark.parametrize("case", list(CASES) + ["video"])
def test_the_ring_share_bound_is_below_the_layer_sums(case):
    p = problem(**CASES.get(case, CASES["dense, one image"]))
    if case == "video":
        p = replace(p, workload=VIDEO)
    calibrations = [DEFAULT_ASSUMPTIONS,
                    replace(DEFAULT_ASSUMPTIONS, vision_compute_scale=0.4, llm_compute_scale=0.4, cp_comm_overlap=1.0),
                    replace(DEFAULT_ASSUMPTIONS, vision_compute_scale=2.5, llm_compute_scale=2.5, cp_comm_overlap=0.0)]
    ratios = []
    for module in ("vision", "llm"):
        for s, first_rank, assumptions in itertools.product(list(_strategies(p, module)), (0, 4), calibrations):
            args = (p.model, module, p.cluster, p.workload, s)
            exact, _ = per_micro_batch_floor(*args, first_rank=first_rank, assumptions=assumptions)
            rough = ring_share_floor(*args, first_rank=first_rank, assumptions=assumptions)
            assert 0 < rough <= exact * (1 + 1e-12), (module, s.describe(), first_rank, rough, exact)
            ratios.append(rough / exact)
    assert len(ratios) > 100 and statistics.median(ratios) > 0.25  # a bound, and one that prunes

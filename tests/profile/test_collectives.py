"""Collective timing between two local gloo processes."""

import pytest
import torch

from planner.profiles import (
    COLLECTIVE_OPS,
    PROFILE_SCHEMA_VERSION,
    CollectivePoint,
    Profile,
    ProfileIndex,
    Provenance,
    Spread,
)
from runtime.profile.collectives import measure_collectives, measure_group

PROV = Provenance(device_name="cpu", device_detail="test", torch_version="x", cuda_version=None, date="2026-01-01",
                  command="test", num_threads=2, dtype="float32")


@pytest.mark.slow
def test_two_process_gloo_collectives_cover_every_op_and_size():
    sizes = (1024, 65536)
    points = measure_group(2, device=torch.device("cpu"), sizes=sizes, repeats=2, warmup=1)
    assert {(p.op, p.message_bytes) for p in points} == {(op, s) for op in COLLECTIVE_OPS for s in sizes}
    for p in points:
        assert p.backend == "gloo" and p.group_size == 2 and p.time.repeats == 2
        assert 0 < p.time.min_s <= p.time.median_s <= p.time.max_s
    index = ProfileIndex(Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware="cpu", model="m", provenance=PROV,
                                 collectives=points))
    assert index.collective_time("all_reduce", 2, 1024) == next(
        p.time.median_s for p in points if p.op == "all_reduce" and p.message_bytes == 1024)
    assert index.collective_time("all_reduce", 4, 1024) is None


def test_group_sizes_already_measured_are_kept_not_remeasured():
    done = CollectivePoint(op="all_reduce", group_size=2, message_bytes=1024, backend="gloo",
                           time=Spread(median_s=1.0, min_s=1.0, max_s=1.0, repeats=1))
    assert measure_collectives(device=torch.device("cpu"), group_sizes=(2,), existing=[done]) == [done]

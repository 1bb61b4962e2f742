"""The closed loop profile -> plan -> run, reduced: two configurations, a few steps, a loose bound."""

from pathlib import Path

import pytest

from tests.benchmark_modules import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_reduced_fidelity_loop(ray_cluster, tmp_path):
    bench = load_benchmark("fidelity_cpu")
    from planner.catalog import get_model
    from planner.profiles import find_profile

    profile = find_profile("cpu", get_model(bench.MODEL).name)
    assert profile is not None, "the committed CPU profile of the fidelity model is missing"
    configs = tuple(c for c in bench.CONFIGS if c.name in ("1w colocated mb2", "2w disjoint mb1"))
    # 4 steps: the median of the 3 after the warm-up, so that one step slowed by a burst of the other test worker's
    # processes does not decide (one suite run measured the disjoint plan's 2 steps at 3.8 s mean, 1.08 s alone)
    results, _, _ = bench.fidelity(configs, steps=4, workdir=tmp_path, profile=profile)
    assert [r.name for r in results] == [c.name for c in configs]
    for i, (r, config) in enumerate(zip(results, configs)):
        # Loose: this machine is shared, so only a broken loop (wrong units, a module not costed, a plan not run
        # as planned) lands outside 4x. Contention only adds time: a configuration outside is measured once more
        # and the faster measurement kept (one suite run measured the disjoint plan's median step at 3.4 s, 1.0 s
        # alone, while the other test worker's processes held the cores); a broken loop is outside both times.
        if not 0.25 < r.predicted_s / r.measured_s < 4:
            (again,), _, _ = bench.fidelity((config,), steps=4, workdir=tmp_path / f"again{i}", profile=profile)
            r = min(r, again, key=lambda result: result.measured_s)
        assert 0.25 < r.predicted_s / r.measured_s < 4, r
    assert "median |error|" in bench.format_table(results, None)


def test_another_processor_gets_its_own_profile_file():
    bench = load_benchmark("fidelity_cpu")
    from planner.profiles import load_profile

    committed = ROOT / "profiles" / "cpu" / "qwen2.5-vl-cpu-small.json"
    measured_on = load_profile(committed).provenance.device_detail.rsplit(" (", 1)[0]
    assert bench.profile_for_this_machine(measured_on) == committed
    other = bench.profile_for_this_machine("AMD EPYC 7B13 64-Core Processor")
    assert other == committed.with_name("qwen2.5-vl-cpu-small@amd-epyc-7b13-64-core-processor.json")


@pytest.mark.slow
def test_calibrating_on_three_measured_runs_predicts_the_others(tmp_path):
    """The committed fidelity results (measured on the machine of their profile): calibrate the named assumptions on
    the three ``CALIBRATION_CONFIGS``, then every other configuration, held-out ones included, is predicted within
    the held-out targets (median |error| <= 10 %, max <= 20 %)."""
    import json
    import statistics

    bench = load_benchmark("fidelity_cpu")
    rows = json.loads((ROOT / "benchmarks" / "results" / "fidelity_cpu.json").read_text())
    profile = ROOT / rows[0]["profile"]
    configs = {c.name: c for c in bench.CONFIGS}
    plans = [bench.make_plan(configs[r["name"]], profile, tmp_path / f"plan{i}.json") for i, r in enumerate(rows)]
    results = [bench.Result(name=r["name"], strategy="", predicted_s=r["predicted_s"], measured_s=r["measured_s"],
                            held_out=r["held_out"]) for r in rows]
    _, on_three = bench.calibrated_errors(results, plans, profile)
    errors = sorted(abs(e) for e in on_three if e is not None)
    raw = sorted(abs(r.error) for r, e in zip(results, on_three) if e is not None)
    assert len(errors) == len(rows) - 3
    assert errors[len(errors) // 2] <= bench.TARGET_MEDIAN and errors[-1] <= bench.TARGET_MAX_HELD_OUT, errors
    assert statistics.median(errors) < statistics.median(raw), (errors, raw)  # the calibration helps

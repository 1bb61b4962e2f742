"""--profile and the automatic profile lookup reach the cost model through planner.profiles."""

import pytest

from planner import profiles
from planner.api import ClusterInputs, WorkloadInputs, plan
from planner.profiles import CalibratedRun, Calibration, LayerPoint, Profile, Provenance, Spread, save_profile

TINY = "qwen2.5-vl-tiny"


def _spread(seconds):
    return Spread(median_s=seconds, min_s=seconds, max_s=seconds, repeats=3)


def _profile(seconds, calibration=None):
    """Every decoder layer of the tiny model measured at ``seconds`` forward, 2x backward, on TP/SP 1."""
    points = [
        LayerPoint(module="llm", layer="decoder_layer", tp=1, sp=1, seq_len=seq, micro_batch=mb,
                   forward=_spread(seconds * mb), backward=_spread(2 * seconds * mb), recompute=_spread(seconds * mb),
                   forward_flops=1e9, backward_flops=2e9, saved_activation_bytes=1000, peak_bytes=2000)
        for seq in (64, 8192) for mb in (1, 4)
    ]
    provenance = Provenance(device_name="cpu", device_detail="test", torch_version="-", cuda_version=None,
                            date="2026-01-01T00:00:00", command="test", num_threads=1, dtype="float32")
    return Profile(schema_version=profiles.PROFILE_SCHEMA_VERSION, hardware="cpu", model=TINY,
                   provenance=provenance, layers=points, calibration=calibration)


def _fixed(profile: str | None = "auto"):
    fix = ["llm.dp=2", "llm.tp=1", "llm.sp=1", "llm.cp=1", "llm.zero=0", "llm.recompute=none",
           "llm.micro_batch=1", "vision.dp=2", "vision.tp=1", "vision.sp=1", "vision.cp=1", "vision.zero=0",
           "vision.recompute=none", "vision.micro_batch=1"]
    return plan(TINY, ClusterInputs(gpus=2, gpu="cpu", profile=profile), workload=WorkloadInputs(global_batch=4),
                fix=fix)


def test_profile_file_supplies_measured_layer_times(tmp_path):
    path = tmp_path / "tiny.json"
    save_profile(_profile(1.0), path)
    measured = _fixed(profile=str(path))
    analytical = _fixed(profile=None)
    llm = measured.module("llm").predicted
    assert llm.sources["decoder_layer.time"] == "measured"
    assert analytical.module("llm").predicted.sources["decoder_layer.time"] == "analytical"
    # 4 decoder layers x (1 s forward + 2 s backward) per micro-batch, 2 micro-batches per step
    assert llm.time_s.forward == pytest.approx(2 * 4 * 1.0, rel=0.01)
    assert llm.time_s.backward == pytest.approx(2 * 4 * 2.0, rel=0.01)


def test_fp32_profile_makes_model_states_fp32(tmp_path):
    from planner.catalog import get_model

    path = tmp_path / "tiny.json"
    save_profile(_profile(1.0), path)
    params = get_model(TINY).module("llm").num_params
    gib = 1024**3
    # the CPU runtime trains in fp32: 4 B weights, 4 B gradients, 8 B of Adam moments per parameter (ZeRO-0)
    fp32 = _fixed(profile=str(path)).module("llm").predicted.memory_gib
    assert (fp32.weights, fp32.gradients, fp32.optimizer) == pytest.approx((4 * params / gib, 4 * params / gib,
                                                                            8 * params / gib))
    bf16 = _fixed(profile=None).module("llm").predicted.memory_gib
    assert bf16.gradients == pytest.approx(2 * params / gib)


def test_profile_is_found_automatically(tmp_path, monkeypatch):
    path = tmp_path / "tiny.json"
    save_profile(_profile(0.5), path)
    monkeypatch.setattr(profiles, "find_profile", lambda device, model: path if (device, model) == ("cpu", TINY)
                        else None)
    assert _fixed().module("llm").predicted.sources["decoder_layer.time"] == "measured"
    assert _fixed(profile=None).module("llm").predicted.sources["decoder_layer.time"] == "analytical"


def _calibration(**values):
    run = CalibratedRun(name="run", measured_s=1.0, before_s=1.5, after_s=1.0)
    return Calibration(values=values, runs=[run], rms_error_before=0.5, rms_error_after=0.0,
                       date="2026-12-02T00:00:00", sources=["test"])


def test_a_calibrated_profile_costs_with_its_fitted_assumptions(tmp_path):
    paths = {name: tmp_path / f"{name}.json" for name in ("raw", "overhead", "scaled")}
    save_profile(_profile(1.0), paths["raw"])
    save_profile(_profile(1.0, _calibration(step_overhead_s=1.0)), paths["overhead"])
    save_profile(_profile(1.0, _calibration(measured_time_scale=2.0)), paths["scaled"])
    raw, overhead, scaled = (_fixed(profile=str(path)) for path in paths.values())
    assert overhead.predicted.step_time_s == pytest.approx(raw.predicted.step_time_s + 1.0)
    assert overhead.predicted.tokens_per_s == pytest.approx(raw.predicted.tokens_per_s * raw.predicted.step_time_s
                                                            / overhead.predicted.step_time_s)
    forward = [p.module("llm").predicted.time_s.forward for p in (raw, scaled)]
    assert forward[1] == pytest.approx(2 * forward[0], rel=0.01)  # the analytical embedding and head are not scaled
    assert raw.predicted.calibration is None
    assert "step_overhead_s=1" in overhead.predicted.calibration and "1 measured run" in overhead.predicted.calibration


def test_unreadable_profile_is_a_one_line_error(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        plan(TINY, ClusterInputs(gpus=2, gpu="cpu", profile=str(path)))


def test_a_profiled_cost_does_not_depend_on_what_was_costed_before():
    """With a measured profile the layer sums are memoised too (by the profile, and by whether its collective curves
    cover the strategy's groups): a strategy costs the same alone as after others of the same sharding."""
    from dataclasses import replace

    from planner.cost import module_cost
    from planner.contract.strategy import ModuleStrategy
    from planner.inputs import ClusterInputs
    from planner.problem import make_problem

    p = make_problem(TINY, ClusterInputs(gpus=8, gpu="cpu"))
    assert p.layer_costs is not None
    strategies = [ModuleStrategy(dp=dp, tp=2, micro_batch=4, grad_accum=8 // dp) for dp in (1, 2, 4)]

    def cost(strategy, assumptions):  # a new assumptions object: a memo of its own
        return module_cost(p.model, "llm", p.cluster, p.workload, strategy, placement="colocated",
                           precision=p.precision, first_rank=0, assumptions=assumptions, layer_costs=p.layer_costs)

    alone = [cost(s, replace(p.assumptions)) for s in strategies]
    shared = replace(p.assumptions)
    assert [cost(s, shared) for s in strategies] == alone
    assert len({c.sources.get("collectives") for c in alone}) == 2  # one group the curves cover, one they do not

"""--profile and the automatic profile lookup reach the cost model through planner.profiles."""

import pytest

from planner import profiles
from planner.api import plan
from planner.profiles import Calibration, LayerPoint, Profile, Provenance, Spread, save_profile

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


def _fixed(**kw):
    fix = ["llm.dp=2", "llm.tp=1", "llm.sp=1", "llm.cp=1", "llm.zero=0", "llm.recompute=none",
           "llm.micro_batch=1", "vision.dp=2", "vision.tp=1", "vision.sp=1", "vision.cp=1", "vision.zero=0",
           "vision.recompute=none", "vision.micro_batch=1"]
    return plan(TINY, 2, gpu="cpu", global_batch=4, fix=fix, **kw)


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


def test_calibration_scales_the_reported_step_time(tmp_path):
    raw_path, cal_path = tmp_path / "raw.json", tmp_path / "cal.json"
    save_profile(_profile(1.0), raw_path)
    calibration = Calibration(scale=2.0, overhead_s=1.0, num_samples=3, rms_error_before=0.5, rms_error_after=0.1,
                              sources=["test"])
    save_profile(_profile(1.0, calibration), cal_path)
    raw, cal = _fixed(profile=str(raw_path)), _fixed(profile=str(cal_path))
    assert cal.predicted.step_time_s == pytest.approx(2.0 * raw.predicted.step_time_s + 1.0)
    assert cal.predicted.tokens_per_s == pytest.approx(raw.predicted.tokens_per_s * raw.predicted.step_time_s
                                                       / cal.predicted.step_time_s)
    assert cal.module("llm").predicted.sources["step_time"] == "calibrated"


def test_unreadable_profile_is_a_one_line_error(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        plan(TINY, 2, gpu="cpu", profile=str(path))

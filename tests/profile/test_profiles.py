"""Profile schema, reader, interpolation and refit: pure Python, hand-calculated expectations."""

import json
import math
import subprocess
import sys

import pytest

from planner.contract.hardware import DeviceSpec
from planner.profiles import (
    PROFILE_SCHEMA_VERSION,
    CollectivePoint,
    DeviceMeasurements,
    LayerPoint,
    MatmulPoint,
    Profile,
    ProfileIndex,
    Provenance,
    Spread,
    device_from_profile,
    find_profile,
    fit_alpha_beta,
    interp_collective,
    interp_grid,
    interp_loglog,
    load_profile,
    relative_rms,
    save_profile,
)

PROV = Provenance(device_name="cpu", device_detail="test", torch_version="x", cuda_version=None, date="2026-01-01",
                  command="test", num_threads=2, dtype="float32")


def spread(t: float) -> Spread:
    return Spread(median_s=t, min_s=t, max_s=t, repeats=1)


def layer_point(seq: int, mb: int, fwd: float, tp: int = 1) -> LayerPoint:
    return LayerPoint(module="llm", layer="decoder_layer", tp=tp, sp=1, seq_len=seq, micro_batch=mb,
                      forward=spread(fwd), backward=spread(2 * fwd), recompute=spread(fwd), forward_flops=1e9 * fwd,
                      backward_flops=2e9 * fwd, saved_activation_bytes=int(1000 * fwd), peak_bytes=int(3000 * fwd))


def profile(**fields) -> Profile:
    return Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware="cpu", model="m", provenance=PROV, **fields)


def test_import_without_torch():
    code = "import sys\nfor n in ('torch','ray','transformers'):\n    sys.modules[n] = None\nimport planner.profiles\n"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_loglog_exact_on_power_laws():
    # y = 3 x^2 sampled at 100, 200, 400: interpolation at 300 is 3 * 9e4 = 2.7e5; extrapolation at 800 is 1.92e6.
    xs, ys = [100, 200, 400], [3e4, 1.2e5, 4.8e5]
    assert interp_loglog(xs, ys, 300) == pytest.approx(2.7e5)
    assert interp_loglog(xs, ys, 800) == pytest.approx(1.92e6)
    assert interp_loglog(xs, ys, 50) == pytest.approx(7.5e3)
    # One point scales linearly.
    assert interp_loglog([10], [4.0], 25) == pytest.approx(10.0)


def test_loglog_extrapolation_exponent_is_clamped():
    # A noisy end segment (exponent 10, or -1) extrapolates quadratically upward / linearly at least.
    assert interp_loglog([1, 2], [1.0, 1024.0], 4) == pytest.approx(1024.0 * 4)
    assert interp_loglog([1, 2], [2.0, 1.0], 4) == pytest.approx(1.0 * 2)
    # Downward: never growing as x shrinks (exponent >= 0).
    assert interp_loglog([2, 4], [2.0, 1.0], 1) == pytest.approx(2.0)


def test_grid_interpolates_seq_then_micro_batch():
    # f(s, b) = s * b measured at s in {100, 200}, b in {1, 2}; at (150, 1.5) the answer is 225.
    pts = {(100, 1): 100.0, (200, 1): 200.0, (100, 2): 200.0, (200, 2): 400.0}
    assert interp_grid(pts, 150, 1.5) == pytest.approx(225.0)
    assert interp_grid(pts, 400, 4) == pytest.approx(1600.0)


def test_index_layer_cost_marks_exact_points():
    idx = ProfileIndex(profile(layers=[layer_point(128, 1, 1.0), layer_point(256, 1, 2.0)]))
    exact = idx.layer_cost("llm", "decoder_layer", tp=1, sp=1, seq_len=128, micro_batch=1)
    assert exact.exact and exact.forward_s == 1.0 and exact.backward_s == 2.0
    mid = idx.layer_cost("llm", "decoder_layer", tp=1, sp=1, seq_len=192, micro_batch=1)
    assert not mid.exact and mid.forward_s == pytest.approx(1.5)  # slope 1 between (128,1) and (256,2)
    assert idx.layer_cost("llm", "decoder_layer", tp=2, sp=1, seq_len=128, micro_batch=1) is None


def test_index_leaves_sequences_far_beyond_the_measured_ones_to_the_analytical_model():
    """Measured up to 256 tokens: 4 x 256 is still extrapolated from the profile, one token more is not (None)."""
    idx = ProfileIndex(profile(layers=[layer_point(128, 1, 1.0), layer_point(256, 1, 2.0)]))
    assert idx.layer_cost("llm", "decoder_layer", tp=1, sp=1, seq_len=4 * 256, micro_batch=1).forward_s == 8.0
    assert idx.layer_cost("llm", "decoder_layer", tp=1, sp=1, seq_len=4 * 256 + 1, micro_batch=1) is None


def test_collective_interpolation_and_floor():
    sizes, times = [1000, 3000], [1.0, 2.0]
    assert interp_collective(sizes, times, 2000) == pytest.approx(1.5)
    assert interp_collective(sizes, times, 10) == pytest.approx(1.0)  # latency floor
    assert interp_collective(sizes, times, 5000) == pytest.approx(3.0)  # last segment's slope


def test_alpha_beta_fit():
    # t = 1e-5 + bytes / 1e9 exactly.
    sizes = [1e3, 1e6, 1e7]
    alpha, beta = fit_alpha_beta(sizes, [1e-5 + s / 1e9 for s in sizes])
    assert alpha == pytest.approx(1e-5) and beta == pytest.approx(1e9)
    # Relative weighting: a 2x outlier at the large size barely moves the small-message latency.
    alpha, _ = fit_alpha_beta(sizes + [1e8], [1e-5 + s / 1e9 for s in sizes] + [2 * (1e-5 + 1e8 / 1e9)])
    assert alpha == pytest.approx(1e-5, rel=0.3)


def test_relative_rms_by_hand():
    assert relative_rms([1.0, 2.0], [1.5, 2.5]) == pytest.approx(math.sqrt(((0.5 / 1.5) ** 2 + (0.5 / 2.5) ** 2) / 2))


def test_old_scale_and_offset_calibrations_are_refused_in_one_line(tmp_path):
    path = tmp_path / "old.json"
    data = json.loads(profile().to_json())
    data.update(schema_version=3, calibration={"scale": 2.0, "overhead_s": 0.1})
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no longer reads"):
        load_profile(path)
    data["calibration"] = None
    path.write_text(json.dumps(data))
    assert load_profile(path).schema_version == PROFILE_SCHEMA_VERSION


def test_device_from_profile_replaces_measured_fields():
    base = DeviceSpec(name="cpu", peak_bf16_flops=1.0, memory_bytes=8, memory_bandwidth=1.0, intra_node_bandwidth=1.0,
                      intra_node_latency=1.0, inter_node_bandwidth=1.0, inter_node_latency=1.0, devices_per_node=2,
                      kernel_launch_latency=0.0, host_overlap=0.0, source="placeholder")
    sizes = [1e3, 1e6]
    p2p = [CollectivePoint(op="send_recv", group_size=2, message_bytes=int(s), time=spread(2e-6 + s / 4e9),
                           backend="gloo") for s in sizes]
    dev = DeviceMeasurements(matmul=[MatmulPoint(n=256, flops_per_s=5e10), MatmulPoint(n=512, flops_per_s=7e10)],
                             memory_bandwidth=2e10)
    spec = device_from_profile(base, profile(device=dev, collectives=p2p), intra_node_bus_efficiency=0.8)
    assert spec.peak_bf16_flops == 7e10 and spec.memory_bandwidth == 2e10
    # send/recv: t = alpha + B / (bw * 0.8) -> bw = 4e9 / 0.8.
    assert spec.intra_node_bandwidth == pytest.approx(5e9) and spec.intra_node_latency == pytest.approx(2e-6)
    assert spec.inter_node_bandwidth == 1.0 and spec.source.startswith("measured")
    # A 2-device all-reduce curve takes precedence: ring formula t = B / (bw * 0.8) + 2 alpha with alpha = 3e-6.
    ar = [CollectivePoint(op="all_reduce", group_size=2, message_bytes=int(s), time=spread(6e-6 + s / 1e9),
                          backend="gloo") for s in sizes]
    spec = device_from_profile(base, profile(collectives=p2p + ar), intra_node_bus_efficiency=0.8)
    assert spec.intra_node_bandwidth == pytest.approx(1.25e9) and spec.intra_node_latency == pytest.approx(3e-6)


def test_save_load_round_trip_and_lookup(tmp_path):
    p = profile(layers=[layer_point(256, 1, 2.0), layer_point(128, 1, 1.0)])
    path = tmp_path / "cpu" / "m.json"
    save_profile(p, path)
    assert load_profile(path) == profile(layers=[layer_point(128, 1, 1.0), layer_point(256, 1, 2.0)])
    assert find_profile("cpu", "m", root=tmp_path) == path
    assert find_profile("h100-80gb", "m", root=tmp_path) is None


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read profile"),
        ("{", "is not JSON"),
        ("[]", "has no schema_version"),
        ('{"schema_version": 99}', "schema version 99"),
        ('{"schema_version": 1, "hardware": "cpu"}', "is invalid at model"),
    ],
)
def test_load_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        load_profile(path)
    assert "\n" not in str(err.value)


def test_to_json_is_canonical():
    a = profile(layers=[layer_point(256, 1, 2.0), layer_point(128, 1, 1.0)])
    b = profile(layers=[layer_point(128, 1, 1.0), layer_point(256, 1, 2.0)])
    assert a.to_json() == b.to_json()
    assert json.loads(a.to_json())["layers"][0]["seq_len"] == 128


def test_profile_cost_source_feeds_the_cost_model():
    from planner.catalog import get_model
    from planner.cost import estimate
    from planner.contract.hardware import make_cluster
    from planner.profiles import ProfileCostSource
    from planner.contract.strategy import ModuleStrategy, Strategy
    from planner.contract.workload import Workload

    model = get_model("qwen2.5-vl-tiny")
    fwd = {"embedding": 0.001, "decoder_layer": 0.02, "final_norm": 0.002}  # lm_head left unmeasured
    points = [layer_point(seq, 1, f * seq / 128).model_copy(update={"layer": name})
              for name, f in fwd.items() for seq in (64, 256)]
    source = ProfileCostSource(profile(layers=points))
    workload = Workload(vision_tokens=256, text_tokens=64, global_batch=2)  # LLM sequence: 64 + 256/4 = 128
    ms = ModuleStrategy(dp=1, micro_batch=1, grad_accum=2)
    strategy = Strategy(placement="colocated", modules={"vision": ms, "llm": ms})
    cluster = make_cluster("cpu", 1)
    llm = estimate(model, cluster, workload, strategy, layer_costs=source).modules["llm"]
    assert llm.sources["decoder_layer.time"] == "measured" and llm.sources["lm_head.time"] == "analytical"
    # Interpolated at s=128 between 64 and 256 (linear in s): f, so per micro-batch the LLM forward is
    # 0.001 + 4 * 0.02 + 0.002 = 0.083 s measured, plus lm_head's analytical forward; 2 micro-batches.
    measured_per_mb = 0.001 + 4 * 0.02 + 0.002
    assert llm.forward_s - 2 * measured_per_mb == pytest.approx(_analytical_forward(model, cluster, workload, strategy, "lm_head"))


def _analytical_forward(model, cluster, workload, strategy, layer_name):
    """Forward seconds the analytical model gives ``layer_name`` (count x grad_accum), by costing it alone."""
    from planner.cost import estimate
    from planner.cost.layer_costs import LayerMeasurement

    class AllButOne:
        def layer_cost(self, *, layer, **kw):
            return None if layer.name == layer_name else LayerMeasurement(forward_s=0.0, backward_s=0.0, recompute_s=0.0)

    return estimate(model, cluster, workload, strategy, layer_costs=AllButOne()).modules["llm"].forward_s


def test_profile_cost_source_recompute_modes():
    from planner.catalog import get_model
    from planner.profiles import ProfileCostSource

    layer = get_model("qwen2.5-vl-tiny").module("llm").layer("decoder_layer")
    source = ProfileCostSource(profile(layers=[layer_point(128, 1, 1.0)]))
    args = dict(module="llm", layer=layer, tp=1, sp=1, cp=1, seq_len=128, tokens_per_rank=128, micro_batch=1)
    none = source.layer_cost(**args, recompute="none")
    assert (none.forward_s, none.backward_s, none.recompute_s, none.activation_bytes) == (1.0, 2.0, 0.0, 1000)
    full = source.layer_cost(**args, recompute="full")
    assert full.recompute_s == 1.0 and full.activation_bytes is None
    assert source.layer_cost(**args, recompute="selective") is None
    assert source.layer_cost(**{**args, "cp": 2}, recompute="none") is None



def test_concurrency_slowdown_scales_measured_layers():
    from planner.catalog import get_model
    from planner.profiles import ProfileCostSource, concurrency_slowdown

    dev = DeviceMeasurements(matmul=[MatmulPoint(n=256, flops_per_s=1e9)], memory_bandwidth=1e9,
                             concurrency={1: 1.0, 2: 1.5})
    p = profile(device=dev, layers=[layer_point(128, 1, 1.0)])
    assert [concurrency_slowdown(p, n) for n in (1, 2, 8)] == [1.0, 1.5, 1.5]
    assert concurrency_slowdown(profile(), 2) == 1.0
    layer = get_model("qwen2.5-vl-tiny").module("llm").layer("decoder_layer")
    cost = ProfileCostSource(p, concurrent_devices=2).layer_cost(
        module="llm", layer=layer, tp=1, sp=1, cp=1, seq_len=128, tokens_per_rank=128, micro_batch=1, recompute="full")
    assert (cost.forward_s, cost.backward_s, cost.recompute_s) == (1.5, 3.0, 1.5)
    head = get_model("qwen2.5-vl-tiny").module("llm").layer("lm_head")
    p = profile(layers=[layer_point(128, 1, 1.0).model_copy(update={"layer": "lm_head"})])
    cost = ProfileCostSource(p).layer_cost(module="llm", layer=head, tp=1, sp=1, cp=1, seq_len=128,
                                           tokens_per_rank=128, micro_batch=1, recompute="full")
    assert cost.recompute_s == 0.0 and cost.activation_bytes == 1000  # only blocks are recomputed


def test_time_statistic_min_uses_the_fastest_repeat():
    point = layer_point(128, 1, 1.0).model_copy(update={"forward": Spread(median_s=1.0, min_s=0.5, max_s=9.0, repeats=5)})
    by_median = ProfileIndex(profile(layers=[point])).layer_cost("llm", "decoder_layer", tp=1, sp=1, seq_len=128,
                                                                 micro_batch=1)
    by_min = ProfileIndex(profile(layers=[point], time_statistic="min")).layer_cost(
        "llm", "decoder_layer", tp=1, sp=1, seq_len=128, micro_batch=1)
    assert (by_median.forward_s, by_min.forward_s) == (1.0, 0.5)


def test_measured_collective_curves_replace_the_link_model():
    from planner.cost.comm import Link, all_gather_time, all_reduce_time, p2p_time, reduce_scatter_time

    def curve(op, n, per_rank_bytes):
        return {"all_reduce": 1.0, "all_gather": 2.0, "send_recv": 3.0}.get(op) if n == 2 else None

    link = Link(bandwidth=1e9, latency=0.0, curve=curve)
    assert all_reduce_time(1e6, 2, link) == 1.0 and all_gather_time(1e6, 2, link) == 2.0
    assert p2p_time(1e6, link) == 3.0
    # Not measured: the ring formulas, (n-1)/n * B / bw.
    assert reduce_scatter_time(1e6, 2, link) == pytest.approx(0.5e-3)
    assert all_reduce_time(1e6, 4, link) == pytest.approx(1.5e-3)


def test_plan_says_collectives_are_measured_when_the_profile_covers_its_groups():
    from planner.catalog import get_model
    from planner.cost import estimate
    from planner.contract.hardware import make_cluster
    from planner.profiles import ProfileCostSource
    from planner.contract.strategy import ModuleStrategy, Strategy
    from planner.contract.workload import Workload

    model = get_model("qwen2.5-vl-tiny")
    ar = [CollectivePoint(op="all_reduce", group_size=2, message_bytes=s, time=spread(0.5), backend="gloo")
          for s in (1024, 1 << 30)]
    workload = Workload(vision_tokens=256, text_tokens=64, global_batch=2)
    ms = ModuleStrategy(dp=2, micro_batch=1, grad_accum=1)
    strategy = Strategy(placement="colocated", modules={"vision": ms, "llm": ms})
    cluster = make_cluster("cpu", 2)
    measured = estimate(model, cluster, workload, strategy, layer_costs=ProfileCostSource(profile(collectives=ar)))
    plain = estimate(model, cluster, workload, strategy, layer_costs=ProfileCostSource(profile()))
    assert measured.modules["llm"].sources["collectives"] == "measured"
    assert plain.modules["llm"].sources["collectives"] == "analytical"
    assert measured.modules["llm"].dp_comm_s != plain.modules["llm"].dp_comm_s


def as_run(point: LayerPoint) -> LayerPoint:
    return point.model_copy(update={"includes_comm": True})


def test_version_1_profiles_load_as_single_process_points(tmp_path):
    path = tmp_path / "v1.json"
    data = json.loads(profile(layers=[layer_point(128, 1, 1.0)]).to_json())
    data["schema_version"] = 1
    del data["layers"][0]["includes_comm"]
    path.write_text(json.dumps(data))
    loaded = load_profile(path)
    assert loaded.schema_version == PROFILE_SCHEMA_VERSION and loaded.layers[0].includes_comm is False


def test_as_run_and_single_process_points_are_kept_apart():
    single, run = layer_point(128, 1, 1.0, tp=2), as_run(layer_point(128, 1, 3.0, tp=2))
    assert single.key != run.key
    idx = ProfileIndex(profile(layers=[single, run]))
    assert idx.layer_cost("llm", "decoder_layer", tp=2, sp=1, seq_len=128, micro_batch=1).forward_s == 1.0
    assert idx.layer_cost("llm", "decoder_layer", tp=2, sp=1, seq_len=128, micro_batch=1,
                          includes_comm=True).forward_s == 3.0


def test_profile_cost_source_prefers_as_run_points():
    from planner.catalog import get_model
    from planner.profiles import ProfileCostSource

    layer = get_model("qwen2.5-vl-tiny").module("llm").layer("decoder_layer")
    dev = DeviceMeasurements(matmul=[MatmulPoint(n=256, flops_per_s=1e9)], memory_bandwidth=1e9,
                             concurrency={1: 1.0, 2: 1.5, 4: 2.4})
    points = [layer_point(128, 1, 1.0, tp=2), as_run(layer_point(128, 1, 3.0, tp=2)), layer_point(128, 1, 1.0, tp=4)]
    args = dict(module="llm", layer=layer, sp=1, cp=1, seq_len=128, tokens_per_rank=128, micro_batch=1,
                recompute="none")

    def cost(tp, devices):
        return ProfileCostSource(profile(device=dev, layers=points), concurrent_devices=devices).layer_cost(tp=tp, **args)

    # As run on 2 processes it already holds the 2-process slowdown: 3.0 s with 2 devices busy, 3.0 * 2.4 / 1.5
    # with 4; the single-process point gets the whole slowdown and no collectives (the cost model adds them).
    assert (cost(2, 2).forward_s, cost(2, 2).includes_comm) == (3.0, True)
    assert cost(2, 4).forward_s == pytest.approx(3.0 * 2.4 / 1.5)
    assert (cost(4, 4).forward_s, cost(4, 4).includes_comm) == (2.4, False)


def test_measured_optimizer_step_replaces_the_formula():
    from planner.catalog import get_model
    from planner.cost import estimate
    from planner.contract.hardware import make_cluster
    from planner.profiles import ProfileCostSource
    from planner.contract.strategy import ModuleStrategy, Strategy
    from planner.contract.workload import Workload

    model = get_model("qwen2.5-vl-tiny")
    llm_layers = {layer.name: layer.count for layer in model.module("llm").layers}
    # optimizer medians: decoder layer 0.01 s (points disagree: the median is used), every other LLM layer 0.002 s
    points = [layer_point(seq, 1, 0.01).model_copy(update={"layer": name, "optimizer": spread(t)})
              for name in llm_layers for seq, t in ((64, 0.01 if name == "decoder_layer" else 0.002),
                                                    (256, 0.01 if name == "decoder_layer" else 0.002),
                                                    (512, 0.5 if name == "decoder_layer" else 0.002))]
    source = ProfileCostSource(profile(layers=points))
    workload = Workload(vision_tokens=256, text_tokens=64, global_batch=4)
    cluster = make_cluster("cpu", 2)

    def cost(zero: int):
        ms = ModuleStrategy(dp=2, micro_batch=1, grad_accum=2, zero=zero)
        strategy = Strategy(placement="colocated", modules={"vision": ms, "llm": ms})
        return estimate(model, cluster, workload, strategy, layer_costs=source).modules

    expected = sum(count * (0.01 if name == "decoder_layer" else 0.002) for name, count in llm_layers.items())
    z0 = cost(0)
    assert z0["llm"].optimizer_s == pytest.approx(expected) and z0["llm"].sources["optimizer"] == "measured"
    assert z0["vision"].sources["optimizer"] == "analytical"  # no vision points: the formula
    assert cost(1)["llm"].optimizer_s == pytest.approx(expected / 2)  # ZeRO-1 steps half the parameters per rank


def test_optimizer_call_cost_is_paid_once_per_module():
    from planner.catalog import get_model
    from planner.cost import estimate
    from planner.contract.hardware import make_cluster
    from planner.profiles import ProfileCostSource
    from planner.contract.strategy import ModuleStrategy, Strategy
    from planner.contract.workload import Workload

    model = get_model("qwen2.5-vl-tiny")
    llm_layers = {layer.name: layer.count for layer in model.module("llm").layers}
    # one instance in one call: 10 ms; two instances in one call: 14 ms -> 4 ms each, 6 ms fixed per call
    points = [layer_point(128, 1, 0.01).model_copy(update={"layer": name, "optimizer": spread(0.010),
                                                           "optimizer_pair": spread(0.014)}) for name in llm_layers]
    index = ProfileIndex(profile(layers=points))
    cost = index.layer_cost("llm", "decoder_layer", tp=1, sp=1, seq_len=128, micro_batch=1)
    assert (cost.optimizer_s, cost.optimizer_call_s) == (pytest.approx(0.004), pytest.approx(0.006))
    ms = ModuleStrategy(dp=2, micro_batch=1, grad_accum=1, zero=1)
    strategy = Strategy(placement="colocated", modules={"vision": ms, "llm": ms})
    llm = estimate(model, make_cluster("cpu", 2), Workload(vision_tokens=256, text_tokens=64, global_batch=2),
                   strategy, layer_costs=ProfileCostSource(profile(layers=points))).modules["llm"]
    # ZeRO-1 over 2 ranks halves every layer's share, not the call's fixed cost
    assert llm.optimizer_s == pytest.approx(sum(llm_layers.values()) * 0.004 / 2 + 0.006)

"""Bad input to ``plan`` (issue 14): each case exits 2 with exactly one ``plan: error:`` line saying what is wrong.

Files a case needs are written to a temporary folder; ``{dir}`` in its arguments names that folder.
"""

import copy
import json
import math
import re

import pytest

from planner import api
from planner.cli import main
from planner.contract.families.qwen2_5_vl_configs import QWEN2_5_VL_TINY
from planner.profiles import PROFILES_DIR
from planner.contract.schema import PlanError, load_plan
from planner.search.solver import cp_sat, explain

TINY_PROFILE = PROFILES_DIR / "cpu" / "qwen2.5-vl-tiny.json"
M32 = ["--model", "qwen-vl-32b", "--gpus", "16"]
TINY = ["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2"]


def _cluster(**fields) -> dict[str, str]:
    return {"cluster.json": json.dumps({"device": "h100-80gb", **fields})}


def _profile(change) -> dict[str, str]:
    data = json.loads(TINY_PROFILE.read_text())
    change(data)
    return {"profile.json": json.dumps(data)}


def _set_forward(value):
    return lambda data: data["layers"][3]["forward"].update(median_s=value)


TINY_CONFIG = ["--model", "{dir}/config.json", "--gpu", "cpu", "--gpus", "2"]


def _config(change) -> dict[str, str]:
    config = copy.deepcopy(QWEN2_5_VL_TINY)
    change(config)
    return {"config.json": json.dumps(config)}


NO_VISION_CONFIG = {"model_type": "qwen2_5_vl", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}

CASES = [
    # 1. unit mistakes in cluster files, and a batch no step can hold
    (M32 + ["--cluster", "{dir}/cluster.json"], _cluster(inter_node_bandwidth=25),
     "inter_node_bandwidth = 25 is outside the plausible range 1e+07 to 1e+14 bytes/s (written in GB/s or TB/s or "
     "Gb/s? 25 GB/s = 2.5e+10"),
    (M32 + ["--cluster", "{dir}/cluster.json"], _cluster(peak_bf16_flops=989),
     "peak_bf16_flops = 989 is outside the plausible range 1e+09 to 1e+17 FLOP/s (written in TFLOP/s"),
    (M32 + ["--cluster", "{dir}/cluster.json"], _cluster(memory_bandwidth=3.35),
     "memory_bandwidth = 3.35 is outside the plausible range 1e+09 to 1e+14 bytes/s"),
    (M32 + ["--cluster", "{dir}/cluster.json"], _cluster(inter_node_latency=1e6),
     "inter_node_latency = 1e+06 is outside the plausible range 0 to 0.1 seconds (written in ns? 1e+06 ns = 0.001"),
    (M32 + ["--cluster", "{dir}/cluster.json"], _cluster(intra_node_bandwidth=900),
     "intra_node_bandwidth = 900 is outside the plausible range 1e+07 to 1e+14 bytes/s"),
    (M32 + ["--cluster", "{dir}/cluster.json"], _cluster(peak_bf16_flops=1e-300),
     "peak_bf16_flops = 1e-300 is outside the plausible range 1e+09 to 1e+17 FLOP/s"),
    (M32 + ["--cluster", "{dir}/cluster.json"], _cluster(memory_bytes=80),
     "memory_bytes = 80 is outside the plausible range 2.68435e+08 to 1.75922e+13 bytes (written in GiB?"),
    (M32 + ["--global-batch", "1000000000000"], {},
     "--global-batch must be between 1 and 1,048,576, got 1000000000000"),
    # 2. NaN and infinities
    (M32 + ["--time-limit", "nan"], {}, "--time-limit must be more than 0 and at most 3600 seconds, got nan"),
    (M32 + ["--time-limit", "inf"], {}, "--time-limit must be more than 0 and at most 3600 seconds, got inf"),
    (["--model", "qwen2-audio-7b", "--gpus", "16", "--audio-seconds", "nan"], {},
     "--audio-seconds must be between 0 and 3,600, got nan"),
    (["--model", "qwen2-audio-7b", "--gpus", "16", "--audio-seconds=-inf"], {},
     "--audio-seconds must be between 0 and 3,600, got -inf"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(_set_forward(-1.0)),
     "profile.json is invalid at layers.3.forward.median_s: Input should be greater than or equal to 0"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(_set_forward(float("nan"))),
     "profile.json is invalid at layers.3.forward.median_s: Input should be a finite number"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(_set_forward(1e300)),
     "profile.json is invalid at layers.3.forward.median_s: Input should be less than or equal to 86400"),
    # 3. huge numbers
    (["--model", "qwen-vl-32b", "--gpus", "100000000000000000000"], {},
     "--gpus must be between 1 and 65,536, got 100000000000000000000"),
    (["--model", "qwen-vl-32b", "--gpus", "10000000"], {}, "--gpus must be between 1 and 65,536, got 10000000"),
    (["--model", "qwen-vl-32b", "--gpus", "65536", "--global-batch", "4", "--no-cp"], {},
     "no valid llm strategy on 65536 GPUs (no llm layout on 65536 GPUs consumes the global batch of 4); usable GPU "
     "counts nearby: 32 (or a global batch divisible by 65536)"),
    (M32 + ["--images-per-sample", "100000"], {}, "--images-per-sample must be between 1 and 256, got 100000"),
    (M32 + ["--image-size", "1344", "--image-size", "448", "--images-per-sample", "200"], {},
     "a sample may hold at most 256 images, got 400"),
    (M32 + ["--vision-tokens", "16777216"], {}, "--vision-tokens must be between 1 and 4,194,304, got 16777216"),
    (M32 + ["--image-size", "28000x28000", "--images-per-sample", "4", "--text-tokens", "9"], {},
     "a sample has 16,000,000 vision tokens, at most 4,194,304 are supported"),
    (M32 + ["--text-tokens", "10000000"], {}, "--text-tokens must be between 0 and 1,048,576, got 10000000"),
    (M32 + ["--gpus-per-node", "100000"], {}, "--gpus-per-node must be between 1 and 1,024, got 100000"),
    (M32 + ["--workers", "0"], {}, "--workers must be at least 1, got 0"),
    (M32 + ["--top-k", "1000"], {}, "--top-k must be between 1 and 20, got 1000"),
    (M32 + ["--top-k", "100000000000000000000"], {},  # once named 1e20 output files before checking the bound
     "--top-k must be between 1 and 20, got 100000000000000000000"),
    # 4. a profile of another model or device
    (M32 + ["--profile", str(TINY_PROFILE)], {},
     "was measured on cpu, the plan is for h100-80gb: give --gpu cpu, a profile of h100-80gb, or --profile none"),
    (M32 + ["--gpu", "cpu", "--profile", str(TINY_PROFILE)], {},
     "was measured for qwen2.5-vl-tiny, whose layers differ from qwen2.5-vl-32b's"),
    # 5. plans the runtime would refuse
    (M32 + ["--text-tokens", "0"], {},
     "0 text tokens cannot hold a start and end marker for each of 1 images plus one text token (--text-tokens 3 "
     "or more)"),
    (TINY + ["--frozen", "vision", "--frozen", "llm"], {}, "every module of the plan is frozen: nothing to train"),
    # 6. measured numbers off by a unit factor (issue 29), and messages that name what binds
    (TINY + ["--profile", "{dir}/profile.json"], _profile(lambda d: d["layers"][3]["forward"].update(median_s=1e-9)),
     "forward achieves 2.18e+17 FLOP/s, above 2 x the profile's measured matmul peak (1.6e+11); times are seconds"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(lambda d: d["device"].update(memory_bandwidth=11.3)),
     "memory_bandwidth = 11.3 is outside the plausible range 1e+09 to 1e+14 bytes/s (written in GB/s"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(lambda d: d["device"]["matmul"][0].update(flops_per_s=160)),
     "flops_per_s: peak_bf16_flops = 160 is outside the plausible range 1e+09 to 1e+17 FLOP/s (written in TFLOP/s or GFLOP/s"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(lambda d: d["device"].update(host_seconds_per_op=3.2)),
     "device.host_seconds_per_op = 3.2 is outside the plausible range 0 to 0.01 seconds (written in us or ns?)"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(lambda d: d["layers"][3].update(peak_bytes=2**50)),
     "bytes is more than any device holds (17,592,186,044,416): memory is in bytes"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(lambda d: d["collectives"][0]["time"].update(median_s=1e-12)),
     "is faster than any link (1e+14 bytes/s): times are seconds, message_bytes bytes"),
    (TINY + ["--profile", "{dir}/profile.json"], _profile(lambda d: d["device"]["concurrency"].update({"2": 0.001})),
     "device.concurrency[2] = 0.001 is not a slowdown factor"),
    (["--model", "qwen-vl-72b", "--gpus", "1"], {}, "the smallest GPU count that fits is 24 (--gpus 24)"),
    (["--model", "qwen-vl-72b", "--gpus", "1", "--no-cp"], {}, "the smallest GPU count that fits is 32 (--gpus 32)"),
    (["--model", "qwen-vl-72b", "--gpus", "1", "--global-batch", "1", "--fix", "llm.tp=1", "--fix", "llm.sp=1",
      "--no-cp"], {},
     "no GPU count up to 65,536 fits a global batch of 1 samples, which caps data parallelism"),
    (["--model", "qwen-vl-32b", "--gpus", "64", "--fix", "llm.pp=4", "--fix", "llm.pp_schedule=interleaved_zb",
      "--fix", "llm.zero=3"], {}, "--fix: no valid llm strategy: interleaved_zb with zero=3: torch's weight-gradient"),
    # 8. HF configs transformers' Qwen-VL modules cannot build or run (issue 29)
    (TINY_CONFIG, _config(lambda c: c["vision_config"].update(out_hidden_size=96)),
     "vision_config's merger outputs 96 features but the decoder's hidden_size is 128: they must be equal"),
    (TINY_CONFIG, _config(lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[4, 6, 7])),
     "mrope_section must be three positive integers summing to half the decoder's rotary width (16), got [4, 6, 7]"),
    (TINY_CONFIG, _config(lambda c: c["vision_config"].update(hidden_size=60, num_heads=4)),
     "vision_config: head width 15 is not a multiple of 4, which its rotary embedding needs"),
    (TINY_CONFIG, _config(lambda c: c["vision_config"].update(hidden_size=24, num_heads=4)),
     "vision_config: head width 6 is not a multiple of 4, which its rotary embedding needs"),
    (TINY_CONFIG, _config(lambda c: (c["text_config"].update(hidden_size=120, num_attention_heads=8,
                                                             num_key_value_heads=2),
                                     c["vision_config"].update(out_hidden_size=120))),
     "text_config: head width 15 is not a multiple of 2, which its rotary embedding needs"),
    (TINY_CONFIG, _config(lambda c: c["vision_config"].update(window_size=14)),
     "vision_config.window_size 14 is smaller than one merge unit (patch_size x spatial_merge_size = 28 pixels)"),
    (TINY_CONFIG, _config(lambda c: c.update(image_token_id=5000)),
     "image_token_id 5000 is not a token id of the 1,024-entry vocabulary"),
    (TINY_CONFIG, _config(lambda c: c["text_config"].update(num_hidden_layers=10**12)),
     "text_config.num_hidden_layers = 1,000,000,000,000 is above 16,777,216, the most any model has"),
    # 7. smaller ones
    (TINY + ["--profile", "{dir}/profile.json"], _profile(lambda d: d.update(schema_version="3")),
     "schema_version must be a whole number, got '3' (str)"),
    (M32 + ["--out", ""], {}, "--out needs a file path, got an empty one"),
    (M32 + ["--out", "{dir}/" + "a" * 300 + ".json"], {}, "a.json: File name too long"),
    (M32 + ["--out", "{dir}/missing/plan.json"], {}, "missing/plan.json: no folder "),
    (M32 + ["--max-seq", "--top-k", "3"], {}, "--max-seq finds one plan, the longest sequence that fits: drop --top-k"),
    (["--model", "{dir}/config.json", "--gpus", "2"], {"config.json": json.dumps(NO_VISION_CONFIG)},
     "config.json: no vision_config: a qwen2_5_vl config.json describes its encoder there"),
]


def _fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2, err
    assert err.startswith("plan: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    return err


@pytest.mark.parametrize(("argv", "files", "message"), CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input_is_one_line(argv, files, message, tmp_path, capsys):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    assert message in _fails(argv + ([] if "--out" in argv else ["--out", str(tmp_path / "plan.json")]), capsys)
    assert not (tmp_path / "plan.json").exists()


def test_infeasible_message_shows_the_real_shortfall(capsys, tmp_path):
    """The colocated message used to add each module's least memory at different grad_accums (70.3 of 73.6 GiB,
    "0.0 GiB over"): the modules share one grad_accum, pinned here to 1."""
    err = _fails(["--model", "qwen2.5-vl-32b", "--gpus", "8", "--precision", "bf16_pure", "--image-size", "2016",
                  "--global-batch", "8", "--fix", "vision.tp=8", "--fix", "llm.tp=8", "--fix", "vision.recompute=full",
                  "--fix", "llm.recompute=full", "--fix", "llm.grad_accum=1", "--out", str(tmp_path / "p.json")],
                 capsys)
    need = float(err.split("need at least ")[1].split(" GiB")[0])
    over = float(err.split("GiB per GPU (grad_accum 1), ")[1].split(" GiB over")[0])
    assert "73.6 GiB usable" in err and over > 0 and need == pytest.approx(73.6 + over, abs=0.11)


def test_top_k_checks_every_output_path_before_writing(capsys, tmp_path):
    (tmp_path / "plan-2.json").mkdir()
    err = _fails(M32 + ["--top-k", "3", "--out", str(tmp_path / "plan.json")], capsys)
    assert f"cannot write --out {tmp_path / 'plan-2.json'}: it is a folder" in err
    assert not (tmp_path / "plan.json").exists()


def test_plan_schema_version_as_a_string_is_named(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema_version": "1"}))
    with pytest.raises(PlanError, match=r"schema_version must be a whole number, got '1' \(str\); this tool reads "
                                        r"versions 1, 2, 3"):
        load_plan(path)


def test_extreme_but_valid_input_scales_the_solver_units(tmp_path, capsys):
    """The slowest plausible device, the largest memory and batch: a step of ~1e21 ns, beyond 64-bit integers. The
    solver counts coarser units and the plan is the cost model's (the reported objective is re-added exactly)."""
    cluster = tmp_path / "slow.json"
    cluster.write_text(json.dumps({"device": "cpu", "peak_bf16_flops": 1e9, "memory_bytes": 2**44,
                                   "memory_bandwidth": 1e9}))
    problem = api.make_problem("qwen2.5-vl-72b", api.ClusterInputs(gpus=1, cluster_file=str(cluster), profile=None),
                               workload=api.WorkloadInputs(global_batch=api.MAX_GLOBAL_BATCH))
    cands = explain.build_candidates(problem, "colocated")
    units = cp_sat.model_units(cands, problem.usable_bytes - problem.overhead_bytes)
    assert max(c.step_ns for cs in cands.by_module.values() for c in cs) > 2**63 and units.ns > 1
    plan = api.plan(problem)
    assert plan.solver.status == "OPTIMAL" and math.isfinite(plan.predicted.step_time_s)
    assert plan.predicted.step_time_s > 2**63 / 1e9


def test_model_units_are_nanoseconds_and_bytes_for_real_plans():
    problem = api.make_problem("qwen-vl-32b", api.ClusterInputs(gpus=16, profile=None))
    for placement in ("colocated", "disjoint"):
        cands = explain.build_candidates(problem, placement)
        assert cp_sat.model_units(cands, problem.usable_bytes) == cp_sat.Units(ns=1, bytes=1)


def test_gpu_count_searches_are_logarithmic(monkeypatch):
    """The nearby-count hint and the smallest fitting count try a few counts, not every count up to 65,536."""
    calls = {"usable": 0, "fits": 0}
    usable, fits = explain._usable, explain._fits

    def counting(name, real):
        def wrapper(*args):
            calls[name] += 1
            return real(*args)
        return wrapper

    monkeypatch.setattr(explain, "_usable", counting("usable", usable))
    monkeypatch.setattr(explain, "_fits", counting("fits", fits))
    with pytest.raises(ValueError, match="usable GPU counts nearby: 32"):
        api.plan("qwen-vl-32b", api.ClusterInputs(gpus=65536, profile=None),
                 workload=api.WorkloadInputs(global_batch=4), search=api.SearchOptions(allow_ring_cp=False))
    assert calls["usable"] <= 4
    with pytest.raises(api.Infeasible, match=r"the smallest GPU count that fits is (\d+)") as info:
        api.plan("qwen2.5-vl-72b", api.ClusterInputs(gpus=1, profile=None),
                 workload=api.WorkloadInputs(global_batch=4096), placement="colocated")
    smallest = int(str(info.value).split("--gpus ")[1].split(")")[0])
    assert smallest > 8 and calls["fits"] <= 2 * math.log2(explain.MAX_GPU_SEARCH) + 2


def test_tie_break_cut_short_keeps_the_first_solve(monkeypatch):
    """A tie-break stopped by the time limit before it finds any plan (a loaded machine, --time-limit 1) keeps the
    first solve's plan, of the same step time, instead of failing."""
    real, calls = cp_sat._run, []

    def second_solve_times_out(model, settings):
        solver, status = real(model, settings)
        calls.append(status)
        return solver, "UNKNOWN" if len(calls) == 2 else status

    monkeypatch.setattr(cp_sat, "_run", second_solve_times_out)
    problem = api.make_problem("qwen2.5-vl-tiny", api.ClusterInputs(gpus=2, gpu="cpu"))
    cands = explain.build_candidates(problem, "colocated")
    (solution,) = cp_sat.solve(cands, 2, problem.usable_bytes - problem.overhead_bytes)
    assert len(calls) == 2 and solution.status == "OPTIMAL"
    assert solution.objective_ns == cp_sat.step_ns(cands, {m: cands.by_module[m].index(c)
                                                           for m, c in solution.choice.items()})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("grad_clip_norm", 0, "training.grad_clip_norm: Input should be greater than 0"),
    ("grad_clip_norm", -1.0, "training.grad_clip_norm: Input should be greater than 0"),
    ("learning_rate", -1e-4, "training.learning_rate: Input should be greater than 0"),
    ("warmup_steps", -2, "training.warmup_steps: Input should be greater than or equal to 0"),
    ("weight_decay", -0.1, "training.weight_decay: Input should be greater than or equal to 0"),
])
def test_a_plans_training_section_that_would_train_wrongly_is_refused(field, value, message, tmp_path):
    """A zero clip norm trains with every update zeroed (the clip factor is min(1, 0 / norm)), a negative one or a
    negative learning rate flips the updates: refused when the plan is read, by both halves."""
    data = json.loads(api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=2, gpu="cpu", profile=None)).to_json())
    data["training"][field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        load_plan(path)


def test_top_k_leaves_no_earlier_runs_ranked_plan_beside_its_own(tmp_path, capsys):
    """An earlier ``--top-k 3`` wrote x-2.json and x-3.json; a run that finds one plan (every field pinned on one
    GPU) removes them, and its plan file is written whole (through a temporary file renamed into place, none left behind)."""
    for name in ("x-2.json", "x-3.json"):
        (tmp_path / name).write_text("{}")
    main(["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "1", "--global-batch", "1", "--profile", "none",
          "--fix", "vision.recompute=none", "--fix", "llm.recompute=none", "--top-k", "3",
          "--out", str(tmp_path / "x.json")])
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
    load_plan(tmp_path / "x.json")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("memory_bytes", 16, "cluster.device: memory_bytes = 16 is outside the plausible range 2.68435e+08 to "
                         "1.75922e+13 bytes (written in GiB? 16 GiB = 1.71799e+10 bytes)"),
    ("peak_bf16_flops", float("nan"), "peak_bf16_flops = nan is outside the plausible range"),
    ("intra_node_latency", 50, "intra_node_latency = 50 is outside the plausible range 0 to 0.01 seconds (written in"),
])
def test_a_plans_device_numbers_off_by_a_unit_are_refused(field, value, message, tmp_path):
    """The runtime and calibration read the plan's ``cluster.device``: a unit mistake there is refused as in a cluster
    file, with the hint."""
    data = json.loads(api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=2, gpu="cpu")).to_json())
    data["cluster"]["device"][field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=re.escape(message)):
        load_plan(path)

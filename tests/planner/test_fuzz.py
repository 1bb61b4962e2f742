"""Property-based fuzzing of ``plan`` (issue 14): random valid and invalid values of every flag, random cluster,
profile and config files. Every call ends with exit status 0, or 2 and exactly one ``plan: error:`` line -- never a
traceback -- within hypothesis' deadline and ``MAX_CPU_SECONDS``.

Seeded (``derandomize``): CI runs the same ``DEFAULT_EXAMPLES`` every time; ``DHPLAN_FUZZ_EXAMPLES=5000`` runs more.
"""

import contextlib
import io
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import main
from planner.contract.hardware import PLAUSIBLE_RANGES, get_device
from planner.contract.families.qwen2_5_vl_configs import QWEN2_5_VL_TINY
from planner.profiles import PROFILES_DIR

DEFAULT_EXAMPLES = 300
"""Examples per CI run (about 30 s on two cores: most inputs are small or rejected early)."""
DEADLINE = timedelta(seconds=60)
"""Longest one ``plan`` call may take in wall-clock time: catches a hang, generous because other work may share the
two cores (a 5 s call has been seen to take 45 s)."""
MAX_CPU_SECONDS = 20.0
"""Most CPU time one call may use, all threads together: the bound on the work itself, which load does not inflate."""
TINY_PROFILE = json.loads((PROFILES_DIR / "cpu" / "qwen2.5-vl-tiny.json").read_text())

HUGE = ["100000000000000000000", "1000000000000", "10000000", "65537"]
NOT_FINITE = ["nan", "inf", "-inf", "1e400", "NaN"]
BAD_NUMBERS = ["0", "-1", "-0.0", "abc", "", "1.5", "0x10", "  7 "]


ANY_NUMBER = st.one_of(*[st.sampled_from(NOT_FINITE)] * 3, *[st.sampled_from(HUGE + BAD_NUMBERS)] * 3,
                      st.floats(allow_nan=True, allow_infinity=True).map(repr),
                      st.integers(min_value=-10**25, max_value=10**25).map(str))
"""A value that is huge, malformed, zero, negative, NaN or infinite (or, by chance, fine)."""


def _flag(name: str, values: st.SearchStrategy, broken: bool) -> st.SearchStrategy[list[str]]:
    """``[]`` or ``[--name=value]`` (the = form keeps values such as -1 from reading as flags); ``broken``: the
    value is drawn from ``ANY_NUMBER`` instead."""
    if broken:
        return ANY_NUMBER.map(lambda v: [f"{name}={v}"])
    return st.one_of(st.just([]), values.map(lambda v: [f"{name}={v}"]))


def _cluster_value(field: str) -> st.SearchStrategy:
    bounds = PLAUSIBLE_RANGES.get(field)
    plausible = (st.floats(min_value=bounds.low, max_value=bounds.high) if bounds else st.text(min_size=1, max_size=8))
    if field in ("memory_bytes", "devices_per_node"):
        plausible = plausible.map(int)
    wild = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(["25e9", "fast", None, True]),
                     st.integers(min_value=-10, max_value=10**20))
    return st.one_of(plausible, plausible, wild)


UNIT_MISTAKES = (1e-300, 1e-12, 1e-9, 1e-6, 1e-3, 1e3, 1e6, 1e9, 1e12, 1e300)
"""Factors a cluster-file value may be off by: a unit mistake (GB/s for bytes/s, us for seconds) or a wild one."""


@st.composite
def cluster_files(draw) -> dict:
    """A catalog device with one field off by a unit factor, or random fields with random values."""
    device = draw(st.sampled_from(["h100-80gb", "cpu", "a100-80gb"]))
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(PLAUSIBLE_RANGES)))
        value = getattr(get_device(device), field) * draw(st.sampled_from(UNIT_MISTAKES))
        return {"device": device, field: value}
    fields = draw(st.lists(st.sampled_from(list(PLAUSIBLE_RANGES) + ["name", "bogus"]), max_size=3, unique=True))
    data = {"device": draw(st.sampled_from([device, "nonesuch", 7]))}
    data.update({f: draw(_cluster_value(f)) for f in fields})
    return data


@st.composite
def profile_files(draw) -> dict:
    data = json.loads(json.dumps(TINY_PROFILE))
    change = draw(st.sampled_from(["none", "time", "flops", "hardware", "model", "version", "drop"]))
    point = data["layers"][draw(st.integers(0, len(data["layers"]) - 1))]
    bad = draw(st.sampled_from([-1.0, float("nan"), float("inf"), 0.0, 1e30, "x"]))
    if change == "time":
        point[draw(st.sampled_from(["forward", "backward", "recompute"]))]["median_s"] = bad
    elif change == "flops":
        point["forward_flops"] = bad
    elif change in ("hardware", "model"):
        data[change] = draw(st.sampled_from(["h100-80gb", "qwen2.5-vl-32b", "", "cpu"]))
    elif change == "version":
        data["schema_version"] = draw(st.sampled_from(["3", 99, None, 2.0, True]))
    elif change == "drop":
        del data[draw(st.sampled_from(["layers", "provenance", "hardware"]))]
    return data


@st.composite
def config_files(draw) -> dict:
    config = json.loads(json.dumps(QWEN2_5_VL_TINY))
    section = draw(st.sampled_from(["vision_config", "text_config", "model_type", None]))
    if section == "model_type":
        config["model_type"] = draw(st.sampled_from(["llama", "qwen2_vl", "qwen2_audio", 3]))
    elif section is not None:
        key = draw(st.sampled_from(sorted(config[section])))
        config[section][key] = draw(st.one_of(st.integers(-3, 10**6), st.sampled_from(["x", None, 2.5, [1]])))
        if draw(st.booleans()):
            del config[section]
    return config


@st.composite
def plan_argv(draw) -> tuple[list[str], dict[str, object]]:
    """(argv, files to write), ``{dir}`` in argv standing for their folder. Half the calls are valid; the others break
    one thing: a flag's value, the --fix / --frozen items, the model, or a cluster / profile / config file."""
    flags = {
        "--gpus": st.sampled_from([1, 2, 4, 8, 16, 3, 24]),
        "--gpus-per-node": st.sampled_from([2, 4, 8, 1, 3]),
        "--image-size": st.one_of(st.sampled_from(["448", "896x448", "1344"]), st.integers(14, 2000)),
        "--images-per-sample": st.integers(1, 3),
        "--vision-tokens": st.sampled_from([64, 256, 1024, 9216]),
        "--text-tokens": st.integers(7, 4096),
        "--audio-seconds": st.floats(0, 60),
        "--global-batch": st.one_of(st.sampled_from([4, 8, 16, 32, 64]), st.integers(1, 64)),
        "--precision": st.sampled_from(["bf16_mixed", "bf16_pure"]),
        "--placement": st.sampled_from(["auto", "colocated", "disjoint"]),
        "--top-k": st.integers(1, 3),
        "--time-limit": st.sampled_from([1, 2]),
    }
    floats = ["--time-limit", "--audio-seconds"] * 2  # the float flags, where NaN and infinities get through argparse
    broken = draw(st.sampled_from([None] * 10 + [*flags, *floats, "fix", "frozen", "model", "profile"] + ["cluster"] * 3))
    files: dict[str, object] = {}
    model = draw(st.sampled_from(["tiny", "tiny", "tiny", "qwen-vl-7b", "qwen-vl-32b", "qwen2-audio-7b"]))
    if broken == "model":
        model = draw(st.sampled_from(["config", "nonesuch", ""]))
    if model == "config":
        files["config.json"] = draw(config_files())
        model = "{dir}/config.json"
    argv = ["--model", "qwen2.5-vl-tiny" if model == "tiny" else model]
    if model == "tiny":
        argv += ["--gpu", "cpu"]
    vision, audio = model != "qwen2-audio-7b", model == "qwen2-audio-7b"
    unused = [] if vision else ["--image-size", "--images-per-sample", "--vision-tokens"]
    unused += [] if audio else ["--audio-seconds"]
    unused += ["--vision-tokens"] if draw(st.booleans()) else []  # image sizes or vision tokens, mostly not both
    for name in unused:
        if name != broken:
            flags.pop(name, None)
    argv += ["--gpus=" + str(draw(ANY_NUMBER if broken == "--gpus" else flags.pop("--gpus")))]
    flags.pop("--gpus", None)
    for name, values in flags.items():
        argv += draw(_flag(name, values, broken == name))
    if not any(a.startswith("--time-limit") for a in argv):
        argv += ["--time-limit=2"]
    modules = ["vision", "llm"] if vision else ["audio", "llm"]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        module = draw(st.sampled_from(modules + (["x"] if broken == "fix" else [])))
        field = draw(st.sampled_from(["dp", "tp", "sp", "cp", "zero", "recompute", "micro_batch", "grad_accum", "gpus"]))
        value = draw(st.sampled_from(["full", "none"] if field == "recompute" else ["1", "2", "4"]))
        if broken == "fix":
            value = draw(st.sampled_from(["-1", "x", "10000000000", "", "full", "9"]))
        argv += [f"--fix={module}.{field}={value}"]
    if draw(st.integers(0, 9)) == 0 or broken == "fix":
        argv += ["--fix=placement=" + draw(st.sampled_from(["colocated", "disjoint"] + (["x"] if broken else [])))]
    if draw(st.integers(0, 9)) == 0 or broken == "frozen":
        argv += [f"--frozen={m}" for m in draw(st.sets(st.sampled_from(modules + ["x"] * (broken == "frozen")),
                                                       min_size=1, max_size=2 if broken == "frozen" else 1))]
    if broken == "cluster" or draw(st.integers(0, 9)) == 0:
        files["cluster.json"] = draw(cluster_files()) if broken == "cluster" else {"device": "h100-80gb",
                                                                                    "inter_node_bandwidth": 25e9}
        argv += ["--cluster", "{dir}/cluster.json"]
    if broken == "profile":
        files["profile.json"] = draw(profile_files())
        argv += ["--profile", "{dir}/profile.json"]
    extra = ["--no-cp", "--json"] + (["--max-seq"] if "--top-k" not in " ".join(argv) or broken else [])
    return argv + sorted(draw(st.sets(st.sampled_from(extra), max_size=2))), files


def _plan(argv: list[str]) -> tuple[int, str, float]:
    """Exit status, stderr and CPU seconds (all threads) of ``plan argv``."""
    err = io.StringIO()
    start = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue(), time.process_time() - start


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("DHPLAN_FUZZ_EXAMPLES", DEFAULT_EXAMPLES)), deadline=DEADLINE,
          derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=plan_argv())
def test_plan_answers_any_input_in_one_line(case):
    argv, files = case
    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            Path(folder, name).write_text(json.dumps(data))
        argv = [a.replace("{dir}", folder) for a in argv] + ["--out", f"{folder}/plan.json"]
        code, err, cpu_s = _plan(argv)
    assert code in (0, 2), (argv, code, err)
    assert cpu_s <= MAX_CPU_SECONDS, (argv, cpu_s)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        assert err.startswith("plan: error: ") and err.count("\n") == 1, (argv, err)
    else:
        assert err == "", (argv, err)

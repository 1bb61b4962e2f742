"""Schema-driven fuzzing of every file the project reads (issue 29): plan files, profiles, cluster files, dataset
histograms, HF configs, run states and dataset rows. Each kind starts from a valid file written the project's own
way and is mutated by one of ``MUTATIONS`` (a leaf of the wrong type, null, an extreme, off by a unit factor; a key
deleted or added; the text truncated or made non-UTF-8). Each read -- the loader itself, and ``plan`` in-process
where the file is one of its inputs -- must within ``SECONDS_PER_CALL`` either succeed or refuse in one line
(``ValueError`` / ``NotImplementedError``, or ``plan``'s exit status 2 with one ``plan: error:`` line), never a
traceback; and a plan it produces must hold possible numbers (``assert_possible``).

Seeded (``derandomize``): CI runs the same ``EXAMPLES`` every time; ``DHPLAN_FUZZ_EXAMPLES=N`` runs N per kind.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import signal
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from planner.cli import main as plan_main
from planner.dataset import DatasetHistogram, VideoShape, read_dataset
from planner.contract.hardware import get_device, load_cluster_file
from planner.contract.families.qwen2_5_vl_configs import QWEN2_5_VL_TINY
from planner.contract.file_io import MAX_DEPTH
from planner.profiles import PROFILES_DIR
from planner.profiles.files import load_profile
from planner.catalog import get_model
from planner.contract.schema import Plan, load_plan
from planner.contract.units import GIB
from runtime.run import preflight
from runtime.run.checkpoint_dir import RUN_STATE, read_run_state, run_state_problem

EXAMPLES = int(os.environ.get("DHPLAN_FUZZ_EXAMPLES", 40))
"""Mutated files per kind and CI run."""
SECONDS_PER_CALL = 20
"""Longest one read (or one ``plan``) may take: a hang fails the test, not the suite."""
TINY = ["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus=2", "--time-limit=2", "--workers=1"]
"""A fast valid ``plan`` command the files are fed to."""
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- mutations -----------------------------------------------------------------------------------------------------

WRONG_TYPES = ["x", "", [], {}, True, [1, 2], {"a": 1}]
EXTREMES = [0, -1, -0.0, 1e300, -1e300, 2**63, 2**64 + 1, float("nan"), float("inf"), float("-inf"), "NaN", 1e-300]
UNIT_FACTORS = [1e3, 1e-3, 1e6, 1e-6, 1e9, 1e-9]
DEPTHS = [MAX_DEPTH, MAX_DEPTH + 1, 5000, 200_000]
DEEP = "<nested lists>"
"""Stands for the nested lists in the document until it is written."""
MUTATIONS = ("wrong_type", "null", "extreme", "unit_factor", "delete_key", "unknown_key", "truncate", "not_utf8",
             "deep_nesting")
"""The mutation classes; each example applies one to one place of a valid document."""


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Paths (keys and indexes) of every node under ``node``, the root excluded, in document order."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    found = []
    for key, child in children:
        found.append(prefix + (key,))
        found += _paths(child, prefix + (key,))
    return found


def _set(document: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


def _get(document: Any, path: tuple) -> Any:
    for key in path:
        document = document[key]
    return document


def _where(path: tuple) -> str:
    return ".".join(map(str, path)) or "the top level"


@st.composite
def mutated(draw, valid: Any, mutations: tuple[str, ...] = MUTATIONS) -> tuple[str, bytes]:
    """(what was done, file bytes): ``valid`` (a JSON document) with one mutation, named by its class and place."""
    kind = draw(st.sampled_from(mutations))
    document = copy.deepcopy(valid)
    paths = _paths(document)
    numbers = [p for p in paths if type(_get(document, p)) in (int, float)]
    if kind in ("truncate", "not_utf8"):
        text = json.dumps(document).encode()
        at = draw(st.integers(0, len(text)))
        return f"{kind} at byte {at}", text[:at] if kind == "truncate" else text[:at] + b"\xff\xfe\x80" + text[at:]
    if kind == "deep_nesting":  # a node replaced by lists nested past planner.contract.file_io.MAX_DEPTH, or far past it
        path = draw(st.sampled_from(paths or [()]))
        depth = draw(st.sampled_from(DEPTHS))
        if path:
            _set(document, path, DEEP)
        text = json.dumps(document if path else DEEP).replace(json.dumps(DEEP), "[" * depth + "]" * depth)
        return f"{_where(path)} nested {depth} deep", text.encode()
    if kind == "unit_factor" and numbers:
        path = draw(st.sampled_from(numbers))
        factor = draw(st.sampled_from(UNIT_FACTORS))
        _set(document, path, _get(document, path) * factor)
        done = f"{_where(path)} times {factor:g}"
    elif kind in ("delete_key", "unknown_key"):
        mappings = [()] + [p for p in paths if isinstance(_get(document, p), dict)]
        path = draw(st.sampled_from(mappings))
        where = _get(document, path)
        key = draw(st.sampled_from(sorted(where))) if kind == "delete_key" and where else "bogus_key"
        if key == "bogus_key":
            where[key] = 1
        else:
            del where[key]
        done = f"{kind} {_where(path + (key,))}"
    else:
        path = draw(st.sampled_from(numbers if kind == "extreme" and numbers and draw(st.booleans()) else paths))
        pool = {"wrong_type": WRONG_TYPES, "null": [None], "extreme": EXTREMES, "unit_factor": EXTREMES}[kind]
        value = draw(st.sampled_from(pool))
        _set(document, path, value)
        done = f"{_where(path)} = {value!r}"
    return done, json.dumps(document).encode()  # NaN / Infinity as Python writes them (json.loads reads them back)


# ---- how a read may end --------------------------------------------------------------------------------------------


class Hang(BaseException):
    """A read that ran past ``SECONDS_PER_CALL`` (a BaseException, so no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def bounded(seconds: float = SECONDS_PER_CALL):
    def _raise(signum, frame):
        raise Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def read_or_refuse(read: Callable[[], Any], what: Any) -> Any:
    """``read()``'s result, or None when it refused in one line (ValueError, NotImplementedError); anything else
    -- another exception, a multi-line or empty message, a hang -- fails with ``what`` (the input)."""
    try:
        with bounded():
            return read()
    except (ValueError, NotImplementedError) as e:
        message = str(e)
        assert message.strip() and "\n" not in message, (what, type(e).__name__, message)
        return None


def run_plan(argv: list[str], what: Any) -> Plan | None:
    """``plan argv --out F`` in-process: the plan written (checked by ``assert_possible``), or None when it refused
    with status 2 and one ``plan: error:`` line."""
    err = io.StringIO()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "plan.json")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), bounded():
            try:
                code = plan_main(argv + ["--out", out])
            except SystemExit as e:
                code = e.code
        message = err.getvalue()
        assert code in (0, 2), (what, argv, code, message)
        assert "Traceback" not in message, (what, argv, message)
        if code == 2:
            assert message.startswith("plan: error: ") and message.count("\n") == 1, (what, argv, message)
            return None
        plan = load_plan(out)
    assert_possible(plan, what)
    return plan


def _finite(value: float, low: float = 0.0) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= low


def assert_possible(plan: Plan, what: Any) -> None:
    """A plan's numbers are physically possible: a finite positive step time and throughput, MFU in (0, 1], each
    module's times and memory finite and non-negative, and the peak within the device's memory."""
    p = plan.predicted
    assert _finite(p.step_time_s) and p.step_time_s > 0, (what, p.step_time_s)
    assert _finite(p.tokens_per_s) and p.tokens_per_s > 0, (what, p.tokens_per_s)
    assert 0 < p.mfu <= 1, (what, p.mfu)
    device_gib = plan.cluster.device.memory_bytes / GIB
    assert _finite(p.peak_memory_gib) and p.peak_memory_gib <= device_gib, (what, p.peak_memory_gib, device_gib)
    for m in plan.modules:
        memory, time = m.predicted.memory_gib, m.predicted.time_s
        assert all(_finite(v) for v in memory.model_dump().values()), (what, m.name, memory)
        assert memory.total <= device_gib, (what, m.name, memory.total, device_gib)
        assert all(_finite(v) for v in time.model_dump().values()), (what, m.name, time)
        assert _finite(m.predicted.flops_per_step) and m.predicted.flops_per_step > 0, (what, m.name)


def _write(folder: str, name: str, data: bytes) -> str:
    path = os.path.join(folder, name)
    Path(path).write_bytes(data)
    return path


# ---- valid files, written the project's own way ----------------------------------------------------------------------


def _valid_plan() -> dict:
    from planner import api

    return json.loads(api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=2, gpu="cpu"), time_limit_s=2).to_json())


VALID_PLAN = _valid_plan()
VALID_PROFILE = json.loads((PROFILES_DIR / "cpu" / "qwen2.5-vl-tiny.json").read_text())
VALID_CLUSTER = {k: v for k, v in asdict(get_device("cpu")).items() if k != "source"}
VALID_CONFIG = copy.deepcopy(QWEN2_5_VL_TINY)
VALID_RUN_STATE = {"step": 4, "samples_seen": 32}
IMAGES = {"a.png": (56, 84), "b.png": (112, 112)}
"""Images the dataset rows name: name -> (height, width)."""
VALID_ROWS = [
    {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                         {"from": "gpt", "value": "A square."}]},
    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
                  {"role": "assistant", "content": "A picture."}], "images": ["b.png"]},
    {"image": ["a.png", "b.png"], "text": "two pictures"},
]
VALID_HISTOGRAM = DatasetHistogram(source="d.jsonl", text_tokens="estimated", skipped={"malformed row": 1},
                                   shapes=((3, 40, ((56, 84),), ()), (2, 64, ((112, 112), (56, 84)), ()),
                                           (1, 30, (), (VideoShape(8, 48, 64, 4.0),)))).to_json()


@pytest.fixture(scope="module", autouse=True)
def dataset_cache(tmp_path_factory):
    """The planner's dataset cache in a folder of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DHPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def test_the_valid_files_are_read_and_planned():
    """The starting points are valid: every mutation below starts from a file the readers accept."""
    with tempfile.TemporaryDirectory() as folder:
        assert load_plan(_write(folder, "p.json", json.dumps(VALID_PLAN).encode())).modules
        assert load_profile(_write(folder, "f.json", json.dumps(VALID_PROFILE).encode())).layers
        assert load_cluster_file(_write(folder, "c.json", json.dumps(VALID_CLUSTER).encode()))[0].name == "cpu"
        assert get_model(_write(folder, "config.json", json.dumps(VALID_CONFIG).encode())).modules
        Path(folder, RUN_STATE).write_text(json.dumps(VALID_RUN_STATE))
        assert read_run_state(folder) == VALID_RUN_STATE
        histogram = _write(folder, "h.json", json.dumps(VALID_HISTOGRAM).encode())
        assert read_dataset(histogram).samples == 6
        assert run_plan(TINY + ["--dataset", histogram], "histogram") is not None
        for name, (h, w) in IMAGES.items():
            Image.new("RGB", (w, h)).save(os.path.join(folder, name))
        rows = _write(folder, "d.jsonl", "".join(json.dumps(r) + "\n" for r in VALID_ROWS).encode())
        assert read_dataset(rows, rescan=True).samples == 3


# ---- one test per kind of file ---------------------------------------------------------------------------------------


@FUZZ
@given(case=mutated(VALID_PLAN))
def test_plan_files(case):
    """``load_plan`` and the runtime's checks before any worker starts (``preflight.check_plan`` and the driver's
    ``validate_plan``, what ``python -m runtime PLAN`` runs first)."""
    from runtime.launch.driver import validate_plan
    from runtime.training.trainer import RunOptions

    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        plan = read_or_refuse(lambda: load_plan(_write(folder, "plan.json", data)), kind)
    if plan is not None:
        read_or_refuse(lambda: (preflight.check_plan(plan), validate_plan(plan, RunOptions())), kind)


@st.composite
def plans_with_a_mutated_model_config(draw) -> tuple[str, bytes]:
    kind, config = draw(mutated(VALID_PLAN["model"]["hf_config"], MUTATIONS[:6]))
    plan = copy.deepcopy(VALID_PLAN)
    plan["model"]["hf_config"] = json.loads(config)
    return f"model.hf_config: {kind}", json.dumps(plan).encode()


@settings(FUZZ, max_examples=min(EXAMPLES, 20))
@given(case=plans_with_a_mutated_model_config())
def test_a_plans_model_config_in_the_runtime(case):
    """A plan file whose ``model.hf_config`` was edited: loaded, and put through the runtime's checks."""
    from runtime.launch.driver import validate_plan
    from runtime.training.trainer import RunOptions

    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        plan = read_or_refuse(lambda: load_plan(_write(folder, "plan.json", data)), kind)
    if plan is not None:
        read_or_refuse(lambda: (preflight.check_plan(plan), validate_plan(plan, RunOptions())), kind)


@FUZZ
@given(case=mutated(VALID_PROFILE), plan=st.integers(0, 3))
def test_profiles(case, plan):
    """``load_profile``, and a quarter of the profiles planned with (``plan --profile``)."""
    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        path = _write(folder, "profile.json", data)
        read_or_refuse(lambda: load_profile(path), kind)
        if plan == 0:
            run_plan(TINY + ["--profile", path], kind)


@FUZZ
@given(case=mutated(VALID_CLUSTER), catalog=st.booleans(), suffix=st.sampled_from([".json", ".yaml"]),
       plan=st.integers(0, 2))
def test_cluster_files(case, catalog, suffix, plan):
    """``load_cluster_file`` (JSON or YAML; a new device, or the catalog's "cpu" with its fields overridden) and a
    third of them planned with (``plan --cluster``)."""
    kind, data = case
    if catalog and data.startswith(b"{"):
        data = b'{"device": "cpu", ' + data[1:]
    with tempfile.TemporaryDirectory() as folder:
        path = _write(folder, "cluster" + suffix, data)
        read_or_refuse(lambda: load_cluster_file(path), kind)
        if plan == 0:
            run_plan(TINY + ["--cluster", path], kind)


@FUZZ
@given(case=mutated(VALID_HISTOGRAM), plan=st.integers(0, 2))
def test_histograms(case, plan):
    """``read_dataset`` of a histogram, and a third of them planned for (``plan --dataset``)."""
    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        path = _write(folder, "histogram.json", data)
        read_or_refuse(lambda: read_dataset(path), kind)
        if plan == 0:
            run_plan(TINY + ["--dataset", path], kind)


@FUZZ
@given(case=mutated(VALID_CONFIG), plan=st.integers(0, 2))
def test_hf_configs(case, plan):
    """``get_model`` of a config.json, and a third of them planned for (``plan --model FILE``) with the plan put
    through the runtime's checks: a config the planner accepts must be one the runtime builds."""
    from runtime.launch.driver import validate_plan
    from runtime.training.trainer import RunOptions

    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        path = _write(folder, "config.json", data)
        read_or_refuse(lambda: get_model(path), kind)
        if plan == 0:
            made = run_plan(["--model", path] + TINY[2:], kind)
            if made is not None:
                read_or_refuse(lambda: (preflight.check_plan(made), validate_plan(made, RunOptions())), kind)


@FUZZ
@given(case=mutated(VALID_RUN_STATE))
def test_run_states(case):
    """``read_run_state`` and ``run_state_problem`` (what ``--resume`` asks of a checkpoint's run_state.json)."""
    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        _write(folder, RUN_STATE, data)
        state = read_or_refuse(lambda: read_run_state(folder), kind)
        problem = run_state_problem(folder)
        assert (state is None) == (problem is not None) and "\n" not in (problem or ""), (kind, data, problem)


@st.composite
def dataset_files(draw) -> tuple[str, bytes]:
    """A JSONL file of ``VALID_ROWS`` with one row mutated (or the whole text, for truncate / not_utf8)."""
    at = draw(st.integers(0, len(VALID_ROWS) - 1))
    kind, row = draw(mutated(VALID_ROWS[at]))
    lines = [json.dumps(r).encode() for r in VALID_ROWS]
    if kind.startswith(("truncate", "not_utf8")) and draw(st.booleans()):
        whole = b"\n".join(lines)
        cut = draw(st.integers(0, len(whole)))
        return kind, whole[:cut] if kind.startswith("truncate") else whole[:cut] + b"\xff" + whole[cut:]
    lines[at] = row
    return f"row {at}: {kind}", b"\n".join(lines) + b"\n"


@FUZZ
@given(case=dataset_files(), plan=st.integers(0, 3))
def test_dataset_rows(case, plan):
    """``read_dataset`` of conversation / caption rows (scanned anew each time) and a quarter planned for."""
    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        for name, (h, w) in IMAGES.items():
            Image.new("RGB", (w, h)).save(os.path.join(folder, name))
        path = _write(folder, "data.jsonl", data)
        read_or_refuse(lambda: read_dataset(path, rescan=True), kind)
        if plan == 0:  # one pack budget (the default tries three, each solved)
            run_plan(TINY + ["--dataset", path, "--rescan", "--pack-tokens=512"], kind)


@FUZZ
@given(case=mutated({"runs": [{"plan": "plan.json", "step_time_s": 1.5, "peak_memory_gib": 0.5}]}),
       suffix=st.sampled_from([".yaml", ".yml"]))
def test_calibration_tables(case, suffix):
    """``runs_from_table`` of a YAML runs table (what ``python -m planner.calibrate TABLE`` reads) naming a
    valid plan file."""
    from planner.calibrate import runs_from_table

    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        _write(folder, "plan.json", json.dumps(VALID_PLAN).encode())
        table = _write(folder, "runs" + suffix, data.replace(b'"plan.json"', json.dumps(f"{folder}/plan.json").encode()))
        read_or_refuse(lambda: runs_from_table(Path(table)), kind)


VALID_METRICS_LINE = {"step": 1, "loss": 2.0, "step_time_s": 0.5, "peak_memory_gib": 0.1, "tokens_per_s": 100.0}


@FUZZ
@given(case=mutated(VALID_METRICS_LINE))
def test_calibration_metrics_files(case):
    """``measured_step_time`` and ``step_values`` of a metrics file (``--calibrate METRICS --plan PLAN``) with one
    of its step lines mutated."""
    from planner.calibrate import measured_step_time, step_values

    kind, line = case
    lines = [json.dumps({**VALID_METRICS_LINE, "step": s}).encode() for s in range(3)] + [line]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(_write(folder, "metrics.jsonl", b"\n".join(lines) + b"\n"))
        read_or_refuse(lambda: measured_step_time(path), kind)
        read_or_refuse(lambda: step_values(path, "peak_memory_gib"), kind)


@FUZZ
@given(case=mutated(VALID_CONFIG), index=mutated({"metadata": {"total_size": 8}, "weight_map": {"w": "a.safetensors"}}))
def test_checkpoint_small_files(case, index):
    """A ``--checkpoint`` folder's config.json (``preflight.check_checkpoint`` against the plan's model) and
    weight index (``runtime.checkpoints.hf_folder.HFFolder``)."""
    from runtime.checkpoints.hf_folder import INDEX_FILE, HFFolder

    (kind, data), (index_kind, index_data) = case, index
    with tempfile.TemporaryDirectory() as folder:
        _write(folder, "config.json", data)
        _write(folder, INDEX_FILE, index_data)
        read_or_refuse(lambda: preflight.check_checkpoint(folder, VALID_PLAN["model"]["hf_config"]), kind)
        read_or_refuse(lambda: HFFolder(folder), index_kind)


def _special(folder: str, name: str, kind: str) -> str:
    """``folder/name`` made a named pipe, a folder, an empty file or a symlink to nothing."""
    path = os.path.join(folder, name)
    {"fifo": os.mkfifo, "folder": os.mkdir, "empty": lambda p: Path(p).write_bytes(b""),
     "dangling": lambda p: os.symlink(os.path.join(folder, "nothing"), p)}[kind](path)
    return path


READERS = {
    "plan": lambda f: load_plan(_special(f.folder, "plan.json", f.kind)),
    "profile": lambda f: load_profile(_special(f.folder, "profile.json", f.kind)),
    "cluster": lambda f: load_cluster_file(_special(f.folder, "cluster.yaml", f.kind)),
    "hf config": lambda f: get_model(_special(f.folder, "config.json", f.kind)),
    "histogram or rows": lambda f: read_dataset(_special(f.folder, "d.jsonl", f.kind), rescan=True),
    "run state": lambda f: (_special(f.folder, RUN_STATE, f.kind), read_run_state(f.folder)),
    "runs table": lambda f: __import__("planner.calibrate", fromlist=["x"]).runs_from_table(
        Path(_special(f.folder, "runs.yaml", f.kind))),
}


@pytest.mark.parametrize("kind", ["fifo", "folder", "empty", "dangling"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_a_special_or_empty_file_in_one_line(reader, kind):
    """Not the contents but the file: a named pipe (must not block), a folder, an empty file, a dangling symlink."""
    with tempfile.TemporaryDirectory() as folder:
        read_or_refuse(lambda: READERS[reader](type("Case", (), {"folder": folder, "kind": kind})), (reader, kind))


# ---- the bugs the fuzzing found, one case each -----------------------------------------------------------------------


def test_a_row_with_a_list_for_a_role_or_null_content_is_skipped_as_malformed(tmp_path):
    rows = [copy.deepcopy(r) for r in VALID_ROWS * 2]
    rows[0]["conversations"][0]["from"] = []  # was: TypeError unhashable type 'list'
    rows[1]["messages"][0]["content"] = None  # was: TypeError 'NoneType' object is not iterable
    for name, (h, w) in IMAGES.items():
        Image.new("RGB", (w, h)).save(tmp_path / name)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    histogram = read_dataset(tmp_path / "d.jsonl", rescan=True)
    assert histogram.samples == 4 and histogram.skipped == {"malformed row": 2}


@pytest.mark.parametrize("section, key, value", [
    ("text_config", "hidden_act", []), ("text_config", "hidden_act", "nonesuch"), ("text_config", "rms_norm_eps", "x"),
    ("vision_config", "hidden_act", None), ("text_config", "rope_parameters", [1]), (None, "tie_word_embeddings", 1),
    ("vision_config", "fullatt_block_indexes", {}), ("text_config", "max_position_embeddings", True),
])
def test_a_config_field_of_a_type_transformers_refuses_is_refused_in_one_line(tmp_path, section, key, value):
    config = copy.deepcopy(VALID_CONFIG)
    (config[section] if section else config)[key] = value  # each planned, then crashed the runtime's config build
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{key}( .*)? (must be|is not an activation)") as refused:
        get_model(str(tmp_path / "config.json"))
    assert "\n" not in str(refused.value)


def test_the_activations_the_planner_accepts_are_the_ones_transformers_knows():
    from transformers.activations import ACT2CLS

    from planner.contract.families.fields import ACTIVATIONS

    assert sorted(ACTIVATIONS) == sorted(ACT2CLS)

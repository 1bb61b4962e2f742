"""A checkpoint is data, never code: a crafted DCP ``.metadata`` (a pickle whose unpickling would create a file) is
refused in one line by ``--resume``, ``runtime.export`` and the workers' DCP reader, and the file is never created;
a damaged one is refused by export as by ``--resume``; no source of planner/ or runtime/ uses an unsafe loader."""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from runtime import export
from runtime.__main__ import main
from runtime.run.checkpoint_dir import COMPLETE_MARKER, RUN_STATE
from runtime.checkpoints.dcp_checkpoint import CONFIG_FILE, checkpoint_problem
from runtime.checkpoints.dcp_metadata import METADATA_FILE, SafeFileSystemReader, UnsafeCheckpoint, read_metadata
from tests.runtime.plans import make_plan, tiny_hf_config

ROOT = Path(__file__).resolve().parents[2]


class Touch:
    """Unpickled, creates ``path`` through a shell command."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


class Open:
    """Unpickled, creates ``path`` with ``builtins.open``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _checkpoint(folder: Path, step: int = 2) -> str:
    """A complete checkpoint with real DCP shards (one process) and what --resume reads beside them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"param/w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(folder), no_dist=True)
    (folder / RUN_STATE).write_text(json.dumps({"step": step, "samples_seen": step}))
    (folder / CONFIG_FILE).write_text(json.dumps(tiny_hf_config()))
    (folder / COMPLETE_MARKER).write_text("ok\n")
    return str(folder)


@pytest.fixture(params=[Touch, Open])
def crafted(request, tmp_path):
    """(checkpoint whose .metadata would create ``marker`` when unpickled, marker)."""
    marker = tmp_path / "marker"
    folder = _checkpoint(tmp_path / "step-000002")
    with open(os.path.join(folder, METADATA_FILE), "wb") as f:
        pickle.dump(request.param(str(marker)), f)
    return folder, marker


def test_the_crafted_metadata_runs_code_when_unpickled_plainly(tmp_path):
    """The threat is real: the payload the tests below refuse does create its file under plain unpickling."""
    for payload in (Touch, Open):
        marker = tmp_path / payload.__name__
        pickle.loads(pickle.dumps(payload(str(marker))))
        assert marker.exists()


def test_resume_refuses_a_crafted_metadata_in_one_line_without_running_it(crafted, tmp_path, capsys):
    folder, marker = crafted
    (tmp_path / "plan.json").write_text(make_plan({}, {}).to_json())
    assert main([str(tmp_path / "plan.json"), "--resume", folder, "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its DCP metadata is refused: it names" in err, err
    assert not marker.exists()


def test_export_refuses_a_crafted_metadata_in_one_line_without_running_it(crafted, tmp_path, capsys):
    folder, marker = crafted
    assert export.main([folder, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged: its DCP metadata is refused: it names" in err, err
    assert not marker.exists()


def test_the_workers_dcp_reader_refuses_a_crafted_metadata(crafted):
    folder, marker = crafted
    with pytest.raises(UnsafeCheckpoint, match="never holds"):
        SafeFileSystemReader(folder).read_metadata()
    with pytest.raises(CheckpointException) as raised, warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        dcp.load({"param/w": torch.empty(2, 3)}, storage_reader=SafeFileSystemReader(folder), no_dist=True)
    ((error, _),) = raised.value.failures.values()
    assert "never holds" in str(error)
    assert not marker.exists()


def test_a_real_metadata_reads_as_dcp_reads_it_and_loads(tmp_path):
    folder = _checkpoint(tmp_path / "step-000002")
    assert read_metadata(folder).state_dict_metadata == dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    assert checkpoint_problem(folder) is None
    loaded = {"param/w": torch.empty(2, 3)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(loaded, storage_reader=SafeFileSystemReader(folder), no_dist=True)
    assert torch.equal(loaded["param/w"], torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("damage", ["truncated", "not a pickle"])
def test_export_refuses_a_damaged_metadata_in_one_line_as_resume_does(tmp_path, capsys, damage):
    folder = _checkpoint(tmp_path / "step-000002")
    path = os.path.join(folder, METADATA_FILE)
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(10)
    else:
        Path(path).write_bytes(b"garbage\n")
    assert export.main([folder, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged: its DCP metadata cannot be read" in err, err
    assert not (tmp_path / "hf").exists()


UNSAFE = {
    "shell=True": re.compile(r"shell\s*=\s*True"),
    "trust_remote_code=True": re.compile(r"trust_remote_code\s*=\s*True"),
    "yaml.load without SafeLoader": re.compile(r"yaml\.(unsafe_)?load(_all)?\((?![^)]*SafeLoader)"),
    "pickle.load outside runtime/checkpoints/dcp_metadata.py": re.compile(r"\bc?pickle\.loads?\b"),
    "torch.load without weights_only=True": re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"),
}
"""What must not appear in the sources: each runs code from the data it reads."""


def test_no_source_reads_data_with_an_unsafe_loader():
    found = []
    for package in ("planner", "runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text, name = path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()
            for what, pattern in UNSAFE.items():
                if what.startswith("pickle") and name == "runtime/checkpoints/dcp_metadata.py":
                    continue
                found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {what}" for m in pattern.finditer(text)]
    assert not found, found

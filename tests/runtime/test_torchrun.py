"""``torchrun --nproc-per-node N -m runtime plan.json``: the same plan without Ray, against the single-process
reference (tolerances as in test_parity.py), and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from runtime.models.model import build_model
from tests.runtime.plans import make_plan
from tests.runtime.reference import reference_run

STEPS = 3
SEED = 0
LR = 1e-3


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC -m runtime ARGS`` (torchrun is torch.distributed.run)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "runtime", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def runtime_errors(stderr: str) -> list[str]:
    """The ranks' error lines (one may follow rank 0's progress bar on the same terminal line)."""
    marker = "runtime: error:"
    return [line[line.index(marker):] for line in stderr.splitlines() if marker in line]


@pytest.mark.slow
def test_vision_sp2_llm_tp2_under_torchrun_matches_the_reference(tmp_path):
    plan = make_plan(dict(sp=2), dict(tp=2), learning_rate=LR)
    (tmp_path / "plan.json").write_text(plan.to_json())
    metrics, saved = tmp_path / "metrics.jsonl", tmp_path / "saved"
    result = torchrun(2, str(tmp_path / "plan.json"), "--steps", str(STEPS), "--seed", str(SEED),
                      "--metrics", str(metrics), "--save", str(saved))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("step") for r in records] == [*range(STEPS), None] and records[-1]["summary"]
    assert all([x["rank"] for x in r["ranks"]] == [0, 1] for r in records[:STEPS])  # every rank's reached rank 0
    assert result.stdout.count("final loss") == 1  # rank 0 alone prints the summary
    reference = reference_run(plan, seed=SEED, steps=STEPS)
    torch.testing.assert_close([r["loss"] for r in records[:STEPS]], reference["losses"], rtol=1e-5, atol=0)
    trained = dict(build_model(plan.model.hf_config, seed=0, checkpoint=str(saved)).named_parameters())
    assert set(trained) == set(reference["params"])
    for name, expected in reference["params"].items():
        error = (trained[name].detach() - expected).abs().max().item()
        assert error <= 0.1 * LR, f"{name}: max |p - p_ref| = {error:.3g}"


@pytest.mark.slow
def test_torchrun_with_more_processes_than_the_plans_devices_is_one_line(tmp_path):
    (tmp_path / "plan.json").write_text(make_plan(dict(sp=2), dict(tp=2)).to_json())
    result = torchrun(3, str(tmp_path / "plan.json"), "--steps", "1")
    assert result.returncode != 0
    assert runtime_errors(result.stderr) == [  # every rank finds it, rank 0 alone says it
        "runtime: error: torchrun started 3 processes but the plan uses 2 devices: run torchrun with 2 processes "
        "in all (--nnodes x --nproc-per-node = 2)"
    ], result.stderr
    assert "[rank0]: Traceback" not in result.stderr  # torchrun's own report follows; no rank printed a stack


@pytest.mark.slow
def test_a_failing_rank_under_torchrun_is_its_one_line_and_its_peers_print_no_stack(tmp_path):
    """Rank 1 of the DP-2 plan reads the missing image; rank 0, waiting in a collective, loses its peer."""
    from PIL import Image

    (tmp_path / "plan.json").write_text(make_plan(dict(dp=2), dict(dp=2)).to_json())
    Image.new("RGB", (168, 112)).save(tmp_path / "good.png")
    rows = [{"image": image, "text": "a cat"} for image in ("good.png", "missing.png")]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = torchrun(2, str(tmp_path / "plan.json"), "--steps", "1", "--data", str(tmp_path / "data.jsonl"))
    assert result.returncode != 0
    errors = runtime_errors(result.stderr)
    assert errors[0].startswith(f"runtime: error: cannot read image {tmp_path}/missing.png"), result.stderr
    # rank 0 either is stopped by torchrun first (silent) or sees the connection close (one line, no stack)
    assert all(e.startswith("runtime: error: rank 0 stopped: another rank failed") for e in errors[1:]), errors
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr

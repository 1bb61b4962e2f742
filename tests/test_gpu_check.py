"""benchmarks/gpu_check.py: the GPU check's flow on CPU (tiny model, 2 steps, torchrun with one gloo process,
Ray and OR-Tools unimportable, as on the GPU machine), its varlen verdict, the varlen call in older torch's
spelling, and the prepared plans the GPU run starts from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parent.parent


def unimportable(folder: Path, *names: str) -> Path:
    """A folder whose packages ``names`` raise ImportError, to put first on PYTHONPATH."""
    for name in names:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU machine')\n")
    return folder


@pytest.mark.slow
def test_the_cpu_dry_run_goes_through_every_step_without_ray_or_ortools(tmp_path):
    script = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-dry"]
    prepared = subprocess.run([*script, "--prepare", "--prepared", str(tmp_path / "prepared"), "--work",
                               str(tmp_path / "prep")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    blocked = unimportable(tmp_path / "blocked", "ray", "ortools")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT)])}
    out = tmp_path / "out"
    result = subprocess.run([*script, "--prepared", str(tmp_path / "prepared"), "--out", str(out), "--work",
                             str(tmp_path / "work")], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["failed"] == [] and results["env"]["solver"] is False
    assert "no solver here" in results["plan"]["how"]
    assert json.loads((out / "profile.json").read_text())["layers"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s.get("step") for s in steps] == [0, 1, None]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["predicted"]["profile"] == str(out / "profile.json")  # costed with the profile it measured
    assert plan["modules"][1]["predicted"]["sources"]["decoder_layer.time"] == "measured"
    packs = plan["workload"]["global_batch"] * plan["workload"]["dataset"]["pack_tokens"]
    assert all(0 < s["llm_tokens"] <= packs for s in steps[:2])  # the step's packs of the dataset
    compare = results["compare"]
    assert compare["step_time_s"]["measured"] == steps[-1]["step_time_s"]["measured"] > 0
    assert compare["step_time_s"]["predicted"] == plan["predicted"]["step_time_s"]
    assert "varlen_attn: skipped: no CUDA" in result.stdout
    assert results["varlen"]["candidate"] == "block-mask SDPA"
    assert (out / "results.txt").read_text().count("[compare]") == 5


def test_the_varlen_verdict_fails_a_candidate_that_attends_across_segments():
    lengths = (3, 9, 20)

    def whole_pack(q, k, v, lengths, causal):  # one causal sequence: segments see their predecessors
        return gpu_check.block_mask_sdpa(q, k, v, (sum(lengths),), causal)

    good = gpu_check.agreement(gpu_check.block_mask_sdpa, lengths, True, 4, 2, 16, "cpu")
    bad = gpu_check.agreement(whole_pack, lengths, True, 4, 2, 16, "cpu")
    assert all(r["passed"] for r in good.values())
    assert not bad["out"]["passed"] and bad["out"]["vs_sdpa"] > 0.1


def test_varlen_is_called_in_older_torch_spelling(monkeypatch):
    """torch 2.10's varlen_attn has ``is_causal`` and no ``enable_gqa``: the check passes the flag and repeats the
    KV heads itself."""
    import torch.nn.attention.varlen as module

    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        calls.append((key.shape[1], is_causal, cu_seq_q.tolist(), max_q))
        return gpu_check.block_mask_sdpa(query, key, value, tuple(cu_seq_q.diff().tolist()), is_causal)

    monkeypatch.setattr(module, "varlen_attn", varlen_attn)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    out = gpu_check.varlen(q, k, v, (4, 6), True)
    assert calls == [(4, True, [0, 4, 10], 6)]
    torch.testing.assert_close(out, gpu_check.per_segment_sdpa(q, k, v, (4, 6), True))


def test_gpu_names_map_to_the_hardware_catalog():
    assert gpu_check.gpu_hardware("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert gpu_check.gpu_hardware("NVIDIA H200") == "h200-141gb"
    assert gpu_check.gpu_hardware("NVIDIA GeForce RTX 4090") is None


def test_measured_mfu_is_the_predicted_mfu_at_the_measured_token_rate():
    class Predicted:
        mfu, tokens_per_s = 0.30, 20_000.0

    class Plan:
        predicted = Predicted

    assert gpu_check.measured_mfu({"tokens_per_s": {"measured": 15_000.0}}, Plan) == pytest.approx(0.225)


@pytest.mark.parametrize("hardware", ["h100-80gb", "h200-141gb"])
def test_the_prepared_gpu_plans_fit_their_gpu_as_the_gpu_run_recosts_them(hardware, tmp_path):
    """What the GPU run does without a solver: the prepared strategy, costed on today's dataset and cost model."""
    from planner import api
    from planner.analysis import strategy_of
    from planner.dataset import read_dataset
    from planner.contract.schema import load_plan

    setup = gpu_check.gpu_setup(hardware, "qwen2.5-vl-3b")
    prepared = load_plan(gpu_check.PREPARED / f"{hardware}-qwen2.5-vl-3b.json")
    data, tokenizer = gpu_check.write_dataset(setup, tmp_path)
    plan = api.evaluate(setup.model, strategy_of(prepared), api.ClusterInputs(gpus=1, gpu=hardware, profile=None),
                        **gpu_check.dataset_inputs(setup, read_dataset(str(data), str(tokenizer))))
    assert plan.cluster.device.name == prepared.cluster.device.name and plan.cluster.num_devices == 1
    assert plan.workload.dataset.packs_per_epoch == prepared.workload.dataset.packs_per_epoch
    assert plan.predicted.step_time_s * gpu_check.gpu_setup(hardware, setup.model).steps < gpu_check.TOTAL_BUDGET_S / 2


def test_a_failed_steps_reason_is_the_line_that_names_the_error_not_torchruns_banner():
    rank_fault = "[rank0]: Traceback\n[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n" \
                 "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n  error_file: <N/A>\n" + "=" * 60
    assert gpu_check.telling_line(rank_fault) == "[rank0]: torch.OutOfMemoryError: CUDA out of memory."
    refusal = "runtime: error: the tokenizer maps <|image_pad|> to 1002\nTraceback\nValueError: x\n" + "=" * 60
    assert gpu_check.telling_line(refusal) == "runtime: error: the tokenizer maps <|image_pad|> to 1002"

"""The published-runs fidelity set (benchmarks/published/runs.csv): every row cited and complete, and the benchmark
prices a row with that row's own settings. Not the error targets: those are the benchmark's report."""

import dataclasses
import math
import re

import pytest

from tests.benchmark_modules import load_benchmark

COMMIT_URL = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+/blob/[0-9a-f]{40}/\S+$")


bench = load_benchmark("published_fidelity")
RUNS = {run.id: run for run in bench.load_runs(bench.PUBLISHED / "runs.csv")}


def test_every_row_is_cited_and_its_files_exist():
    assert len(RUNS) >= 10
    for run in RUNS.values():
        assert COMMIT_URL.match(run.source), f"{run.id}: source must be a document at a commit: {run.source}"
        assert run.table and run.ac, run.id
        assert (bench.PUBLISHED / "models" / f"{run.model}.json").is_file(), run.id
        assert not run.cluster_file or (bench.PUBLISHED / run.cluster_file).is_file(), run.id
        assert run.dp * run.tp * run.pp * run.cp == run.gpus, f"{run.id}: degrees do not multiply to the GPUs"
        assert bench.published_tokens_per_s(run) > 0, run.id
    assert {run.time_compared for run in RUNS.values()} >= {"yes", "mapped", "no"}


def test_a_row_without_its_source_is_refused_in_one_line(tmp_path):
    lines = (bench.PUBLISHED / "runs.csv").read_text().splitlines()
    header = lines[0].split(",")
    row = lines[1].split(",")
    row[header.index("source")] = ""
    bad = tmp_path / "runs.csv"
    bad.write_text("\n".join([lines[0], ",".join(row)]) + "\n")
    with pytest.raises(ValueError, match=r"^\S+runs\.csv:2: missing source$"):
        bench.load_runs(bad)


def test_megatron_flops_per_token_by_hand():
    """Megatron-LM's 1.7B row: 72 L h^2 + 12 L h s + 6 V h (its formula with f = 4h, g = a, q = h)."""
    config = bench.model_config(RUNS["mlm-gpt-1.7b"])
    layers, h, vocab, s = 24, 2048, 131072, 4096
    assert bench.megatron_flops_per_token(config, s) == pytest.approx(
        72 * layers * h * h + 12 * layers * h * s + 6 * vocab * h)
    assert bench.published_tokens_per_s(RUNS["mlm-gpt-1.7b"]) == pytest.approx(408.8e12 / 11.27e9, rel=1e-3)


def _predicted(run):
    e = bench.RowPredictor(run)({})
    return e.tokens_per_s / run.gpus, e.peak_memory_bytes


def test_a_row_is_priced_with_its_own_settings():
    """Llama 2 13B on 64 A100s, FSDP, local batch 2, no AC: finite, and the memory follows the micro-batch, the
    recomputation and the sequence length the row gives."""
    run = RUNS["tt-a100-llama2-13b-none"]
    tokens, memory = _predicted(run)
    assert math.isfinite(tokens) and tokens > 0
    _, half_batch = _predicted(dataclasses.replace(run, micro_batch=1, global_batch=64))
    _, recomputed = _predicted(dataclasses.replace(run, planner_recompute="full"))
    _, shorter = _predicted(dataclasses.replace(run, seq=2048))
    assert half_batch < memory and recomputed < memory and shorter < memory


def test_the_hardware_override_is_applied():
    """torchtitan's H100s are 96 GB HBM2e parts at 2.4 TB/s: the row's cluster file, not the catalog H100."""
    problem = bench.row_problem(RUNS["tt-h100-llama31-8b-fsdp8"])
    assert problem.cluster.device.memory_bandwidth == 2.4e12
    assert problem.cluster.device.memory_bytes == 95 * 2**30

"""Published GPU training runs as a fidelity set: the planner prices each run of ``benchmarks/published/runs.csv``
with its published settings and is compared with its published tokens/s per GPU and memory.

    PYTHONPATH=. python benchmarks/published_fidelity.py [--runs benchmarks/published/runs.csv]
        [--txt benchmarks/results/published_fidelity.txt]

Each row cites its document and table (``source``, ``table``) and gives hardware, precision, the parallel degrees,
micro and global batch, sequence length, activation checkpointing and what was measured. A row whose degrees and
micro-batch are all given is costed as that one strategy (``planner.cost.estimate``, so a run the planner thinks does
not fit is still priced, and flagged); a row that leaves the micro-batch or recomputation unstated (Megatron-LM's
table) is planned with its degrees pinned and the rest chosen by the planner. ``time_compared`` says whether the
row's time is like-for-like (yes), priced through a stated mapping of its activation checkpointing (mapped), or not
compared (no: torch.compile or Float8, which the cost model does not price; such rows serve memory only).

Calibration: the GPU assumptions the step time depends on (``CALIBRATED``) are refitted by
``planner.calibrate.fit_step_time`` (the planner's own ``--calibrate`` fit: bounded least squares of log
errors with a prior at the defaults) on every other like-for-like row (time_compared yes) in file order and checked
on the rest; mapped rows are reported but neither fitted nor counted in the targets' medians.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.api import ClusterInputs, SearchOptions, WorkloadInputs, make_problem, plan  # noqa: E402
from planner.cost import estimate  # noqa: E402
from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, CostAssumptions  # noqa: E402
from planner.cost.results import Estimate  # noqa: E402
from planner.problem import Problem  # noqa: E402
from planner.calibrate import fit_step_time  # noqa: E402
from planner.profiles.calibration import with_values  # noqa: E402
from planner.contract.strategy import ModuleStrategy, Strategy  # noqa: E402
from planner.contract.units import GIB  # noqa: E402

PUBLISHED = ROOT / "benchmarks" / "published"
CALIBRATED = ("max_matmul_efficiency", "flash_attention_efficiency", "intra_node_bus_efficiency",
              "inter_node_bus_efficiency")
"""The named assumptions refitted to the published runs: how fast a GEMM and the attention kernel run, and how much of
the links' bandwidth a collective reaches."""
TIME_COMPARED = ("yes", "mapped", "no")


@dataclass(kw_only=True, frozen=True)
class PublishedRun:
    """One row of runs.csv: a published training run and its settings."""

    id: str
    source: str
    """URL of the document, at a commit."""
    table: str
    """The table or section of the document holding the row."""
    model: str
    """File under benchmarks/published/models/: the model's config.json (its published dimensions)."""
    device: str
    """Catalog device the hardware starts from."""
    cluster_file: str
    """Override file under benchmarks/published/ for hardware the catalog does not hold ('' for none)."""
    gpus: int
    gpus_per_node: int
    precision: str
    dp: int
    tp: int
    pp: int
    cp: int
    zero: int
    micro_batch: int | None
    """Samples per micro-batch per DP rank (torchtitan's local batch); None when the source leaves it unstated."""
    global_batch: int
    seq: int
    ac: str
    """Activation checkpointing as the source states it."""
    planner_recompute: str
    """The planner's recomputation it is priced with ('' when unstated: the planner picks)."""
    sequence_parallel: bool
    """Megatron-style sequence parallelism with TP (norms and block inputs sharded over the TP ranks)."""
    compile: str
    float8: bool
    time_compared: str
    tokens_per_s_per_gpu: float | None
    model_tflops_per_gpu: float | None
    """Megatron-LM's published per-GPU model TFLOP/s (its tokens/s follow from its FLOP formula)."""
    memory_gib: float | None
    notes: str

    @property
    def pinned(self) -> bool:
        """Every degree, the micro-batch and the recomputation given: one strategy to cost."""
        return self.micro_batch is not None and self.planner_recompute != ""


REQUIRED = ("id", "source", "table", "model", "device", "gpus", "precision", "dp", "tp", "pp", "cp", "zero",
            "global_batch", "seq", "ac", "time_compared")
"""Columns every row fills: its citation and the settings the planner needs."""


def _optional_number(text: str, kind: type) -> int | float | None:
    return kind(text) if text.strip() else None


def load_runs(path: Path) -> list[PublishedRun]:
    """The rows of a runs.csv.

    Raises:
        ValueError: a missing citation or setting, or a row without anything measured, in one line.
    """
    runs = []
    with open(path, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            missing = [key for key in REQUIRED if not (row.get(key) or "").strip()]
            if missing:
                raise ValueError(f"{path}:{line}: missing {', '.join(missing)}")
            if row["time_compared"] not in TIME_COMPARED:
                raise ValueError(f"{path}:{line}: time_compared must be one of {', '.join(TIME_COMPARED)}")
            if not (row["tokens_per_s_per_gpu"].strip() or row["model_tflops_per_gpu"].strip()):
                raise ValueError(f"{path}:{line}: give tokens_per_s_per_gpu or model_tflops_per_gpu")
            values = {}
            for field in fields(PublishedRun):
                text = row[field.name]
                if field.type == "int":
                    values[field.name] = int(text)
                elif field.type == "int | None":
                    values[field.name] = _optional_number(text, int)
                elif field.type == "float | None":
                    values[field.name] = _optional_number(text, float)
                elif field.type == "bool":
                    values[field.name] = text == "yes"
                else:
                    values[field.name] = text
            runs.append(PublishedRun(**values))
    return runs


def model_config(run: PublishedRun) -> dict:
    with open(PUBLISHED / "models" / f"{run.model}.json", encoding="utf-8") as f:
        return json.load(f)


def megatron_flops_per_token(config: dict, seq: int) -> float:
    """Model FLOPs per token as Megatron-LM counts them for its published TFLOP/s (megatron/training/training.py
    ``num_floating_point_operations`` at commit f2e5db402c, the commit of the table): 12 L h^2 ((1 + g/a + s/h) q/h
    + f/h + V / (2 L h)) for a GPT with q = h, g = a (no GQA) and f = 4h (GELU, no SwiGLU): forward + backward, no
    recomputation, the full s x s attention (no causal halving), the logits."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    ffn = 4 * h
    return 12 * layers * h * h * ((1 + 1 + seq / h) + ffn / h + vocab / (2 * layers * h))


def published_tokens_per_s(run: PublishedRun) -> float:
    """Tokens/s per GPU: as published, or Megatron-LM's model TFLOP/s over its FLOPs per token."""
    if run.tokens_per_s_per_gpu is not None:
        return run.tokens_per_s_per_gpu
    return run.model_tflops_per_gpu * 1e12 / megatron_flops_per_token(model_config(run), run.seq)


def published_step_s(run: PublishedRun) -> float:
    """Seconds per optimizer step implied by the published tokens/s per GPU."""
    return run.global_batch * run.seq / (published_tokens_per_s(run) * run.gpus)


def row_assumptions(run: PublishedRun, base: CostAssumptions = DEFAULT_ASSUMPTIONS) -> CostAssumptions:
    """The assumptions a row's framework fixes: Megatron-style sequence parallelism where it shards the norms, and
    the whole logits' loss (neither torchtitan's nor Megatron-LM's published runs chunk it)."""
    return replace(base, megatron_sequence_parallel=run.sequence_parallel, loss_chunk_tokens=0)


def row_problem(run: PublishedRun, assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS) -> Problem:
    """The planner's inputs for a row: its model, hardware, sequence, batch and precision, no vision input."""
    cluster_file = str(PUBLISHED / run.cluster_file) if run.cluster_file else None
    cluster = ClusterInputs(gpus=run.gpus, gpu=run.device, gpus_per_node=run.gpus_per_node, cluster_file=cluster_file,
                            profile=None)
    workload = WorkloadInputs(text_tokens=run.seq, global_batch=run.global_batch, precision=run.precision)
    return make_problem(str(PUBLISHED / "models" / f"{run.model}.json"), cluster, workload=workload,
                        search=SearchOptions(allow_ring_cp=run.cp > 1), assumptions=row_assumptions(run, assumptions))


def row_strategy(run: PublishedRun, problem: Problem) -> Strategy:
    """The row's strategy: pinned from its columns, else planned with its degrees pinned."""
    if run.pinned:
        grad_accum = run.global_batch // (run.dp * run.micro_batch)
        if grad_accum * run.dp * run.micro_batch != run.global_batch:
            raise ValueError(f"{run.id}: global batch {run.global_batch} is not a multiple of dp x micro-batch")
        llm = ModuleStrategy(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, zero=run.zero,
                             recompute=run.planner_recompute, micro_batch=run.micro_batch, grad_accum=grad_accum)
        return Strategy(placement="colocated", modules={"llm": llm}, precision=run.precision)
    fixes = {"llm.dp": run.dp, "llm.tp": run.tp, "llm.pp": run.pp, "llm.cp": run.cp, "llm.sp": 1, "llm.zero": run.zero}
    planned = plan(problem, fix=fixes).module("llm")
    return Strategy(placement="colocated", modules={"llm": ModuleStrategy.of_plan_module(planned)},
                    precision=run.precision)


class RowPredictor:
    """One row's estimate as a function of the calibrated assumptions (``fit_step_time``'s predictor interface)."""

    def __init__(self, run: PublishedRun) -> None:
        self.run = run
        self.problem = row_problem(run)
        self.strategy = row_strategy(run, self.problem)
        self.base = self.problem.assumptions

    def __call__(self, values: dict[str, float]) -> Estimate:
        p = self.problem
        return estimate(p.model, p.cluster, p.workload, self.strategy, with_values(self.base, values), p.layer_costs)


@dataclass(kw_only=True, frozen=True)
class RowResult:
    run: PublishedRun
    strategy: str
    split: str
    """fit, held out, or - (time not compared)."""
    published_tokens: float
    uncalibrated: Estimate
    calibrated: Estimate

    def tokens_per_gpu(self, e: Estimate) -> float:
        return e.tokens_per_s / self.run.gpus

    def error(self, e: Estimate) -> float:
        return self.tokens_per_gpu(e) / self.published_tokens - 1

    @property
    def memory_error(self) -> float | None:
        if self.run.memory_gib is None:
            return None
        return self.uncalibrated.peak_memory_bytes / GIB / self.run.memory_gib - 1


def calibrate(predictors: list[RowPredictor]) -> tuple[dict[str, float], list[str]]:
    """Fit ``CALIBRATED`` on every other like-for-like row; (fitted values, the fitted rows' ids)."""
    compared = [p for p in predictors if p.run.time_compared == "yes"]
    fitted = compared[::2]
    values = fit_step_time(fitted, [published_step_s(p.run) for p in fitted], list(CALIBRATED))
    return values, [p.run.id for p in fitted]


def evaluate_rows(runs: list[PublishedRun]) -> tuple[list[RowResult], dict[str, float]]:
    predictors = [RowPredictor(run) for run in runs]
    values, fitted = calibrate(predictors)
    results = []
    for p in predictors:
        split = "-" if p.run.time_compared != "yes" else ("fit" if p.run.id in fitted else "held out")
        results.append(RowResult(run=p.run, strategy=p.strategy.modules["llm"].describe(), split=split,
                                 published_tokens=published_tokens_per_s(p.run), uncalibrated=p({}),
                                 calibrated=p(values)))
    return results, values


def _percent(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def _median_abs(xs: list[float]) -> str:
    return f"{100 * statistics.median(abs(x) for x in xs):.1f}% (n={len(xs)})" if xs else "-"


def report(results: list[RowResult], values: dict[str, float]) -> str:
    """The comparison table and the median errors."""
    head = (f"{'row':<28} {'AC':<12} {'time':<6} {'published':>9} {'predicted':>9} {'error':>7} {'calibrated':>10} "
            f"{'error':>7} {'split':<8} {'mem pub':>7} {'mem pred':>8} {'error':>7}  planned strategy")
    lines = [head, "-" * len(head)]
    for r in results:
        memory = f"{r.run.memory_gib:7.1f}" if r.run.memory_gib is not None else f"{'':>7}"
        fits = "" if r.uncalibrated.fits else " (planner: does not fit)"
        lines.append(
            f"{r.run.id:<28} {r.run.ac:<12} {r.run.time_compared:<6} {r.published_tokens:9.0f} "
            f"{r.tokens_per_gpu(r.uncalibrated):9.0f} {_percent(r.error(r.uncalibrated)):>7} "
            f"{r.tokens_per_gpu(r.calibrated):10.0f} {_percent(r.error(r.calibrated)):>7} {r.split:<8} {memory} "
            f"{r.uncalibrated.peak_memory_bytes / GIB:8.1f} {_percent(r.memory_error):>7}  {r.strategy}{fits}")
    compared = [r for r in results if r.run.time_compared != "no"]
    like = [r for r in compared if r.run.time_compared == "yes"]
    held = [r for r in compared if r.split == "held out"]
    fitted = [r for r in compared if r.split == "fit"]
    memory = [r.memory_error for r in results if r.memory_error is not None]
    lines += [
        "",
        "tokens/s per GPU, median |error| (targets: <= 15 % uncalibrated, <= 10 % held out after calibration;",
        "fit and held out among the like-for-like rows, time 'yes'):",
        f"  uncalibrated, all compared rows:   {_median_abs([r.error(r.uncalibrated) for r in compared])}",
        f"  uncalibrated, like-for-like rows:  {_median_abs([r.error(r.uncalibrated) for r in like])}",
        f"  calibrated, fitted rows:           {_median_abs([r.error(r.calibrated) for r in fitted])}",
        f"  calibrated, held-out rows:         {_median_abs([r.error(r.calibrated) for r in held])}",
        f"  uncalibrated, the same held-out:   {_median_abs([r.error(r.uncalibrated) for r in held])}",
        f"peak memory per GPU, median |error| (target <= 10 %): {_median_abs(memory)}",
        "calibrated assumptions (defaults in brackets): " + ", ".join(
            f"{name} {value:.3f} [{getattr(DEFAULT_ASSUMPTIONS, name):.3f}]" for name, value in values.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=str(PUBLISHED / "runs.csv"))
    parser.add_argument("--txt", help="also write the report here")
    args = parser.parse_args(argv)
    results, values = evaluate_rows(load_runs(Path(args.runs)))
    text = report(results, values)
    print(text)
    if args.txt:
        Path(args.txt).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

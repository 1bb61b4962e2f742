"""A prepared GPU check: on one GPU, without Ray, in under 8 minutes, profile a Qwen2.5-VL-3B's layer shards, plan
it for packed data, train the plan 10 steps under torchrun (bf16) and print measured against predicted step time,
peak memory and MFU, then varlen attention against per-segment SDPA on a packed batch.

    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out DIR      # on the GPU machine (default benchmarks/results/gpu)
    PYTHONPATH=$PWD python benchmarks/gpu_check.py --cpu-dry --out DIR   # the same flow on CPU, tiny model, 2 steps
    PYTHONPATH=$PWD python benchmarks/gpu_check.py --prepare      # here: the plans the GPU run starts from

Steps, each one line or more tagged ``[step]``, each under a time cap inside the whole run's budget:

1. data: a packed conversation dataset written on the spot (images of several sizes, answers of several lengths)
   and a byte-level tokenizer with the model's special-token ids (no download).
2. profile: ``python -m runtime.profile`` on the local device at a few shapes, into ``profiles/<gpu>/<model>.json``
   (``--cpu-dry``: into ``--out``).
3. plan: with OR-Tools, the solver plans from the measured profile; without it (the GPU image has none), the
   strategy of the plan prepared here (``--prepare``: ``benchmarks/gpu_check/<gpu>-<model>.json``, the solver's
   choice on the analytical model) is re-costed from the measured profile (``planner.api.evaluate``, no solver).
   The same strategy is also costed analytically, for comparison.
4. run: ``torchrun --nproc-per-node 1 -m runtime plan.json --data ... --tokenizer ... --steps N --metrics ...``.
5. compare: the run's median step time (after the first step), peak memory (max allocated) and MFU beside both
   predictions. MFU measured is the plan's model FLOPs per LLM token times the measured tokens/s over the GPU's
   peak, i.e. predicted MFU x measured tokens/s / predicted tokens/s.
6. varlen: ``torch.nn.attention.varlen.varlen_attn`` (CUDA only) on a packed batch against per-segment
   ``scaled_dot_product_attention``, causal with the LLM's GQA heads and non-causal with the vision tower's: max
   |difference| of the output and of the q/k/v gradients, with a verdict. On CPU the varlen call is skipped and a
   block-diagonal masked SDPA stands in for it, which checks the harness.

Why the 3B: AdamW under bf16 mixed precision holds 16 bytes per parameter, so the 7B (8.3B parameters) needs 124
GiB on one H100 and, with these packs' activations, 135.5 GiB on one H200 by the planner's account (``--prepare
--model qwen2.5-vl-7b`` says so: no plan fits); the 3B (3.75B, 56 GiB of states) plans at 67.7 GiB on an H100.

Why plans are prepared here: the GPU machine's image has torch and transformers but not Ray, OR-Tools or pydantic.
The runtime under torchrun imports neither Ray nor OR-Tools, and re-costing a prepared strategy needs no solver;
reading and writing plans needs pydantic, so the GPU run carries the wheels of pydantic 2.14.4, pydantic_core
2.50.5 (cp312, manylinux 2.17), annotated_types 0.8.0, typing_inspection 0.4.5 and typing_extensions 4.16.0 (2.8 MB).
docs/gpu.md gives the ``pip download`` and the device call; the files it brings back go to
``profiles/<gpu>/<model>.json`` (``profile.json``) and ``benchmarks/results/gpu/`` (the rest).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "gpu"
PREPARED = ROOT / "benchmarks" / "gpu_check"
"""Plans made here (``--prepare``) for the GPU run, one per GPU kind: ``<gpu>-<model>.json``."""
TOTAL_BUDGET_S = 330.0
"""Seconds the whole check may take; each step's cap is cut to what is left. The issue's limit is 8 minutes; 5.5
leave a session's 15 device minutes room for the machine's start and one rerun."""
MIN_STEP_S = 10.0
"""A step with fewer seconds left than this is skipped, said as ``skipped: out of time``."""
PROFILE_SETTLE_S = 40.0
"""Of the profile step's cap, the seconds left to the profiler's start-up and device benchmarks: its layer sweep
gets the rest (``--time-budget``) and stops measuring new points there, keeping those it has."""
SOLVER_TIME_LIMIT_S = 30.0
"""CP-SAT's limit when the solver is at hand."""
GPU_KINDS = {"H100": "h100-80gb", "H200": "h200-141gb", "A100": "a100-80gb", "B200": "b200"}
"""A word of ``torch.cuda.get_device_name()`` -> the hardware catalog's name (``plan --list-gpus``)."""
TOLERANCE_FACTOR = 2.0
TOLERANCE_ATOL = 1e-5
"""varlen passes where its max |error| against an fp32 reference is at most ``TOLERANCE_FACTOR`` x bf16 SDPA's own
+ ``TOLERANCE_ATOL``: the criterion of FlashAttention's tests (Dao et al., flash-attention tests/test_flash_attn.py,
``assert (out - out_ref).abs().max() <= 2 * (out_pt - out_ref).abs().max() + 1e-5``)."""


@dataclass(kw_only=True, frozen=True)
class Setup:
    """What one check runs."""

    model: str
    """Catalog model."""
    hardware: str
    """Hardware catalog name the profile and plan are for."""
    device: str
    """``cuda`` or ``cpu``."""
    image_sizes: tuple[tuple[int, int], ...]
    """(height, width) of the dataset's images; row k shows image k modulo their count."""
    rows: int
    """Conversations in the dataset."""
    answer_words: Callable[[int], int]
    """Words of row k's answer."""
    pack_tokens: int
    """LLM-token budget of a pack (``plan --pack-tokens``)."""
    global_batch: int
    """Samples per optimizer step (``plan --global-batch``)."""
    precision: str
    """``plan --precision``."""
    vision_seq: tuple[int, ...]
    llm_seq: tuple[int, ...]
    micro_batches: tuple[int, ...]
    """The profile's grid (``python -m runtime.profile --vision-seq/--llm-seq/--micro-batches``)."""
    profile_flags: tuple[str, ...]
    """Further profiler flags."""
    steps: int
    """Optimizer steps of the run."""
    profile_cap_s: float
    run_cap_s: float
    """Each subprocess step's time cap."""
    llm_segments: tuple[int, ...]
    vision_segments: tuple[int, ...]
    """Sequence lengths packed into the varlen check's causal (LLM) and non-causal (vision) batches."""


def gpu_setup(hardware: str, model: str) -> Setup:
    """Qwen2.5-VL-3B on one GPU: images of 224 to 896 px (64 to 1,024 LLM tokens each) in packs of 4,096 tokens."""
    return Setup(
        model=model, hardware=hardware, device="cuda",
        image_sizes=((224, 224), (448, 336), (672, 448), (896, 896), (336, 784), (560, 560)),
        rows=48, answer_words=lambda k: 4 + 23 * k % 97, pack_tokens=4096, global_batch=32, precision="bf16_mixed",
        vision_seq=(256, 4096), llm_seq=(1024, 4096), micro_batches=(1, 2), profile_flags=(),
        steps=10, profile_cap_s=120.0, run_cap_s=150.0,
        llm_segments=(1, 63, 500, 1024, 2048, 460), vision_segments=(64, 256, 1000, 3000),
    )


CPU_DRY = Setup(
    model="qwen2.5-vl-tiny", hardware="cpu", device="cpu",
    image_sizes=((84, 140), (112, 168), (224, 56), (140, 140), (84, 196)),
    rows=10, answer_words=lambda k: 1 + 5 * k % 13, pack_tokens=256, global_batch=4, precision="bf16_mixed",
    vision_seq=(64, 256), llm_seq=(128, 512), micro_batches=(1,),
    profile_flags=("--no-device-bench", "--repeats", "2", "--warmup", "1", "--threads", "1"),
    steps=2, profile_cap_s=90.0, run_cap_s=150.0,
    llm_segments=(1, 7, 30, 50), vision_segments=(4, 16, 44),
)
"""The flow on CPU with the tiny model (what tests/test_gpu_check.py runs)."""


class Report:
    """Prints each step's lines and keeps them, with each step's numbers, for the results files."""

    def __init__(self, out: Path, total_s: float):
        self.out, self.lines, self.results = out, [], {}
        self.deadline = time.monotonic() + total_s

    def say(self, step: str, text: str) -> None:
        line = f"[{step}] {text}"
        print(line, flush=True)
        self.lines.append(line)

    def cap(self, seconds: float) -> float:
        """``seconds``, cut to what is left of the budget."""
        return min(seconds, self.deadline - time.monotonic())

    def save(self) -> None:
        (self.out / "results.txt").write_text("\n".join(self.lines) + "\n")
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, sort_keys=True) + "\n")


def solver_available() -> bool:
    """Whether OR-Tools' CP-SAT imports here."""
    try:
        importlib.import_module("ortools.sat.python.cp_model")
    except ImportError:
        return False
    return True


def gpu_hardware(name: str) -> str | None:
    """The hardware catalog name of a CUDA device name, or None."""
    return next((kind for word, kind in GPU_KINDS.items() if word in name.upper()), None)


def step_env(report: Report, setup: Setup) -> None:
    """The software and device this check runs on."""
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if setup.device == "cuda" else "CPU"
    report.results["env"] = env = {"error": None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "device": device, "hardware": setup.hardware, "model": setup.model, "solver": solver_available()}
    report.say("env", f"torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, {device} as "
               f"{setup.hardware}, model {setup.model}, OR-Tools {'present' if env['solver'] else 'absent'}")


def write_dataset(setup: Setup, folder: Path) -> tuple[Path, Path]:
    """(conversation JSONL, tokenizer folder) in ``folder``: random-pixel images of ``setup.image_sizes``, one
    conversation per row with answers of ``setup.answer_words`` words, and a byte-level tokenizer with the model's
    special-token ids and Qwen2-VL's chat template."""
    import numpy as np
    from PIL import Image

    from planner.catalog import get_model
    from tests.runtime.tokenizer import qwen_special_tokens, save_tokenizer

    rng = np.random.default_rng(0)
    for k, (h, w) in enumerate(setup.image_sizes):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"image{k}.png")
    rows = [{"image": f"image{k % len(setup.image_sizes)}.png",
             "conversations": [{"from": "human", "value": f"<image>\nWhat is in picture {k}?"},
                               {"from": "gpt", "value": " ".join(["thing"] * setup.answer_words(k))}]}
            for k in range(setup.rows)]
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = save_tokenizer(folder / "tokenizer", qwen_special_tokens(get_model(setup.model).hf_config))
    return data, tokenizer


def step_data(report: Report, setup: Setup, work: Path) -> tuple[Path, Path]:
    data, tokenizer = write_dataset(setup, work)
    report.results["data"] = {"rows": setup.rows, "images": [list(s) for s in setup.image_sizes], "error": None}
    sizes = ", ".join(f"{w}x{h}" for h, w in setup.image_sizes)
    report.say("data", f"{setup.rows} conversations over images of {sizes} px -> {data}")
    return data, tokenizer


def run_logged(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> str | None:
    """Run ``command`` from the repository root with its output in ``log``; None if it exited 0, else why not."""
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [environment.get("PYTHONPATH"), str(ROOT)]))
    with open(log, "w") as file:
        try:
            status = subprocess.run(command, cwd=ROOT, stdout=file, stderr=subprocess.STDOUT, env=environment,
                                    timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return f"stopped after its cap of {timeout:.0f} s"
    if status == 0:
        return None
    return f"exit status {status}: {telling_line(log.read_text())[:300]}"


def telling_line(output: str) -> str:
    """What in ``output`` says why it failed: the runtime's one-line refusal, else the last line naming an error
    (``...Error: ...``) other than torchrun's ChildFailedError, else the last line that is not a banner of '='."""
    lines = [line.strip() for line in output.splitlines() if line.strip().strip("=")]
    refusals = [line for line in lines if "runtime: error:" in line]
    errors = [line for line in lines if "error:" in line.lower() and "ChildFailedError" not in line]
    return (refusals or errors or lines or [""])[-1]


def out_of_time(report: Report, step: str) -> None:
    """Say and record that ``step`` had no time left (the check is then incomplete: an error)."""
    report.results[step] = {"error": "skipped: out of time"}
    report.say(step, "skipped: out of time")


def profile_path(setup: Setup, out: Path) -> Path:
    """Where the profile goes: ``profiles/<gpu>/<model>.json`` on a GPU, ``--out`` on the CPU dry run (the
    committed CPU profiles stay as they are)."""
    from planner.profiles import PROFILES_DIR, profile_path as committed

    return out / "profile.json" if setup.device == "cpu" else committed(setup.hardware, setup.model, PROFILES_DIR)


def step_profile(report: Report, setup: Setup, out: Path) -> Path | None:
    """Measure the layer shards at the setup's shapes; the profile's path, or None without one."""
    cap = report.cap(setup.profile_cap_s)
    if cap < MIN_STEP_S:
        return out_of_time(report, "profile")
    path = profile_path(setup, out)
    path.parent.mkdir(parents=True, exist_ok=True)
    ints = lambda values: ",".join(map(str, values))  # noqa: E731
    command = [sys.executable, "-m", "runtime.profile", "--model", setup.model, "--device", setup.device,
               "--hardware", setup.hardware, "--out", str(path), "--tp", "1", "--sp", "1",
               "--vision-seq", ints(setup.vision_seq), "--llm-seq", ints(setup.llm_seq),
               "--micro-batches", ints(setup.micro_batches), "--time-budget", f"{max(cap - PROFILE_SETTLE_S, 5):.0f}",
               *setup.profile_flags]
    start = time.monotonic()
    failure = run_logged(command, out / "profile.log", cap)
    seconds = time.monotonic() - start
    usable = path.exists()
    if usable and path != out / "profile.json":
        shutil.copyfile(path, out / "profile.json")
    report.results["profile"] = {"path": str(path), "seconds": seconds, "error": failure, "usable": usable}
    what = f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}" if usable else "no profile"
    report.say("profile", f"{what} in {seconds:.0f} s" + (f"; {failure} (log: profile.log)" if failure else ""))
    return path if usable else None


def dataset_inputs(setup: Setup, histogram: Any) -> dict[str, Any]:
    """The workload and dataset sections (``planner.inputs``) of a setup's plan over ``histogram``."""
    from planner.inputs import DatasetInputs, WorkloadInputs

    return dict(workload=WorkloadInputs(global_batch=setup.global_batch, precision=setup.precision),
                dataset=DatasetInputs(source=histogram, pack_tokens=setup.pack_tokens))


def one_gpu(setup: Setup, profile: Path | None) -> Any:
    """One GPU of the setup's hardware, costed with ``profile`` (None: analytically)."""
    from planner.inputs import ClusterInputs

    return ClusterInputs(gpus=1, gpu=setup.hardware, profile=str(profile) if profile else None)


def choose_plan(setup: Setup, inputs: dict[str, Any], profile: Path | None, prepared: Path) -> tuple[Any, str]:
    """(plan, how it was made): the solver's over ``inputs`` (``dataset_inputs``) costed with ``profile`` (None:
    analytically) where OR-Tools imports, else the prepared plan's strategy costed so."""
    from planner import api
    from planner.analysis import strategy_of
    from planner.contract.schema import load_plan

    source = "the measured profile" if profile else "the analytical model"
    if solver_available():
        plan = api.plan(setup.model, one_gpu(setup, profile), time_limit_s=SOLVER_TIME_LIMIT_S, **inputs)
        return plan, f"solver on {source}"
    file = prepared / f"{setup.hardware}-{setup.model}.json"
    plan = api.evaluate(setup.model, strategy_of(load_plan(file)), one_gpu(setup, profile), **inputs)
    return plan, f"the prepared {file.name}'s strategy (no solver here) costed with {source}"


def step_plan(report: Report, setup: Setup, data: Path, tokenizer: Path, profile: Path | None, out: Path,
              prepared: Path) -> tuple[Path, Path] | None:
    """(plan the run trains, the same strategy costed analytically), written into ``out``; None if no plan. A plan
    the measured profile refuses (it does not fit by the profile's account) falls back to the analytical model."""
    from planner import api
    from planner.analysis import strategy_of
    from planner.dataset import read_dataset

    inputs = dataset_inputs(setup, read_dataset(str(data), str(tokenizer)))
    try:
        try:
            plan, how = choose_plan(setup, inputs, profile, prepared)
        except ValueError as e:
            if profile is None:
                raise
            report.say("plan", f"with the measured profile: {e}; falling back to the analytical model")
            plan, how = choose_plan(setup, inputs, None, prepared)
        analytical = api.evaluate(setup.model, strategy_of(plan), one_gpu(setup, None), **inputs)
    except (ValueError, OSError) as e:
        report.results["plan"] = {"error": str(e)}
        report.say("plan", f"no plan: {e}")
        return None
    paths = out / "plan.json", out / "plan-analytical.json"
    for p, path in zip((plan, analytical), paths):
        path.write_text(p.to_json())
    modules = "; ".join(f"{m.name}: DP{m.dp} ZeRO-{m.zero} rc={m.recompute} mb={m.micro_batch} ga={m.grad_accum}"
                        for m in plan.modules)
    packs = plan.workload.dataset
    report.results["plan"] = {"how": how, "modules": modules, "step_time_s": plan.predicted.step_time_s,
                              "peak_memory_gib": plan.predicted.peak_memory_gib, "mfu": plan.predicted.mfu}
    report.say("plan", f"{how}: {modules}; {plan.workload.global_batch} packs of <= {packs.pack_tokens:,} tokens "
               f"a step; predicted {plan.predicted.step_time_s:.3f} s/step, {plan.predicted.peak_memory_gib:.1f} GiB, "
               f"MFU {plan.predicted.mfu:.1%} (analytical {analytical.predicted.step_time_s:.3f} s, "
               f"{analytical.predicted.peak_memory_gib:.1f} GiB)")
    return paths


def step_run(report: Report, setup: Setup, plan: Path, data: Path, tokenizer: Path, out: Path) -> dict | None:
    """Train ``plan`` under torchrun (one process, no Ray); the metrics file's summary, or None."""
    cap = report.cap(setup.run_cap_s)
    if cap < MIN_STEP_S:
        return out_of_time(report, "run")
    metrics = out / "metrics.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "runtime", str(plan), "--steps", str(setup.steps), "--metrics", str(metrics),
               "--data", str(data), "--tokenizer", str(tokenizer)]
    env = {"OMP_NUM_THREADS": "1"} if setup.device == "cpu" else {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    start = time.monotonic()
    failure = run_logged(command, out / "run.log", cap, env)
    seconds = time.monotonic() - start
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    summary = json.loads(lines[-1]) if lines and '"summary"' in lines[-1] else None
    failure = failure or (None if summary else "no summary in the metrics")
    report.results["run"] = {"seconds": seconds, "error": failure, "steps": setup.steps}
    if failure:
        report.say("run", f"failed after {seconds:.0f} s: {failure} (log: run.log)")
        return None
    report.say("run", f"{summary['steps']} steps in {seconds:.0f} s under torchrun (start-up included), final loss "
               f"{summary['final_loss']:.4f}")
    return summary


def measured_mfu(summary: dict, plan: Any) -> float:
    """The plan's model FLOPs per LLM token at the measured tokens/s, over the GPU's peak (see the module doc)."""
    return plan.predicted.mfu * summary["tokens_per_s"]["measured"] / plan.predicted.tokens_per_s


def step_compare(report: Report, setup: Setup, summary: dict, plan_paths: tuple[Path, Path]) -> None:
    """Measured against the profiled and the analytical prediction."""
    from planner.contract.schema import load_plan

    plan, analytical = (load_plan(p) for p in plan_paths)
    step, memory = summary["step_time_s"]["measured"], summary["peak_memory_gib"]["measured"]
    mfu = measured_mfu(summary, plan)
    rows = {
        "step_time_s": (step, plan.predicted.step_time_s, analytical.predicted.step_time_s),
        "peak_memory_gib": (memory, plan.predicted.peak_memory_gib, analytical.predicted.peak_memory_gib),
        "mfu": (mfu, plan.predicted.mfu, analytical.predicted.mfu),
        "tokens_per_s": (summary["tokens_per_s"]["measured"], plan.predicted.tokens_per_s,
                         analytical.predicted.tokens_per_s),
    }
    report.results["compare"] = {k: {"measured": m, "predicted": p, "analytical": a, "ratio": m / p}
                                 for k, (m, p, a) in rows.items()}
    formats = {"step_time_s": ("step time", "{:.3f} s"), "peak_memory_gib": ("peak memory", "{:.2f} GiB"),
               "mfu": ("MFU", "{:.1%}"), "tokens_per_s": ("tokens/s", "{:,.0f}")}
    for key, (measured, predicted, analytic) in rows.items():
        label, form = formats[key]
        report.say("compare", f"{label}: measured {form.format(measured)}, predicted {form.format(predicted)} "
                   f"(measured / predicted {measured / predicted:.2f}); analytical {form.format(analytic)}")
    measured_as = "the allocator's max allocated" if setup.device == "cuda" else "the worker's peak RSS"
    report.say("compare", f"peak memory measured is {measured_as}; predicted includes "
               f"{plan.predicted.memory_breakdown_gib.overhead:.1f} GiB of framework overhead")


def segment_starts(lengths: tuple[int, ...], device: Any) -> Any:
    """Cumulative sequence starts (int32, length + 1) of segments packed end to end."""
    import torch

    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


def per_segment_sdpa(q: Any, k: Any, v: Any, lengths: tuple[int, ...], causal: bool) -> Any:
    """SDPA over each segment of packed (tokens, heads, dim) q/k/v on its own: the reference."""
    import torch
    import torch.nn.functional as F

    outs, start = [], 0
    for n in lengths:
        seg = [t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*seg, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out.squeeze(0).transpose(0, 1))
        start += n
    return torch.cat(outs)


def block_mask_sdpa(q: Any, k: Any, v: Any, lengths: tuple[int, ...], causal: bool) -> Any:
    """One SDPA over the whole pack with a block-diagonal (and, if ``causal``, lower-triangular) mask: the CPU
    stand-in for varlen."""
    import torch
    import torch.nn.functional as F

    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = segment[:, None] == segment[None, :]
    if causal:
        mask &= torch.ones_like(mask).tril()
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), attn_mask=mask,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)


def varlen(q: Any, k: Any, v: Any, lengths: tuple[int, ...], causal: bool) -> Any:
    """``varlen_attn`` over the pack, in this torch's spelling: ``window_size`` (torch > 2.10) or ``is_causal``,
    ``enable_gqa`` where it exists, else the KV heads repeated to the query heads."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    starts, longest = segment_starts(lengths, q.device), max(lengths)
    kwargs: dict[str, Any] = ({"window_size": (-1, 0) if causal else (-1, -1)} if "window_size" in params
                              else {"is_causal": causal})
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, starts, starts, longest, longest, **kwargs)


def attend(fn: Callable, q: Any, k: Any, v: Any, grad: Any) -> list[Any]:
    """[output, dq, dk, dv] of ``fn(q, k, v)`` with ``grad`` flowing back into the output."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def agreement(candidate: Callable, lengths: tuple[int, ...], causal: bool, heads: int, kv_heads: int, dim: int,
              device: str) -> dict[str, dict[str, float]]:
    """Per tensor (out, dq, dk, dv): max |candidate - bf16 SDPA|, and each one's max |error| against fp32 SDPA, on
    random bf16 q/k/v packed from segments of ``lengths``; ``passed`` by ``TOLERANCE_FACTOR``."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    tokens = sum(lengths)
    q, k, v, grad = (torch.randn(tokens, h, dim, generator=generator, device=device, dtype=torch.bfloat16)
                     for h in (heads, kv_heads, kv_heads, heads))
    reference = lambda *t: per_segment_sdpa(*t, lengths, causal)  # noqa: E731
    got = attend(lambda *t: candidate(*t, lengths, causal), q, k, v, grad)
    low = attend(reference, q, k, v, grad)
    exact = attend(reference, *(t.float() for t in (q, k, v, grad)))
    result = {}
    for name, g, s, e in zip(("out", "dq", "dk", "dv"), got, low, exact):
        error, sdpa_error = (g.float() - e).abs().max().item(), (s.float() - e).abs().max().item()
        result[name] = {"vs_sdpa": (g.float() - s.float()).abs().max().item(), "vs_fp32": error,
                        "sdpa_vs_fp32": sdpa_error, "passed": error <= TOLERANCE_FACTOR * sdpa_error + TOLERANCE_ATOL}
    return result


def step_varlen(report: Report, setup: Setup) -> None:
    """varlen against per-segment SDPA, causal GQA (the LLM's heads) and non-causal (the vision tower's); on CPU
    the block-mask stand-in. A case whose tensors disagree is the step's error."""
    import torch

    from runtime.models.model import hf_config_from_dict
    from planner.catalog import get_model

    config = hf_config_from_dict(get_model(setup.model).hf_config)
    text, vision = config.text_config, config.vision_config
    cases = {"llm causal": (setup.llm_segments, True, text.num_attention_heads, text.num_key_value_heads,
                            text.hidden_size // text.num_attention_heads),
             "vision non-causal": (setup.vision_segments, False, vision.num_heads, vision.num_heads,
                                   vision.hidden_size // vision.num_heads)}
    if setup.device == "cuda":
        candidate, name = varlen, "varlen_attn"
    else:
        report.say("varlen", "varlen_attn: skipped: no CUDA; checking the harness with a block-mask SDPA instead")
        candidate, name = block_mask_sdpa, "block-mask SDPA"
    report.results["varlen"] = results = {"candidate": name, "error": None}
    for case, (lengths, causal, heads, kv_heads, dim) in cases.items():
        torch.manual_seed(0)
        result = agreement(candidate, lengths, causal, heads, kv_heads, dim, setup.device)
        results[case] = {"segments": list(lengths), "heads": [heads, kv_heads, dim], **result}
        ok = all(r["passed"] for r in result.values())
        if not ok:
            results["error"] = ", ".join(filter(None, [results["error"], f"{case} disagrees"]))
        errors = ", ".join(f"{t} {r['vs_sdpa']:.2e} (fp32: {r['vs_fp32']:.2e} vs SDPA's {r['sdpa_vs_fp32']:.2e})"
                           for t, r in result.items())
        report.say("varlen", f"{name} vs per-segment SDPA, {case}, segments {list(lengths)}, heads {heads}/{kv_heads}"
                   f" x {dim}: max |diff| {errors}: {'PASS' if ok else 'FAIL'} (within {TOLERANCE_FACTOR:g}x bf16 "
                   "SDPA's own error)")


def guarded(report: Report, step: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, or None after saying what it raised (the steps after it go on)."""
    try:
        return fn(*args)
    except Exception as e:  # a fault of one step must not lose the others' results
        message = " ".join(f"{type(e).__name__}: {e}".split())[:500]
        report.results[step] = {**report.results.get(step, {}), "error": message}
        report.say(step, f"failed: {message}")
        return None


def check(setup: Setup, out: Path, work: Path, prepared: Path, total_s: float) -> int:
    """The whole flow; exit status 0 when every step that ran succeeded, 1 otherwise."""
    report = Report(out, total_s)
    guarded(report, "env", step_env, report, setup)
    written = guarded(report, "data", step_data, report, setup, work)
    if written:
        data, tokenizer = written
        profile = guarded(report, "profile", step_profile, report, setup, out)
        plans = guarded(report, "plan", step_plan, report, setup, data, tokenizer, profile, out, prepared)
        summary = plans and guarded(report, "run", step_run, report, setup, plans[0], data, tokenizer, out)
        if summary:
            guarded(report, "compare", step_compare, report, setup, summary, plans)
    guarded(report, "varlen", step_varlen, report, setup)
    failed = [step for step, result in report.results.items() if result.get("error")]
    report.say("done", f"{'all steps passed' if not failed else 'failed: ' + ', '.join(failed)}; results in {out}")
    report.results["failed"] = failed
    report.save()
    return 1 if failed else 0


def prepare(setups: list[Setup], work: Path, prepared: Path) -> int:
    """The solver's plan for each setup on the analytical model, into ``prepared`` (needs OR-Tools); 1 if a setup
    has none (said in one line)."""
    from planner import api
    from planner.dataset import read_dataset

    prepared.mkdir(parents=True, exist_ok=True)
    status = 0
    for setup in setups:
        folder = work / setup.hardware
        folder.mkdir(parents=True, exist_ok=True)
        data, tokenizer = write_dataset(setup, folder)
        try:
            plan = api.plan(setup.model, one_gpu(setup, None), time_limit_s=SOLVER_TIME_LIMIT_S,
                            **dataset_inputs(setup, read_dataset(str(data), str(tokenizer))))
        except ValueError as e:
            print(f"no plan for {setup.model} on {setup.hardware}: {e}", file=sys.stderr)
            status = 1
            continue
        path = prepared / f"{setup.hardware}-{setup.model}.json"
        path.write_text(plan.to_json())
        print(f"wrote {path}: {plan.predicted.step_time_s:.3f} s/step, {plan.predicted.peak_memory_gib:.1f} GiB")
    return status


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/gpu; --cpu-dry: a new "
                   "temporary folder)")
    p.add_argument("--cpu-dry", action="store_true", help="the flow on CPU with the tiny model; CUDA calls skipped")
    p.add_argument("--prepare", action="store_true", help="write the plans the GPU run starts from (needs OR-Tools)")
    p.add_argument("--model", default="qwen2.5-vl-3b", help="catalog model of the GPU check (default qwen2.5-vl-3b)")
    p.add_argument("--hardware", help="hardware catalog name of this GPU (default: from its device name)")
    p.add_argument("--prepared", type=Path, default=PREPARED, help="folder of the prepared plans")
    p.add_argument("--work", type=Path, help="folder for the dataset and tokenizer (default: a temporary one)")
    p.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds the whole check may take")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        if args.prepare:
            kinds = [CPU_DRY] if args.cpu_dry else [gpu_setup(k, args.model) for k in ("h100-80gb", "h200-141gb")]
            return prepare(kinds, work, args.prepared)
        setup = CPU_DRY if args.cpu_dry else cuda_setup(args)
        if setup is None:
            return 2
        out = args.out or (RESULTS if not args.cpu_dry else Path(tempfile.mkdtemp(prefix="gpu-check-cpu-dry-")))
        out.mkdir(parents=True, exist_ok=True)
        return check(setup, out, work, args.prepared, args.budget)


def cuda_setup(args: argparse.Namespace) -> Setup | None:
    """The GPU check's setup for this machine's GPU, or None (said in one line) without a known one."""
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: error: torch sees no CUDA device; --cpu-dry runs the flow on CPU", file=sys.stderr)
        return None
    name = torch.cuda.get_device_name(0)
    hardware = args.hardware or gpu_hardware(name)
    if hardware is None:
        print(f"gpu_check: error: {name} is not in the hardware catalog: give --hardware (plan --list-gpus)",
              file=sys.stderr)
        return None
    return gpu_setup(hardware, args.model)


if __name__ == "__main__":
    sys.exit(main())

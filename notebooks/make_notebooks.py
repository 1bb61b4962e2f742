"""Write the notebooks of this folder (without outputs) from the cell sources below.

    .venv/bin/python notebooks/make_notebooks.py          # (re)write compare_plans, scaling, fidelity .ipynb
    .venv/bin/python notebooks/make_notebooks.py --check  # exit 1 if a committed notebook differs

Edit the cells here, not in Jupyter, so the committed notebooks stay output-free and reviewable as code.
``tests/test_notebooks.py`` executes them and checks their figures and conclusions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
%matplotlib inline
import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import Markdown, display

pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 30)"""

COMPARE_PLANS = [
    new_markdown_cell("""\
# Per-module plans vs uniform baselines for Qwen2.5-VL-32B

**Question:** when Qwen2.5-VL-32B is trained on 8 or 16 H100s, how much faster is the planner's per-module plan
(its own degrees for the vision encoder and the LLM, colocated or disjoint) than the two layouts people use
today -- uniform tensor parallelism (Megatron-style, the same TP for every module) and ZeRO-3 (FSDP) -- as the
image grows from 448x448 (1,024 vision tokens) to 3584x3584 (65,536 vision tokens), where does each one's
memory go, and at which image size does each stop fitting? Every number is the planner's cost-model prediction
(`planner.analysis.sweep`, baselines costed by the same model), with the default batch of 4 samples per GPU and
512 text tokens per sample."""),
    new_code_cell(SETUP + """
from planner.analysis import (STRATEGY_LABELS, longest_sequences, plot_longest_sequences, plot_memory,
                              plot_throughput, sweep)

MODEL, GPUS = "qwen-vl-32b", [8, 16]
SIDES = [448, 896, 1344, 1792, 2688, 3584]  # square images: 1,024 ... 65,536 vision tokens
table = sweep(MODEL, gpus=GPUS, image_sizes=SIDES, baselines=True)
table[["num_gpus", "image", "vision_tokens", "strategy", "feasible", "placement", "vision_sp", "llm_tp", "llm_cp",
       "llm_zero", "llm_recompute", "step_time_s", "tokens_per_s", "mfu", "peak_memory_gib",
       "speedup_vs_best_baseline"]].round(3)"""),
    new_markdown_cell("""\
## Throughput
LLM tokens per second of each strategy (an x marks a baseline's last image size that fits)."""),
    new_code_cell("""\
fig, axes = plt.subplots(1, len(GPUS), figsize=(12, 4), sharey=True)
for ax, n in zip(axes, GPUS):
    plot_throughput(table[table.num_gpus == n], ax)
    ax.set_title(f"Qwen2.5-VL-32B on {n} x H100")
plt.show()"""),
    new_markdown_cell("""\
## Speed-up of the planner's plan
Baseline step time / plan step time, at every image size where the baseline fits."""),
    new_code_cell("""\
auto = table[(table.strategy == "auto") & table.feasible]
speedup = auto.pivot(index="vision_tokens", columns="num_gpus",
                     values=["speedup_vs_uniform_tp", "speedup_vs_zero3"])
speedup.columns = [f"vs {STRATEGY_LABELS[c.removeprefix('speedup_vs_')]}, {n} GPUs" for c, n in speedup.columns]
ax = speedup.plot.bar(figsize=(10, 4), rot=0)
ax.axhline(1.0, color="black", linewidth=0.8)
ax.set_xlabel("vision tokens per sample")
ax.set_ylabel("speed-up over baseline")
plt.show()
speedup.round(2)"""),
    new_markdown_cell("""\
## Memory per GPU
Breakdown on the GPU with the peak, for every strategy that fits (weights, gradients and optimizer states
are the model states; activations grow with the image)."""),
    new_code_cell("""\
fig, axes = plt.subplots(1, len(GPUS), figsize=(14, 5), sharey=True)
for ax, n in zip(axes, GPUS):
    plot_memory(table[table.num_gpus == n], ax,
                label=lambda r: f"{r.vision_tokens // 1024}K {STRATEGY_LABELS[r.strategy]}")
    ax.set_title(f"{n} x H100")
axes[0].get_legend().remove()
axes[-1].legend(loc="upper left", bbox_to_anchor=(1, 1))
plt.tight_layout()
plt.show()"""),
    new_markdown_cell("""\
## Where each strategy stops fitting
The points no strategy member fits, with the planner's reason, and the longest square image (vision tokens per
sample) each strategy fits at this batch: `planner.api.max_seq` for the planner, a bisection over each baseline's
family for the baselines."""),
    new_code_cell("""\
display(table[~table.feasible][["num_gpus", "image", "strategy", "reason"]])
longest = longest_sequences(MODEL, GPUS)
fig, ax = plt.subplots(figsize=(6, 4))
plot_longest_sequences(longest, ax)
plt.show()
longest"""),
    new_markdown_cell("""\
## Planning for a dataset instead of one image size
Real data mixes thumbnails with 4K screenshots. `planner.analysis.dataset_comparison` plans Qwen2.5-VL-32B on 16
H100s for a mixed-resolution workload (`mixed_resolution_histogram`: a stated, made-up mixture of web photos,
camera photos and screenshots, 5,000 samples) in four ways -- for the dataset packed into packs of a token
budget (`plan --dataset`), for the dataset with every sample alone, for its mean image and for its largest image
-- and costs each plan on the dataset as it runs: step time over the mean micro-batch, memory for the heaviest."""),
    new_code_cell("""\
from planner.analysis import dataset_comparison, mixed_resolution_histogram

data = dataset_comparison(MODEL, 16, mixed_resolution_histogram())
usable = data.attrs["usable_gib"]
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
data.dataset_tokens_per_s.plot.barh(ax=left, color=["C0" if f else "C3" for f in data.fits_heaviest_micro_batch])
left.set_xlabel("LLM tokens/s on the dataset (red: does not fit)")
data.dataset_peak_memory_gib.plot.barh(ax=right)
right.axvline(usable, color="black", linewidth=0.8)
right.set_xlabel(f"peak GiB per GPU on the heaviest micro-batch ({usable:.0f} usable)")
right.set_yticklabels([])
plt.tight_layout()
plt.show()
data.round(2)"""),
    new_markdown_cell("""\
## Mixture-of-experts LLMs
Qwen3-VL-30B-A3B and -235B-A22B: the planner searches expert parallelism (`ep`: the LLM's experts, whole, over an
EP group of ep of its dp x sp ranks with all their TP ranks) with the other degrees. Its plan against the
baselines, each a speed-up (baseline step time / plan step time; empty where the baseline does not fit), among them
the Megatron-style TP x EP x PP."""),
    new_code_cell("""\
import planner

MOE_CASES = [("qwen3-vl-30b-a3b", 8), ("qwen3-vl-30b-a3b", 16), ("qwen3-vl-235b-a22b", 64),
             ("qwen3-vl-235b-a22b", 256)]
rows = []
for model, gpus in MOE_CASES:
    p = planner.plan(model, gpus)
    llm = p.module("llm")
    rows.append({"model": model, "GPUs": gpus, "LLM": f"DP{llm.dp} TP{llm.tp} CP{llm.cp} EP{llm.ep} PP{llm.pp} ZeRO{llm.zero}",
                 "step s": p.predicted.step_time_s, "tokens/s": p.predicted.tokens_per_s,
                 "peak GiB": p.predicted.peak_memory_gib,
                 **{f"vs {name}": b.speedup for name, b in p.baselines.items()}})
moe = pd.DataFrame(rows)
moe.round(2)"""),
    new_markdown_cell("""\
30B-A3B on 16 H100s as the image grows (the sides of the sweep above), and for one 64-frame 448 px video clip per
sample: the vision tower's layout follows the image while the LLM keeps its experts split."""),
    new_code_cell("""\
def moe_row(label, workload):
    p = planner.plan("qwen3-vl-30b-a3b", 16, workload=workload)
    vision, llm = p.module("vision"), p.module("llm")
    return {"workload": label, "vision": f"DP{vision.dp} SP{vision.sp} TP{vision.tp} ZeRO{vision.zero}",
            "LLM": f"DP{llm.dp} SP{llm.sp} TP{llm.tp} EP{llm.ep} ZeRO{llm.zero}", "step s": p.predicted.step_time_s,
            **{f"vs {name}": b.speedup for name, b in p.baselines.items()}}

moe_sweep = pd.DataFrame([moe_row(f"{side} px image", planner.WorkloadInputs(image_sizes=[(side, side)]))
                          for side in SIDES]
                         + [moe_row("64 x 448 px clip", planner.WorkloadInputs(image_sizes=[], videos=[(64, 448, 448)]))])
moe_sweep.round(2)"""),
    new_markdown_cell("""\
## Hybrid linear-attention LLMs
Qwen3.5 / Qwen3.6 (dense 27B, MoE 35B-A3B): three Gated DeltaNet layers (time and memory linear in the sequence)
for every gated full-attention layer, priced per layer kind; TP and Ulysses SP split both kinds of heads. The
planner's plan on 16 H100s against the same baselines."""),
    new_code_cell("""\
HYBRID_CASES = [("qwen3.5-27b", 16), ("qwen3.6-35b-a3b", 16)]
rows = []
for model, gpus in HYBRID_CASES:
    p = planner.plan(model, gpus)
    vision, llm = p.module("vision"), p.module("llm")
    rows.append({"model": model, "GPUs": gpus, "vision": f"DP{vision.dp} SP{vision.sp} TP{vision.tp} ZeRO{vision.zero}",
                 "LLM": f"DP{llm.dp} SP{llm.sp} TP{llm.tp} EP{llm.ep} PP{llm.pp} ZeRO{llm.zero}",
                 "step s": p.predicted.step_time_s, "peak GiB": p.predicted.peak_memory_gib,
                 **{f"vs {name}": b.speedup for name, b in p.baselines.items()}})
hybrid = pd.DataFrame(rows)
hybrid.round(2)"""),
    new_markdown_cell("## Conclusion"),
    new_code_cell("""\
def speedup_span(n):
    s = auto[auto.num_gpus == n].speedup_vs_best_baseline.dropna()
    verb = "faster" if s.min() >= 1 else "slower" if s.max() < 1 else "slower to faster"
    return f"{s.min():.2f}x to {s.max():.2f}x {verb} (median {s.median():.2f}x)"

def fit_note(n):
    rows = table[table.num_gpus == n]
    fitting = rows[rows.feasible].groupby("vision_tokens").strategy.apply(set)
    only = [t for t, strategies in fitting.items() if strategies == {"auto"}]
    nothing = sorted(set(rows.vision_tokens) - set(fitting.index))
    notes = [f"{what} at {', '.join(f'{t:,}' for t in sizes)} vision tokens"
             for what, sizes in (("only the planner's plan fits", only), ("nothing fits", nothing)) if sizes]
    return f"On {n} GPUs {' and '.join(notes)}." if notes else f"On {n} GPUs a baseline fits at every image size."

def longest_text(n):
    rows = longest[longest.num_gpus == n].set_index("strategy").vision_tokens
    return ", ".join(f"{STRATEGY_LABELS[s]} {t:,.0f}" if t == t else f"{STRATEGY_LABELS[s]} none"
                     for s, t in rows.items())

def dataset_note():
    packed = data.iloc[0]
    mean, largest = data.iloc[2], data.iloc[3]
    mean_fit = "fits" if mean.fits_heaviest_micro_batch else (
        f"does not fit its heaviest micro-batch ({mean.dataset_peak_memory_gib:.0f} of {usable:.0f} GiB)")
    return (f"On the mixed-resolution dataset, the plan made for the dataset runs {packed.dataset_tokens_per_s:,.0f} "
            f"tokens/s; the plan made for the mean image promised {mean.promised_tokens_per_s:,.0f} and {mean_fit}; "
            f"the plan made for the largest image fits but runs {largest.dataset_tokens_per_s:,.0f} tokens/s "
            f"({packed.dataset_tokens_per_s / largest.dataset_tokens_per_s:.2f}x slower).")

def moe_note():
    parts = [f"{r.model} on {r.GPUs}: {r.LLM}, " + (f"{r['vs megatron']:.2f}x the Megatron-style TP x EP x PP"
             if r["vs megatron"] == r["vs megatron"] else "where the Megatron-style TP x EP x PP does not fit")
             for _, r in moe.iterrows()]
    megatron = moe_sweep["vs megatron"]
    sweep = (f" For 30B-A3B on 16 GPUs from 448 to 3584 px images and a 64-frame clip the plan is "
             f"{megatron.min():.2f}x to {megatron.max():.2f}x the Megatron-style where it fits "
             f"({int(megatron.isna().sum())} of {len(megatron)} workloads it does not).")
    return "Mixture-of-experts LLMs, the planner's LLM layout: " + "; ".join(parts) + "." + sweep

def hybrid_note():
    parts = [f"{r.model} on {r.GPUs}: LLM {r.LLM}, {r['vs uniform_tp']:.2f}x uniform TP and {r['vs zero3']:.2f}x ZeRO-3"
             for _, r in hybrid.iterrows()]
    return "Hybrid linear-attention LLMs: " + "; ".join(parts) + "."

states = auto[["weights_gib", "gradients_gib", "optimizer_gib"]].sum(axis=1) / auto.peak_memory_gib
display(Markdown(
    f"Over the best baseline that fits, the planner's plan for Qwen2.5-VL-32B is {speedup_span(16)} on 16 H100s "
    f"and {speedup_span(8)} on 8 H100s. {fit_note(8)} {fit_note(16)} "
    f"The longest square image per sample that fits is, on 16 GPUs: {longest_text(16)} vision tokens; on 8 GPUs: "
    f"{longest_text(8)}. Model states (weights, gradients, optimizer) take {states.min():.0%} to {states.max():.0%} "
    f"of the planner's peak-GPU memory. " + dataset_note() + " " + moe_note() + " " + hybrid_note()
))"""),
]

SCALING = [
    new_markdown_cell("""\
# Scaling: 8 to 1024 GPUs, Qwen2.5-VL 3B to 72B

**Question:** how do predicted throughput and MFU of the planner's best plan change from 8 to 1024 H100s for
Qwen2.5-VL 3B, 7B, 32B and 72B (default workload: one 1344x1344 image + 512 text tokens per sample, 4 samples per
GPU, so the batch grows with the cluster), is it better to run the vision encoder and the LLM on the same GPUs
(colocated) or on disjoint GPU groups (a two-stage pipeline), and which module binds the step time? The plans here
are searched without ring context parallelism (`SearchOptions(allow_ring_cp=False)`, `plan --no-cp`) to keep the
1,024-GPU sweeps quick: with it each of those plans takes about 5x longer to find; compare_plans searches it."""),
    new_code_cell(SETUP + """
from planner.analysis import sweep
from planner.inputs import SearchOptions

MODELS = ["qwen-vl-3b", "qwen-vl-7b", "qwen-vl-32b", "qwen-vl-72b"]
GPUS = [8, 64, 1024]
NO_CP = SearchOptions(allow_ring_cp=False)
table = sweep(MODELS, gpus=GPUS, placements=["colocated", "disjoint"], search=NO_CP)
table["tokens_per_s_per_gpu"] = table.tokens_per_s / table.num_gpus
table[["model", "num_gpus", "requested_placement", "feasible", "vision_gpus", "llm_gpus", "llm_tp", "llm_cp",
       "llm_zero", "tokens_per_s", "mfu", "binding_module", "peak_memory_gib"]].round(3)"""),
    new_markdown_cell("## Throughput and MFU (solid: colocated, dashed: disjoint)"),
    new_code_cell("""\
fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
fitting = table[table.feasible]
colors = {model: f"C{i}" for i, model in enumerate(table.model.unique())}
for (model, placement), rows in fitting.groupby(["model", "requested_placement"], sort=False):
    style = "-" if placement == "colocated" else "--"
    left.plot(rows.num_gpus, rows.tokens_per_s, style, marker="o", color=colors[model], label=f"{model} {placement}")
    right.plot(rows.num_gpus, 100 * rows.mfu, style, marker="o", color=colors[model])
left.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="LLM tokens / s")
right.set(xscale="log", xlabel="GPUs", ylabel="MFU (%)", ylim=(0, None))
left.legend(fontsize="small")
for ax in (left, right):
    ax.grid(True, alpha=0.3)
plt.show()"""),
    new_markdown_cell("""\
## Colocated vs disjoint
Throughput of the colocated plan over the disjoint plan (>1: colocated is faster), and the module that binds
each plan's step time."""),
    new_code_cell("""\
ratio = fitting.pivot(index="model", columns=["num_gpus", "requested_placement"], values="tokens_per_s")
colocated_gain = (ratio.xs("colocated", axis=1, level=1) / ratio.xs("disjoint", axis=1, level=1))
ax = colocated_gain.plot.bar(figsize=(8, 4), rot=0)
ax.axhline(1.0, color="black", linewidth=0.8)
ax.set_ylabel("colocated / disjoint throughput")
plt.show()
display(colocated_gain.round(2))
display(table.pivot(index="model", columns=["num_gpus", "requested_placement"], values="binding_module"))
table[~table.feasible][["model", "num_gpus", "requested_placement", "reason"]]"""),
    new_markdown_cell("""\
## Pipeline parallelism: Qwen2.5-VL-72B and -32B on 64 to 1024 H100s
The planner searches the LLM's pipeline parallelism by default (1F1B, interleaved 1F1B and interleaved
zero-bubble, stages balanced on time, the vision tower feeding stage 0), on the catalog's H100 nodes (400 Gb/s
per GPU between nodes) and on the same nodes behind a 50 Gb/s-per-GPU network. `pp gain` is the best plan's
throughput over the best plan on the other side of PP (>1: pipelining pays; <1 never happens when the best plan
does not pipeline, the row then shows what the best pipelined plan would lose)."""),
    new_code_cell("""\
import os, tempfile

slow = os.path.join(tempfile.mkdtemp(), "slow_network.yaml")
with open(slow, "w") as f:
    f.write("device: h100-80gb\\ninter_node_bandwidth: 6.25e9\\n")
pp_rows = []
for network, extra in (("400 Gb/s", {}), ("50 Gb/s", {"cluster_file": slow})):
    part = sweep(["qwen-vl-72b", "qwen-vl-32b"], gpus=[64, 256, 1024], search=NO_CP, **extra)
    pp_rows.append(part.assign(network=network))
pp = pd.concat(pp_rows, ignore_index=True)
pp["pipelined"] = pp.llm_pp > 1
pp["pp_gain"] = pp.speedup_vs_without_pp.where(pp.pipelined, 1 / pp.speedup_vs_with_pp)
pp[["model", "num_gpus", "network", "placement", "llm_pp", "llm_tp", "llm_dp", "llm_zero", "tokens_per_s", "mfu",
    "pp_gain", "binding_module", "peak_memory_gib"]].round(3)"""),
    new_code_cell("""\
ax = pp.pivot(index=["model", "num_gpus"], columns="network", values="pp_gain").plot.bar(figsize=(9, 4), rot=20)
ax.axhline(1.0, color="black", linewidth=0.8)
ax.set_ylabel("best plan / best plan on the other side of PP")
plt.show()"""),
    new_markdown_cell("## Conclusion"),
    new_code_cell("""\
def weak_scaling(model):
    rows = fitting[(fitting.model == model) & (fitting.requested_placement == "colocated")].sort_values("num_gpus")
    first, last = rows.iloc[0], rows.iloc[-1]
    return (f"{model} {last.tokens_per_s / first.tokens_per_s:.0f}x from {first.num_gpus} to {last.num_gpus} GPUs "
            f"(per-GPU throughput x{last.tokens_per_s_per_gpu / first.tokens_per_s_per_gpu:.2f})")

def pp_note():
    chosen, others = pp[pp.pipelined], pp[~pp.pipelined]
    picked = "; ".join(f"{r.model} on {r.num_gpus} GPUs behind {r.network} (PP{r.llm_pp}, {r.pp_gain:.2f}x over "
                       f"the best plan without)" for r in chosen.itertuples()) or "none"
    losses = (1 / others.pp_gain).dropna()
    lost = (f" Elsewhere the best pipelined plan is {losses.min():.2f}x to {losses.max():.2f}x slower than the best "
            f"plan without PP." if len(losses) else "")
    return f"With pipeline parallelism in the search it pipelines the LLM at {len(chosen)} of {len(pp)} points: {picked}." + lost

gains = colocated_gain.stack().dropna()
binding = fitting.binding_module.value_counts()
missing = table[~table.feasible]
display(Markdown(
    f"From the smallest GPU count that fits to the largest, the colocated plan's throughput grows: "
    f"{'; '.join(weak_scaling(model) for model in colors)}. "
    f"MFU stays between {fitting.mfu.min():.0%} and {fitting.mfu.max():.0%} over all {len(fitting)} plans that fit. "
    f"Colocated beats disjoint at {(gains > 1).sum()} of {len(gains)} points where both fit "
    f"(throughput ratio {gains.min():.2f}x to {gains.max():.2f}x, median {gains.median():.2f}x). "
    f"The binding module is {', '.join(f'{m} in {c}' for m, c in binding.items())} of the {len(fitting)} plans. "
    f"{len(missing)} points do not fit: "
    f"{'; '.join(f'{r.model} on {r.num_gpus} GPUs {r.requested_placement}' for r in missing.itertuples())}. "
    + pp_note()
))"""),
]

FIDELITY = [
    new_markdown_cell("""\
# Fidelity: the cost model against measurements

**Question:** how close are the planner's analytical predictions to what was measured? Layer by layer, the
committed profiles give measured forward + backward time of every layer shard of the small CPU fidelity model
(`profiles/cpu/qwen2.5-vl-cpu-small.json`, one thread, fp32) and the bytes autograd saves for backward (that CPU
profile, and the FakeTensor memory profile of Qwen2.5-VL-32B, `profiles/fake/qwen2.5-vl-32b.json`); next to each
we put the analytical model at the same shard, on the device numbers the profile measured (matmul FLOP/s, memory
bandwidth) and at the profile's dtype (`planner.analysis.layer_fidelity`) -- the error of the formulas alone, which
a profile replaces when the planner has one. End to end, the fidelity
benchmark (`benchmarks/fidelity_cpu.py --json benchmarks/results/fidelity_cpu.json`) plans pinned strategies with
the CPU profile, trains them with the runtime, and records predicted vs measured step time; it is shown when its
results file is present. Error = predicted / measured - 1."""),
    new_code_cell(SETUP + """
from planner.analysis import layer_fidelity, load_fidelity_results
from planner.profiles import PROFILES_DIR

ROOT = PROFILES_DIR.parent
RESULTS = ROOT / "benchmarks" / "results" / "fidelity_cpu.json"
layers = pd.concat([
    layer_fidelity(PROFILES_DIR / "cpu" / "qwen2.5-vl-cpu-small.json",
                   str(ROOT / "benchmarks" / "qwen2.5-vl-cpu-small")),
    layer_fidelity(PROFILES_DIR / "fake" / "qwen2.5-vl-32b.json"),
], ignore_index=True)
layers = layers[layers.measured > 0]  # layers that save nothing have no relative error
layers.groupby(["quantity", "source", "layer"]).error.agg(["count", "median", "min", "max"]).round(3)"""),
    new_markdown_cell("""\
## Predicted vs measured, per layer shard
Log-log, with the y = x line; a point with a zero prediction (a layer the model says saves nothing) cannot be
drawn on a log axis and is counted in the histograms only."""),
    new_code_cell("""\
colors = {layer: f"C{i}" for i, layer in enumerate(sorted(layers.layer.unique()))}

def scatter(ax, rows, title, unit):
    drawn = rows[rows.predicted > 0]
    for name, group in drawn.groupby("layer"):
        ax.scatter(group.measured, group.predicted, s=12, color=colors[name], label=name)
    low, high = drawn[["measured", "predicted"]].min().min(), drawn[["measured", "predicted"]].max().max()
    ax.plot([low, high], [low, high], color="black", linewidth=0.8, label="y = x")
    ax.set(xscale="log", yscale="log", xlabel=f"measured ({unit})", ylabel=f"predicted ({unit})", title=title)
    ax.legend(fontsize="x-small")

timed = layers[layers.quantity == "time_s"]
saved = layers[layers.quantity == "activation_bytes"]
fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
scatter(axes[0], timed, "layer fwd+bwd time, CPU profile", "s")
for ax, (source, rows) in zip(axes[1:], saved.groupby("source")):
    scatter(ax, rows, f"saved activations, {source}", "bytes")
plt.tight_layout()
plt.show()"""),
    new_markdown_cell("## Error histograms"),
    new_code_cell("""\
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
axes[0].hist(100 * timed.error, bins=30)
axes[0].set(xlabel="time error (%)", ylabel="layer shards", title="layer time, CPU profile")
for source, rows in saved.groupby("source"):
    axes[1].hist(100 * rows.error, bins=30, alpha=0.6, label=source)
axes[1].set(xlabel="saved-activation error (%)", title="saved activations")
axes[1].legend(fontsize="small")
plt.show()"""),
    new_markdown_cell("""\
## End to end: the fidelity benchmark
Predicted vs measured step time of each planned-and-run configuration, when
`benchmarks/results/fidelity_cpu.json` exists."""),
    new_code_cell("""\
steps = load_fidelity_results(RESULTS) if RESULTS.is_file() else None
if steps is None:
    display(Markdown(f"No results file at `{RESULTS.relative_to(ROOT)}`: run "
                     "`benchmarks/fidelity_cpu.py --json benchmarks/results/fidelity_cpu.json` to add this part."))
else:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.scatter(steps.measured_s, steps.predicted_s)
    high = max(steps.measured_s.max(), steps.predicted_s.max())
    left.plot([0, high], [0, high], color="black", linewidth=0.8, label="y = x")
    left.set(xlabel="measured step time (s)", ylabel="predicted step time (s)", title="fidelity benchmark")
    left.legend()
    right.hist(100 * steps.error, bins=10)
    right.set(xlabel="step-time error (%)", ylabel="configurations")
    plt.show()
    display(steps)"""),
    new_markdown_cell("""\
## One step, predicted and measured
`plan --trace` writes a plan's predicted step as a Chrome trace (what each GPU group computes and communicates,
when, as the cost model prices it; it ends at the plan's step time), `python -m runtime --trace DIR` every measured
step in the same format (the spans the trainer times, per rank). `benchmarks/step_timeline.py` made both for one
plan, the fidelity benchmark's "2w disjoint mb1" (vision on one CPU worker, the LLM on the other, 4 micro-batches),
and kept the fastest measured step after the first: `benchmarks/results/step_timeline/`. Blue forward, orange
backward, red optimizer, grey communication (measured: waits for the hand-off); open the files in ui.perfetto.dev
for every span's seconds; summed over the step below."""),
    new_code_cell("""\
import json

from planner.analysis import plot_step_trace
from planner.contract.trace_format import makespan_s

TIMELINE = ROOT / "benchmarks" / "results" / "step_timeline"
predicted, measured = (json.loads((TIMELINE / f"{kind}.json").read_text()) for kind in ("predicted", "measured"))
until = max(t["otherData"]["step_time_s"] for t in (predicted, measured))
fig, axes = plt.subplots(1, 2, figsize=(16, 3.5), sharey=False)
plot_step_trace(predicted, axes[0], title="predicted (plan --trace)", until_s=until)
plot_step_trace(measured, axes[1], title="measured (python -m runtime --trace)", until_s=until)
plt.tight_layout()
plt.show()

def span_seconds(trace, key):
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] != "step"]
    return pd.DataFrame([(e["name"], e["args"][key]) for e in spans], columns=["span", key]).groupby("span").sum()

spans = span_seconds(predicted, "predicted_s").join(span_seconds(measured, "measured_s"), how="outer")
spans"""),
    new_markdown_cell("""\
## A run that corrects its plan (`--adapt`)
`benchmarks/adapt.py --save benchmarks/results/adapt` ran each case's plan on 2 CPU workers twice, without and with
`--adapt 3`: after 3 measured steps the adaptive run timed its collectives, fitted the cost model to its own spans,
re-planned, and decided (runtime.md, "Adaptive runs"). Per step below: measured step time of both runs; the plan's
own prediction and, under the fit, the running plan's and the new plan's; the decision's step marked."""),
    new_code_cell("""\
ADAPT = ROOT / "benchmarks" / "results" / "adapt"
CASES = {"wrong": "interconnect called 100x faster", "right": "the cpu entry's numbers", "tp2": "hand-made TP2"}


def run_metrics(path):
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step = pd.DataFrame([r for r in records if "loss" in r]).drop_duplicates("step", keep="last").set_index("step")
    return by_step, [r for r in records if r.get("event") == "adapt"]


runs = {case: (run_metrics(ADAPT / f"{case}-fixed.jsonl")[0], *run_metrics(ADAPT / f"{case}-adaptive.jsonl"))
        for case in CASES if (ADAPT / f"{case}-adaptive.jsonl").is_file()}
adapted = []
if runs:
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.5), squeeze=False)
    for ax, (case, (fixed, adaptive, events)) in zip(axes[0], runs.items()):
        fit, end = events[0], adaptive.index.max()
        ax.plot(fixed.index, fixed.step_time_s, color="grey", alpha=0.6, label="measured, fixed plan")
        ax.plot(adaptive.index, adaptive.step_time_s, color="C0", label="measured, --adapt")
        ax.hlines(fit["planned_step_s"], 0, end, color="black", linestyles=":", label="planned")
        ax.hlines(fit["current_fitted_s"], 0, end, color="C1", linestyles="--", label="running plan, fitted")
        ax.hlines(fit["new_fitted_s"], fit["step"], end, color="C2", linestyles="--", label="new plan, fitted")
        ax.axvline(fit["step"], color="C3", linewidth=0.8)
        ax.set(yscale="log", xlabel="step", ylabel="step time (s)", title=f"{CASES[case]}: {fit['decision']}")
        after = adaptive[adaptive.index >= fit["step"] + 1].step_time_s.median()
        adapted.append({"case": CASES[case], "decision": fit["decision"], "planned_s": fit["planned_step_s"],
                        "measured_before_s": fit["measured"]["step_time_s"], "running_fitted_s": fit["current_fitted_s"],
                        "new_fitted_s": fit["new_fitted_s"], "measured_after_s": after,
                        "fixed_after_s": fixed[fixed.index >= fit["step"] + 1].step_time_s.median(),
                        "check": events[1]["decision"] if len(events) > 1 else None})
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1, 1))
    plt.tight_layout()
    plt.show()
    adapted = pd.DataFrame(adapted).set_index("case")
    display(adapted.round(3))
else:
    display(Markdown("Run `benchmarks/adapt.py --save benchmarks/results/adapt` to add this part."))"""),
    new_markdown_cell("## Conclusion"),
    new_code_cell("""\
def summary(rows):
    errors = rows.error.abs()
    by_layer = rows.groupby("layer").error.median()
    worst = by_layer.abs().idxmax()
    return (f"median |error| {errors.median():.0%} over {len(rows)} shards, {(errors <= 0.25).mean():.0%} within 25%; "
            f"the worst layer type is {worst} (median error {by_layer[worst]:+.0%})")

parts = [f"Layer times on the CPU profile: {summary(timed)}."]
parts += [f"Saved activations, {source}: {summary(rows)}." for source, rows in saved.groupby("source")]
if steps is not None:
    parts.append(f"End to end, the fidelity benchmark's {len(steps)} configurations have median |step-time error| "
                 f"{steps.error.abs().median():.0%} (worst {steps.error.abs().max():.0%}).")
else:
    parts.append("The end-to-end fidelity results file is not there yet, so only layer-level fidelity is shown.")
both = spans.dropna()
worst = (both.predicted_s / both.measured_s - 1).abs().idxmax()
parts.append(f"Over one step of the disjoint plan the predicted timeline ends at {makespan_s(predicted) * 1e3:.0f} ms "
             f"and the measured one at {makespan_s(measured) * 1e3:.0f} ms; of the spans both draw, {worst} differs "
             f"most ({both.predicted_s[worst] * 1e3:.0f} ms predicted vs {both.measured_s[worst] * 1e3:.0f} ms "
             "measured over the step).")
if len(adapted):
    switched = adapted[adapted.decision == "switch"]
    parts.append(f"Adaptive runs: {len(switched)} of {len(adapted)} switched"
                 + "".join(f"; {case}: {r.measured_before_s * 1e3:.0f} ms per step before, {r.measured_after_s * 1e3:.0f} "
                           f"ms after (the fit predicted {r.new_fitted_s * 1e3:.0f} ms)" for case, r in switched.iterrows())
                 + ".")
display(Markdown(" ".join(parts)))"""),
]

NOTEBOOKS = {"compare_plans.ipynb": COMPARE_PLANS, "scaling.ipynb": SCALING, "fidelity.ipynb": FIDELITY}
"""File name -> cells."""


def build(cells: list) -> nbformat.NotebookNode:
    """A notebook of ``cells`` with this venv's Python 3 kernel."""
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"  # stable ids: regenerating gives the same bytes
    return nb


def text(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a notebook differs from its cells here")
    args = parser.parse_args(argv)
    stale = []
    for name, cells in NOTEBOOKS.items():
        path, wanted = HERE / name, text(build(cells))
        if args.check:
            if not path.is_file() or path.read_text() != wanted:
                stale.append(name)
        else:
            path.write_text(wanted)
    if stale:
        print(f"out of date: {', '.join(stale)}; run notebooks/make_notebooks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

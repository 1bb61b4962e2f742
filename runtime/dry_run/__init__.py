"""Dry-run: the runtime's own memory at full size, on CPU, without real memory or compute.

``dry_run(plan, options)`` runs the runtime's real ``Trainer`` (construction, then one ``train_step``) for one
rank of every distinct role of the plan, under a fake tensor mode and torch's fake process group of the plan's
world size (no memory, no communication), measures peak tensor memory by category with torch's ``MemTracker``,
and puts it beside the planner's prediction: FITS / DOES NOT FIT for the plan's device. ``format_report`` prints
it; ``report.fits`` is the verdict (``python -m runtime plan.json --dry-run`` exits 0 / 1 on it).

What runs, documented because it is what the numbers mean:

- The trainer's own code on fake CPU tensors (this torch is a CPU build: FakeTensorMode cannot fake ``cuda``
  tensors here). The trainer picks its numeric recipe from the plan's device (``numerics_device_type``), so a GPU
  plan runs the GPU recipe of runtime.parallel.precision: for bf16_mixed fp32 weights, gradients and Adam states
  with FSDP2's ``MixedPrecisionPolicy`` (bf16 all-gathers, fp32 reduction) where FSDP wraps a module and bf16
  autocast elsewhere; bf16 parameters for bf16_pure; a bf16 hand-off.
- Start-up is the trainer's: the model on ``meta``, sharded there, then ``materialize`` gives the local shards
  (fake) storage; their values come from ``ZeroWeights`` instead of the random init (nothing is drawn).
- ``DataDependentFakeMode``: data and index tensors stay real (they are small and the trainer computes indices
  from them: window order, M-RoPE positions, ``cu_seqlens.tolist()``); a floating-point factory, an integer one
  allocating more than ``REAL_TENSOR_LIMIT_BYTES``, the model's shards and every op touching a fake tensor are
  fake. Boolean-mask indexing of a fake
  tensor by a real mask is rewritten to integer indexing (same shape), and a Python scalar read from a fake
  tensor (the loss and the gradient norm, which only feed logging and clipping) reads 0.0.
- Pixel values are fake zeros of the planned shape (``PlannedShapes``), so no image is synthesised.
- A pipeline schedule's stages take their static metadata without the start-up vote (``_vote_alone``: the fake
  process group delivers no message).
- Mixture-of-experts layers: where tokens are routed is data, so each rank of an EP group sends every peer an equal
  share of its (token, expert) pairs (``BalancedAllToAllEP``: the mean load; the planner adds its
  ``moe_load_imbalance``); fp32 experts (a CPU plan) run transformers' grouped-GEMM fallback op, whose fake
  implementation takes fp32.
- Linear-attention layers of a plan on fla's kernel (``linear_attention: fla``, GPU plans): fla's Triton kernels
  cannot run on fake tensors, so its chunked rule and causal conv are emulated by what they allocate and save
  (``EmulatedChunkGatedDeltaRule``, ``EmulatedCausalConv1d``, after fla-core 0.6.0's source), computing nothing;
  a ``torch`` plan runs transformers' fallback as the run does.
- Window-attention blocks run their windows as one segment (``_windows_as_one_segment``): same memory with a
  flash-style kernel, hundreds of times fewer fake ops.
- Of a step's micro-batches, ``MICRO_BATCHES_RUN`` run (the first two and the last); every micro-batch's inputs
  are still prepared, as the trainer holds the whole step's inputs on the device. A pipelined plan runs them all:
  its schedule is one call over the step, and what a stage holds in flight depends on how many there are.

Roles: ranks that run the same code on tensors of the same shapes need the same memory. A rank's role is the
set of modules it holds and, per module, the length of its sequence slice (uneven SP splits differ) and its
pipeline stage (stages hold different layers and keep different numbers of micro-batches in flight). DP, ZeRO
and TP peers hold equal shards; among TP peers only coordinate 0 sends the hand-off / hand-back (copies of what
it sends), so the lowest rank of each role, which has TP coordinate 0, is the one run. A disjoint plan has at
least one role per group.

Adam creates its states at its first step; they are created before the measured step
(``init_optimizer_states``), so the step measured has the steady state's peak. Peaks are of tensor memory only;
the planner's prediction adds its framework overhead (CUDA context, workspaces:
``plan.predicted.memory_breakdown_gib.overhead``) and compares with the usable fraction of the device
(``usable_memory_fraction`` of planner.cost.assumptions). FITS uses the same rule: measured peak + overhead <=
usable memory.
"""

from __future__ import annotations

import time

from planner.contract.schema import Plan
from planner.contract.units import GIB
from runtime.dry_run.measure import measure_role
from runtime.dry_run.report import DryRunReport, numerics, usable_bytes
from runtime.dry_run.roles import roles
from runtime.launch.driver import validate_plan
from runtime.run.preflight import module_names
from runtime.training.trainer import RunOptions


def dry_run(plan: Plan, options: RunOptions, *, log=None) -> DryRunReport:
    """Run one step of one rank of every distinct role of ``plan`` on fake tensors; their peak memory.

    Args:
        plan: the plan to check.
        options: the run's options (seed; ``data`` and ``checkpoint`` are not read: shapes are the plan's).
        log: called with one line per role as it finishes (e.g. ``print``), or None.

    Raises:
        ValueError / NotImplementedError: the plan cannot run (``runtime.launch.driver.validate_plan``, the checks the run
            makes before any worker starts), or has an audio encoder (measured by real runs only, so far).
    """
    validate_plan(plan, options)  # every check the run makes, first
    if module_names(plan)[0] != "vision":
        raise NotImplementedError(f"--dry-run measures vision-language plans; {plan.model.name} has an "
                                  f"{module_names(plan)[0]} encoder: run it for real (python -m runtime)")
    start = time.perf_counter()
    measured = []
    for rank, ranks in roles(plan).items():
        role = measure_role(plan, rank, RunOptions(seed=options.seed))
        role.ranks = ranks
        measured.append(role)
        if log is not None:
            log(f"dry-run: rank {rank} ({'+'.join(role.modules)}, {len(role.ranks)} ranks): peak "
                f"{role.peak.get('Total', 0) / GIB:.2f} GiB of tensors in {role.seconds:.0f} s")
    return DryRunReport(plan=plan, roles=measured, usable_bytes=usable_bytes(plan), numerics=numerics(plan),
                        seconds=time.perf_counter() - start)

"""An adaptive run (``python -m runtime plan.json --adapt``): measure, re-plan under the measurements, switch when it
pays, check the switch, and say why at every decision.

After ``warmup_steps`` measured steps of a job (its first step, which builds caches, left out) the run has each
module's passes, the optimizer's step and the whole step (medians over those steps, the slowest rank's, as the
metrics lines hold them). At the next checkpoint it times the cost model's collectives on its own devices
(``Job.time_collectives``: every op on groups of each size its devices allow), hands both to the planner
(``python -m planner.adapt``, a subprocess: the runtime never imports the solver), which fits the cost model per term
and per module, saves the fit as a profile beside the checkpoints and solves the same problem again under it, and
predicts the running plan and the new one under the same fitted model. The run switches (resumes from the
checkpoint just made under the new plan, ``launcher._SwitchPlan``) when ``decide`` says so: the new plan is
predicted faster by at least ``min_gain`` of the step, and its gain over the steps left covers the switch's cost
(``Adapter.switch_cost_s``: as this job measured it, or ``switch_cost_s``). A switch keeps the actors (they leave
their world and join the new plan's, as a ``WorkerPool``'s do), so it costs the ranks' set-up, a checkpoint and its
load, not new processes. After ``warmup_steps`` measured steps of the new plan the switch is checked: measured slower than
the plan before measured, the run switches back; either way adapting stops (one switch and its check per run).

Memory: the fit also sees the tensors each rank measured (a GPU's allocator; a CPU run's ``--memory-cap-gib``
tracker), so the plan it prefers fits them, and a running plan that no longer fits its measured memory is left
whatever the gain. A step that runs out of memory (``StepOutOfMemory``) ends its job; ``after_out_of_memory`` then
re-plans on the memory measured, failing step included, and the run resumes from its last checkpoint under the new
plan (at most ``MAX_MEMORY_REPLANS`` times).

Every decision is one ``runtime: adapt:`` line on stdout and one ``adapt`` event in the metrics file.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from planner.contract.file_io import write_output
from planner.contract.schema import Plan, load_plan
from planner.contract.strategy import layout_of
from planner.contract.units import GIB
from runtime.observability.metrics import TIMED, MetricsLog
from runtime.run.preflight import is_cpu_plan, num_devices

MAX_MEMORY_REPLANS = 3
"""Re-plans after running out of memory a run tries before it gives up (each fits the memory terms to one more
measurement)."""

ADAPT_TIMEOUT_S = 300
"""Longest wait for the planner's fit and re-plan (it takes about a second)."""


@dataclass(frozen=True)
class AdaptOptions:
    """``--adapt`` and its settings."""

    warmup_steps: int = 3
    """Measured steps of a job (after its first) before its plan is fitted, or a switch checked."""
    min_gain: float = 0.05
    """Smallest predicted gain, as a share of the running plan's fitted step, worth a switch (the fitted model's own
    error on the running plan is of this order)."""
    switch_cost_s: float | None = None
    """Seconds a switch costs; None: measured (``Adapter.switch_cost_s``)."""


def decide(*, current_s: float, new_s: float, same_layout: bool, steps_left: int, switch_cost_s: float,
           min_gain: float) -> tuple[bool, str]:
    """(switch?, why) for a new plan predicted ``new_s`` per step against the running plan's ``current_s`` under the
    same fitted model: a gain of at least ``min_gain`` of the step, paid back within the ``steps_left``."""
    gain = current_s - new_s
    if same_layout:
        return False, "the fitted model prefers the running plan"
    if gain < min_gain * current_s:
        return False, f"predicted gain {gain / current_s:.1%} per step is below the {min_gain:.0%} threshold"
    if gain * steps_left <= switch_cost_s:
        return False, (f"predicted gain {gain:.3g} s x {steps_left} steps left = {gain * steps_left:.3g} s does not "
                       f"cover the switch's {switch_cost_s:.3g} s")
    return True, (f"predicted gain {gain:.3g} s per step ({gain / current_s:.1%}) x {steps_left} steps left = "
                  f"{gain * steps_left:.3g} s covers the switch's {switch_cost_s:.3g} s")


def _memory_words(memory: dict[str, Any]) -> str:
    """What the planner's memory answer says, in words: measured and fitted tensors against the usable share."""
    groups = "; ".join(f"{group} measured {g['measured'] / GIB:.4g} GiB of tensors (predicted {g['predicted'] / GIB:.4g})"
                       for group, g in memory["groups"].items())
    return (f"{groups}; {memory['usable_tensor_bytes'] / GIB:.4g} GiB usable; the new plan is predicted at "
            f"{memory['new_tensor_bytes'] / GIB:.4g} GiB")


def measured_medians(records: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over step records of ``step_time_s`` and every timer (``metrics.TIMED``) some step ran."""
    keys = ["step_time_s", *(k for k in TIMED if any(r.get(k) for r in records))]
    return {k: statistics.median(r.get(k, 0.0) for r in records) for k in keys}


def collective_group_sizes(plan: Plan) -> tuple[int, ...]:
    """Group sizes whose collectives a plan of this many devices may use within a node: every divisor from 2 up to
    the node's devices (the cost model prices inter-node links by formula)."""
    within = min(num_devices(plan), plan.cluster.devices_per_node)
    return tuple(g for g in range(2, within + 1) if num_devices(plan) % g == 0)


class Adapter:
    """The adaptive run's state across its jobs: measuring the first plan, checking a switch, or done."""

    def __init__(self, options: AdaptOptions, *, steps: int, folder: str, log: MetricsLog,
                 memory_cap_bytes: int | None = None) -> None:
        self.options, self.steps, self.folder, self.log = options, steps, folder, log
        self.memory_cap_bytes = memory_cap_bytes
        self.memory_replans = 0
        self.state = "measuring"
        self.before: tuple[Plan, float, float] | None = None
        """The plan switched from, its measured step and the new plan's step predicted under the fit."""
        self.job_first_step = 0
        self.job_setup_s = self.switch_stall_s = 0.0

    def job_started(self, job: Any) -> None:
        """A job (the first, or one after a switch) is up."""
        self.job_first_step, self.job_setup_s = job.steps_done, job.setup_s

    def _records(self) -> list[dict[str, Any]]:
        """This job's step records after its first."""
        return [r for r in self.log.records if r["step"] > self.job_first_step]

    def switch_cost_s(self, saved: dict[str, Any] | None) -> float:
        """What a switch costs, as this job measured it: its ranks' set-up (the actors stay; a switched job's
        includes loading the checkpoint), its first step's time over the median step, and a checkpoint's stall
        (``saved``'s). Before a switch, an estimate of the next one (``switch_cost_s`` when given); after one, what
        it cost."""
        if saved is not None and self.options.switch_cost_s is not None:
            return self.options.switch_cost_s
        first = next(r for r in self.log.records if r["step"] == self.job_first_step)
        median = statistics.median(r["step_time_s"] for r in self._records())
        stall = self.switch_stall_s if saved is None else saved.get("seconds", 0.0)
        return self.job_setup_s + max(0.0, first["step_time_s"] - median) + stall

    def at_checkpoint(self, job: Any, saved: dict[str, Any]) -> Plan | None:
        """After a checkpoint of ``job``: the plan to go on under (the checkpoint's step resumed), or None."""
        step = saved["step"]
        records = self._records()
        if self.state == "done" or step >= self.steps or len(records) < self.options.warmup_steps:
            return None
        measured = measured_medians(records)
        if self.state == "measuring":
            return self._fit_and_decide(job, saved, measured)
        return self._check_switch(job, step, measured)

    def _fit_and_decide(self, job: Any, saved: dict[str, Any], measured: dict[str, float]) -> Plan | None:
        step, plan = saved["step"], job.plan
        try:
            answer = self._replan(job, step, measured, self._measured_memory())
        except (ValueError, OSError, subprocess.TimeoutExpired) as e:
            self.state = "done"
            self.log.event("adapt", step=step, decision="keep", why=str(e), measured=measured)
            self.log.warn(f"adapt: {e}; the run goes on under its plan")
            return None
        cost = self.switch_cost_s(saved)
        switch, why = decide(current_s=answer["current_fitted_s"], new_s=answer["new_fitted_s"],
                             same_layout=answer["same_layout"], steps_left=self.steps - step, switch_cost_s=cost,
                             min_gain=self.options.min_gain)
        memory = answer.get("memory")
        if memory is not None and not memory["current_fits"] and not answer["same_layout"]:
            switch, why = True, f"{_memory_words(memory)}: the running plan does not fit its measured memory"
        fitted = ", ".join(f"{k}={v:.3g}" for k, v in sorted(answer["fitted"].items()))
        self.log.event("adapt", step=step, decision="switch" if switch else "keep", why=why, measured=measured,
                       fitted=answer["fitted"], at_bound=answer["at_bound"], residuals=answer["residuals"],
                       current_layout=answer["current_layout"], new_layout=answer["new_layout"],
                       planned_step_s=answer["planned_step_s"], current_fitted_s=answer["current_fitted_s"],
                       new_fitted_s=answer["new_fitted_s"], switch_cost_s=cost, plan=answer["new_plan"],
                       profile=answer["profile"])
        self.log.say(f"adapt: after step {step}: measured {measured['step_time_s']:.3g} s per step (planned "
                     f"{answer['planned_step_s']:.3g}); fitted {fitted} (profile {answer['profile']}); under the fit "
                     f"the running plan takes {answer['current_fitted_s']:.3g} s, {answer['new_layout']} "
                     f"{answer['new_fitted_s']:.3g} s: {'switching' if switch else 'keeping the plan'} ({why})")
        if not switch:
            self.state = "done"
            return None
        self.state, self.before = "switched", (plan, measured["step_time_s"], answer["new_fitted_s"])
        self.switch_stall_s = saved.get("seconds", 0.0)
        new = load_plan(answer["new_plan"])
        self.log.plan = new
        return new

    def _check_switch(self, job: Any, step: int, measured: dict[str, float]) -> Plan | None:
        before, before_s, predicted_s = self.before
        now_s, cost = measured["step_time_s"], self.switch_cost_s(None)
        back = now_s > before_s
        gain = before_s - now_s
        paid = (f"the switch's {cost:.3g} s paid back in {cost / gain:.3g} steps" if gain > 0 else
                f"the switch cost {cost:.3g} s")
        why = (f"measured {now_s:.3g} s per step (predicted {predicted_s:.3g} under the fit) against {before_s:.3g} s "
               f"before the switch; {paid}")
        self.log.event("adapt", step=step, decision="switch back" if back else "kept", why=why, measured=measured,
                       before_layout=layout_of(before), layout=layout_of(job.plan), predicted_step_s=predicted_s,
                       switch_cost_s=cost)
        self.log.say(f"adapt: after step {step}: {why}: " + (f"switching back to {layout_of(before)}" if back else
                                                            "keeping the new plan"))
        self.state = "done"
        if back:
            self.log.plan = before
            return before
        return None

    def _measured_memory(self, out_of_memory: Any = None) -> dict[str, Any] | None:
        """The tensor memory this job's steps measured (and ``out_of_memory``'s, a ``StepOutOfMemory``): the most
        per rank, and what a device holds; None where nothing measures tensors (a CPU run without a memory cap)."""
        records = [r for r in self.log.records if r["step"] >= self.job_first_step and "peak_tensor_bytes" in r]
        peaks: dict[int, int] = {}
        for r in records:
            for rank, held in enumerate(r["peak_tensor_bytes"]):
                peaks[rank] = max(peaks.get(rank, 0), held)
        capacity = self.memory_cap_bytes or min((r["device_memory_bytes"] for r in records
                                                 if "device_memory_bytes" in r), default=None)
        if out_of_memory is not None:
            peaks[out_of_memory.rank] = max(peaks.get(out_of_memory.rank, 0), out_of_memory.tensor_bytes)
            capacity = out_of_memory.capacity_bytes
        if not peaks or capacity is None:
            return None
        return {"peak_tensor_bytes": peaks, "capacity_bytes": capacity, "tensor_cap": self.memory_cap_bytes is not None}

    def after_out_of_memory(self, job: Any, error: Any) -> Plan:
        """The plan to resume under after ``job`` ran out of memory (``error``, a ``StepOutOfMemory``): its own
        problem (with its profile: a time fit made earlier stays) re-planned with the memory terms fitted to what it
        measured. Raises ValueError (one line) when no plan fits or after ``MAX_MEMORY_REPLANS``."""
        step = job.steps_done
        if self.memory_replans >= MAX_MEMORY_REPLANS:
            raise ValueError(f"{error}; {MAX_MEMORY_REPLANS} re-plans on the measured memory did not fit it: plan for "
                             f"more devices, or shorter samples")
        self.memory_replans += 1
        answer = self._replan(job, step, {}, self._measured_memory(error), "memory")  # its workers are gone
        if answer["same_layout"]:
            raise ValueError(f"{error}; re-planned on the measured memory, the planner still prefers this plan")
        why = f"{error}: {_memory_words(answer['memory'])}"
        self.log.event("adapt", step=step, decision="memory re-plan", why=why, memory=answer["memory"], fitted=answer["fitted"], current_layout=answer["current_layout"],
                       new_layout=answer["new_layout"], new_fitted_s=answer["new_fitted_s"], plan=answer["new_plan"],
                       profile=answer["profile"])
        self.log.say(f"adapt: {why}; resuming from the last checkpoint under {answer['new_layout']}")
        if self.state == "switched":  # the plan being checked ran out of memory: nothing left to compare
            self.state = "done"
        new = load_plan(answer["new_plan"])
        self.log.plan = new
        return new

    def _replan(self, job: Any, step: int, measured: dict[str, float], memory: dict[str, Any] | None,
                prefix: str = "adapt") -> dict[str, Any]:
        """The planner's fit and re-plan (``planner.adapt``) of ``job``'s plan from ``measured`` (and ``memory``)
        and the collectives timed on the job's devices (when it is still up); its files go beside the checkpoints."""
        base = os.path.join(self.folder, f"{prefix}-{step:06d}")
        plan_file = f"{base}-plan.json"
        write_output(plan_file, job.plan.to_json(), flag="--checkpoint-dir")
        request = {"plan": plan_file, "measured": measured, "dtype": "float32" if is_cpu_plan(job.plan) else "bfloat16",
                   "collectives": job.time_collectives(collective_group_sizes(job.plan)) if measured else [],
                   "memory": memory}
        write_output(f"{base}-measured.json", json.dumps(request), flag="--checkpoint-dir")
        result = subprocess.run([sys.executable, "-m", "planner.adapt", f"{base}-measured.json", "--out",
                                 f"{base}-new-plan.json", "--profile-out", f"{base}-profile.json"],
                                capture_output=True, text=True, timeout=ADAPT_TIMEOUT_S)
        if result.returncode != 0:
            reason = (result.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("adapt: error: ")
            raise ValueError(f"the adaptive re-plan after step {step} failed: {reason}")
        return json.loads(result.stdout.strip().splitlines()[-1])

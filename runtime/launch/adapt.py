"""An adaptive run (``python -m runtime plan.json --adapt``): measure, re-plan under the measurements, switch when it
pays, check the switch, go on from the new plan while switches pay, and say why at every decision.

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
load, not new processes. After ``warmup_steps`` measured steps of the new plan the switch is checked: measured slower
than the plan before measured, the run switches back and adapting stops (a switch that did not pay); measured
faster, the switch is kept and the new plan is fitted at once on those same steps, and may be switched from in turn
(its gain against its own measured cost over the steps left), and so on. Adapting stops when the fitted model
prefers the running plan, a gain does not pay, a switch did not pay, or the steps run out. Every layout the run ran
is remembered with its measured step (``Adapter.tried``): a new plan of one of them is judged by that measurement,
not by its prediction (so a fit never switches back to a layout the run left), and a layout left for its memory is
never switched to again (nor back to: a switch for memory is not checked; its plan is measured and fitted instead).

Memory: the fit also sees the tensors each rank measured (a GPU's allocator; a CPU run's ``--memory-cap-gib``
tracker), so the plan it prefers fits them, and a running plan that no longer fits its measured memory is left
whatever the gain. At every other checkpoint (also once adapting stopped) the run compares the most tensors a rank
measured with what the running plan was last found to fit (its prediction, ``planned_tensor_bytes``, or the
planner's last check of it): only when they grew past it is the planner asked, on the memory alone; a plan that no
longer fits them is re-planned on them and the run resumes under the new plan from the checkpoint just made. A step
that runs out of memory (``StepOutOfMemory``) ends its job; ``after_out_of_memory`` then re-plans on the memory
measured, failing step included, and the run resumes from its last checkpoint under the new plan. Both count against
``MAX_MEMORY_REPLANS``.

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
           min_gain: float, basis: str) -> tuple[bool, str]:
    """(switch?, why) for a new plan of ``new_s`` per step against the running plan's ``current_s``, both
    ``basis`` ("predicted" under the same fitted model, or "measured"): a gain of at least ``min_gain`` of the step,
    paid back within the ``steps_left``."""
    gain = current_s - new_s
    if same_layout:
        return False, "the fitted model prefers the running plan"
    if gain < min_gain * current_s:
        return False, f"{basis} gain {gain / current_s:.1%} per step is below the {min_gain:.0%} threshold"
    if gain * steps_left <= switch_cost_s:
        return False, (f"{basis} gain {gain:.3g} s x {steps_left} steps left = {gain * steps_left:.3g} s does not "
                       f"cover the switch's {switch_cost_s:.3g} s")
    return True, (f"{basis} gain {gain:.3g} s per step ({gain / current_s:.1%}) x {steps_left} steps left = "
                  f"{gain * steps_left:.3g} s covers the switch's {switch_cost_s:.3g} s")


def _memory_words(memory: dict[str, Any]) -> str:
    """What the planner's memory answer says, in words: measured and fitted tensors against the usable share."""
    groups = "; ".join(f"{group} measured {g['measured'] / GIB:.4g} GiB of tensors (predicted {g['predicted'] / GIB:.4g})"
                       for group, g in memory["groups"].items())
    return (f"{groups}; {memory['usable_tensor_bytes'] / GIB:.4g} GiB usable; the new plan is predicted at "
            f"{memory['new_tensor_bytes'] / GIB:.4g} GiB")


def planned_tensor_bytes(plan: Plan) -> int:
    """The most tensor bytes ``plan`` predicts a rank holds: its peak less the framework overhead."""
    return round((plan.predicted.peak_memory_gib - plan.predicted.memory_breakdown_gib.overhead) * GIB)


def _peak(memory: dict[str, Any]) -> int:
    """The most tensor bytes any rank measured (``Adapter._measured_memory``'s)."""
    return max(memory["peak_tensor_bytes"].values())


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
    """The adaptive run's state across its jobs: measuring a plan (to fit it), checking a switch, or done (memory
    alone is checked)."""

    def __init__(self, options: AdaptOptions, *, steps: int, folder: str, log: MetricsLog,
                 memory_cap_bytes: int | None = None) -> None:
        self.options, self.steps, self.folder, self.log = options, steps, folder, log
        self.memory_cap_bytes = memory_cap_bytes
        self.memory_replans = 0
        self.state = "measuring"
        self.before: tuple[Plan, float, float] | None = None
        """The plan switched from, its measured step and the new plan's step predicted under the fit."""
        self.tried: dict[str, float | None] = {}
        """Each layout the run fitted or checked: its measured step (None: left for its memory)."""
        self.memory_checked: dict[str, int] = {}
        """Per layout, the most tensor bytes of a rank the planner found it fits."""
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
        """After a checkpoint of ``job``: the plan to go on under (the checkpoint's step resumed), or None. With the
        job's warm-up measured: a switch being checked is checked, and a plan measured (kept after its switch
        included) is fitted; otherwise its memory (``_check_memory``)."""
        if saved["step"] >= self.steps:
            return None
        records = self._records()
        if self.state == "done" or len(records) < self.options.warmup_steps:
            return self._check_memory(job, saved)
        measured = measured_medians(records)
        if self.state == "switched":
            back = self._check_switch(job, saved["step"], measured)
            if back is not None:  # the switch did not pay: adapting stops
                return back
        return self._fit_and_decide(job, saved, measured)  # a kept switch's plan: fitted on the same steps

    def _fit_and_decide(self, job: Any, saved: dict[str, Any], measured: dict[str, float]) -> Plan | None:
        """The planner's fit of ``job``'s plan to ``measured`` (and its memory) and the decision on its re-plan
        (``_judge``): the plan to switch to, or None (adapting stops)."""
        step, plan = saved["step"], job.plan
        memory = self._measured_memory()
        try:
            answer = self._replan(job, step, measured, memory)
        except (ValueError, OSError, subprocess.TimeoutExpired) as e:
            self.state = "done"
            self.log.event("adapt", step=step, decision="keep", why=str(e), measured=measured)
            self.log.warn(f"adapt: {e}; the run goes on under its plan")
            return None
        outgrown = memory is not None and not answer["memory"]["current_fits"]
        self.tried[layout_of(plan)] = None if outgrown else measured["step_time_s"]
        if memory is not None and not outgrown:
            self.memory_checked[layout_of(plan)] = _peak(memory)
        cost = self.switch_cost_s(saved)
        switch, why = self._judge(answer, measured, self.steps - step, cost)
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
        self.state = "measuring" if outgrown else "switched"  # a plan left for its memory is not switched back to
        self.before = (plan, measured["step_time_s"], answer["new_fitted_s"])
        self.switch_stall_s = saved.get("seconds", 0.0)
        new = load_plan(answer["new_plan"])
        self.log.plan = new
        return new

    def _judge(self, answer: dict[str, Any], measured: dict[str, float], steps_left: int, cost: float
               ) -> tuple[bool, str]:
        """(switch?, why) for the planner's ``answer``: the running plan is left whatever the gain when it no longer
        fits its measured memory; a new plan of a layout the run ran is judged by its measured step against the
        running plan's (never switched to when it was left for its memory), any other by its prediction under the
        fit (``decide``)."""
        memory, new = answer.get("memory"), answer["new_layout"]
        if memory is not None and not memory["current_fits"] and not answer["same_layout"]:
            return True, f"{_memory_words(memory)}: the running plan does not fit its measured memory"
        gain = dict(steps_left=steps_left, switch_cost_s=cost, min_gain=self.options.min_gain)
        if answer["same_layout"] or new not in self.tried:
            return decide(current_s=answer["current_fitted_s"], new_s=answer["new_fitted_s"],
                          same_layout=answer["same_layout"], basis="predicted", **gain)
        if self.tried[new] is None:
            return False, f"the fitted model prefers {new}, which this run left for its memory"
        switch, why = decide(current_s=measured["step_time_s"], new_s=self.tried[new], same_layout=False,
                             basis="measured", **gain)
        return switch, f"this run measured {new} at {self.tried[new]:.3g} s per step: {why}"

    def _check_switch(self, job: Any, step: int, measured: dict[str, float]) -> Plan | None:
        """The check of the switch to ``job``'s plan: the plan before it when that measured faster (adapting stops
        there), else None (the new plan kept)."""
        before, before_s, predicted_s = self.before
        now_s, cost = measured["step_time_s"], self.switch_cost_s(None)
        self.tried[layout_of(job.plan)] = now_s
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
        if back:
            self.state, self.log.plan = "done", before
            return before
        return None

    def _check_memory(self, job: Any, saved: dict[str, Any]) -> Plan | None:
        """At a checkpoint: the plan to resume under when the most tensors a rank of ``job`` measured grew past what
        its plan was last found to fit (its prediction, or the planner's last check) and the planner, asked then on
        the memory alone, finds that the plan no longer fits them; else None."""
        memory = self._measured_memory()
        if memory is None or self.memory_replans >= MAX_MEMORY_REPLANS:  # then running out of memory ends the run
            return None
        layout, step = layout_of(job.plan), saved["step"]
        if _peak(memory) <= self.memory_checked.get(layout, planned_tensor_bytes(job.plan)):
            return None
        self.memory_checked[layout] = _peak(memory)
        try:
            answer = self._replan(job, step, {}, memory, "memory")
        except (ValueError, OSError, subprocess.TimeoutExpired) as e:
            self.log.event("adapt", step=step, decision="keep", why=str(e), memory=memory)
            self.log.warn(f"adapt: {e}; the run goes on under its plan")
            return None
        why = f"after step {step}: {_memory_words(answer['memory'])}"
        if answer["memory"]["current_fits"]:
            self.log.event("adapt", step=step, decision="keep", why=f"{why}: the running plan still fits",
                           memory=answer["memory"], fitted=answer["fitted"], current_layout=layout,
                           profile=answer["profile"])
            self.log.say(f"adapt: {why}: the running plan still fits")
            return None
        self.memory_replans += 1
        return self._memory_replan(job, step, f"{why}: the running plan no longer fits", answer,
                                   "the checkpoint just made")

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
        return self._memory_replan(job, step, f"{error}: {_memory_words(answer['memory'])}", answer,
                                   "the last checkpoint")

    def _memory_replan(self, job: Any, step: int, why: str, answer: dict[str, Any], resumed: str) -> Plan:
        """The plan of ``answer`` (a re-plan on the memory ``job`` measured), said with ``why`` and where the run
        resumes (``resumed``); ``job``'s layout is never switched to again, and a switch to it is not checked (the
        new plan is measured and fitted, unless adapting stopped)."""
        self.log.event("adapt", step=step, decision="memory re-plan", why=why, memory=answer["memory"],
                       fitted=answer["fitted"], current_layout=answer["current_layout"],
                       new_layout=answer["new_layout"], new_fitted_s=answer["new_fitted_s"], plan=answer["new_plan"],
                       profile=answer["profile"])
        self.log.say(f"adapt: {why}; resuming from {resumed} under {answer['new_layout']}")
        self.tried[layout_of(job.plan)] = None
        if self.state == "switched":  # the plan being checked outgrew its memory: the new one is measured instead
            self.state = "measuring"
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

"""Re-plan a running plan for another number of devices (an elastic run that lost some, or got them back): the same
model, device, sample shape (or dataset, read again), global batch, precision, training settings, profile and pins,
searched again.

``python -m planner.replan PLAN --gpus N --out NEW``: the runtime calls it (it never imports the solver), and so
can a user. Bad input and infeasible requests print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Sequence

from planner import api
from planner.contract.families import model_from_hf_config
from planner.contract.file_io import check_output, refuse_shared_paths, write_output
from planner.contract.schema import DatasetInfo, Plan, PlanError, load_plan
from planner.contract.strategy import layout_of
from planner.dataset import read_dataset
from planner.problem import Problem

EXIT_USER_ERROR = 2


def replan_problem(plan: Plan, gpus: int, profile: str | None = None, device_memory_bytes: int | None = None
                   ) -> Problem:
    """The problem ``plan`` was made for, on ``gpus`` devices of its recorded type (the device's numbers as the plan
    records them, its memory ``device_memory_bytes`` when given; ``profile``, else its own profile when it named
    one), its linear-attention layers on the kernel it recorded. A dataset plan's dataset is read again as it was
    read (``dataset_inputs``)."""
    spec = model_from_hf_config(plan.model.hf_config, plan.model.name)
    w = plan.workload
    training = dict(precision=plan.training.precision, frozen=[m.name for m in plan.modules if m.frozen])
    if w.dataset is not None:  # a dataset plan's global batch counts packs; the planner is given samples
        samples = round(w.global_batch * w.dataset.samples_per_pack)
        workload, dataset = api.WorkloadInputs(global_batch=samples, **training), dataset_inputs(w.dataset)
    else:
        workload, dataset = api.WorkloadInputs(
            image_sizes=[tuple(s) for s in w.image_sizes] or None, vision_tokens=w.vision_tokens,
            videos=[tuple(v) for v in w.videos], text_tokens=w.text_tokens, audio_seconds=w.audio_seconds or None,
            global_batch=w.global_batch, **training), None
    search = api.SearchOptions(linear_attention=plan.module("llm").linear_attention)
    cluster = api.ClusterInputs(gpus=gpus, gpu=plan.cluster.device.name, gpus_per_node=plan.cluster.devices_per_node,
                                profile=profile or plan.predicted.profile)
    problem = api.make_problem(spec, cluster, workload=workload, dataset=dataset, search=search)
    device = plan.cluster.device
    if device_memory_bytes is not None:
        device = replace(device, memory_bytes=device_memory_bytes)
    return replace(problem, cluster=replace(problem.cluster, device=device))


def dataset_inputs(info: DatasetInfo) -> api.DatasetInputs:
    """The dataset a plan was made for: its file read again with the tokenizer and data-root switch it was read with
    (the cached scan, unless the data changed since), under the plan's pixel bounds, fps and pack budget.

    Raises:
        ValueError: the plan's histogram was made in memory, or its file cannot be read now; one line.
    """
    if info.read_from is None:
        raise ValueError(f"the plan's dataset ({info.source}) was a histogram made in memory, which a re-plan cannot "
                         "read again: plan from its file with `plan --dataset FILE`")
    try:
        histogram = read_dataset(info.read_from, info.tokenizer, data_root_only=info.data_root_only)
    except ValueError as e:
        raise ValueError(f"the plan's dataset cannot be read again: {e}") from None
    return api.DatasetInputs(source=histogram, min_pixels=info.min_pixels, max_pixels=info.max_pixels,
                             pack_tokens=info.pack_tokens, pack=info.pack_tokens is not None, fps=info.fps)


def replan(plan: Plan, gpus: int, problem: Problem | None = None) -> tuple[Plan, str | None]:
    """The fastest plan of ``plan``'s problem on ``gpus`` devices (``problem``: that problem as given), with
    ``plan``'s training settings, and a note when its pins (``--fix``) had to be dropped because no plan on ``gpus``
    devices keeps them."""
    problem = problem or replan_problem(plan, gpus)
    pins, note = dict(plan.solver.fixed), None
    try:
        new = api.plan(problem, fix=pins)
    except ValueError as e:
        if not pins:
            raise
        new = api.plan(problem)
        note = f"pins {', '.join(f'{k}={v}' for k, v in pins.items())} dropped: {e}"
    return new.model_copy(update={"training": plan.training}), note


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner.replan", description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", help="the plan file to re-plan")
    parser.add_argument("--gpus", type=int, required=True, help="devices of the new plan")
    parser.add_argument("--out", required=True, help="write the new plan here")
    args = parser.parse_args(argv)
    try:
        refuse_shared_paths({"plan": args.plan}, {"--out": args.out})
        check_output(args.out, "--out")
        if not 1 <= args.gpus <= api.MAX_GPUS:
            raise ValueError(f"--gpus must be between 1 and {api.MAX_GPUS}, got {args.gpus}")
        new, note = replan(load_plan(args.plan), args.gpus)
        try:
            write_output(args.out, new.to_json(), flag="--out")
        except OSError as e:
            raise ValueError(f"cannot write --out {args.out}: {e.strerror}") from None
    except (ValueError, OSError, PlanError) as e:
        print(f"replan: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if note:
        print(f"replan: {note}")
    print(f"replan: {args.gpus} devices: {layout_of(new)}; {new.predicted.step_time_s:.3g} s per step predicted")
    return 0


if __name__ == "__main__":
    sys.exit(main())

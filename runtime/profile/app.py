"""What ``python -m runtime.profile`` does with its arguments: open (or resume) a profile, measure, save."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch

from planner.catalog import get_model
from planner.contract.models import ModelSpec
from planner.profiles import (
    PROFILE_SCHEMA_VERSION,
    PROFILES_DIR,
    Profile,
    Provenance,
    load_profile,
    profile_path,
    save_profile,
)
from runtime.profile.device import device_detail, measure_device
from runtime.profile.layers import Grid, grid_points, measure_point, memory_point, noisy_points, sweep
from runtime.profile.measure import TimingConfig
from runtime.profile.shards import hf_config

FAKE_HARDWARE = "fake"
"""Hardware directory of FakeTensor memory profiles (memory does not depend on the device)."""


def _dtype(args: argparse.Namespace) -> torch.dtype:
    name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return getattr(torch, name)


def provenance(*, hardware: str, device: torch.device, dtype: torch.dtype,
               argv: list[str] | None = None) -> Provenance:
    """Where, when and how this process measures; ``argv``: the profiler's arguments (default: this process's)."""
    return Provenance(
        device_name=hardware,
        device_detail=device_detail(device) if device.type == "cuda" or hardware != FAKE_HARDWARE else "FakeTensorMode",
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(shlex.quote(a) for a in ["python", "-m", "runtime.profile",
                                                   *(sys.argv[1:] if argv is None else argv)]),
        num_threads=torch.get_num_threads(),
        dtype=str(dtype).removeprefix("torch."),
    )


def open_profile(path: Path, *, hardware: str, model: ModelSpec, prov: Provenance) -> Profile:
    """The profile at ``path`` to resume, or a new empty one. ``save_profile`` refreshes the provenance (date,
    command) only when something new was measured, so a re-run that measures nothing leaves the file untouched."""
    if not path.exists():
        return Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware=hardware, model=model.name, provenance=prov)
    profile = load_profile(path)
    if profile.hardware != hardware or profile.model != model.name:
        raise ValueError(
            f"{path} profiles {profile.model} on {profile.hardware}, not {model.name} on {hardware}: pick another --out"
        )
    old = profile.provenance
    if (old.dtype, old.num_threads, old.device_detail) != (prov.dtype, prov.num_threads, prov.device_detail):
        raise ValueError(
            f"{path} was measured with {old.dtype}, {old.num_threads} threads on {old.device_detail}; this run uses "
            f"{prov.dtype}, {prov.num_threads} threads on {prov.device_detail}: pick another --out or match them"
        )
    return profile


def _grid(args: argparse.Namespace) -> Grid:
    return Grid(
        seq_lens={"vision": args.vision_seq, "llm": args.llm_seq},
        micro_batches=args.micro_batches,
        tps=args.tp,
        sps=args.sp,
        layers=tuple(x for x in args.layers.split(",") if x),
    )


def _hardware(args: argparse.Namespace, device: torch.device) -> str:
    if args.memory:
        return FAKE_HARDWARE
    if args.hardware:
        return args.hardware
    if device.type == "cuda":
        raise ValueError("--hardware is required on CUDA (the hardware catalog name of this GPU, e.g. h100-80gb)")
    return "cpu"


def cpu_concurrency(model_arg: str, model: ModelSpec, llm_seq: tuple[int, ...]) -> dict[int, float]:
    """Slowdown of the LLM decoder layer (at the middle measured sequence length) when worker processes share
    this machine's cores."""
    from runtime.profile.concurrency import measure_concurrency

    seq = sorted(llm_seq)[len(llm_seq) // 2]
    print(f"measuring how {model.name} decoder layers slow down when workers share the CPU ...", file=sys.stderr)
    return measure_concurrency(model_arg, module="llm", layer="decoder_layer", seq_len=seq,
                               threads=torch.get_num_threads())


def drop_noisy(profile: Profile, *, includes_comm: bool) -> None:
    """Remove the disturbed layer points of one kind (single-process or as run) so the sweep re-measures them."""
    noisy = {key for key in noisy_points(profile.layers) if key[-1] == includes_comm}
    profile.layers = [p for p in profile.layers if p.key not in noisy]
    print(f"re-measuring {len(noisy)} disturbed point(s)", file=sys.stderr)


def as_run_points(args: argparse.Namespace, model: ModelSpec, profile: Profile, points: list, path: Path,
                  dtype: torch.dtype, save) -> tuple[int, int]:
    """Time the grid's sharded points ``profile`` lacks as the runtime runs them; (measured, left). The ranks'
    rank 0 appends each point to the file at ``path``, which ``profile`` is first saved to."""
    from runtime.profile.as_run import available_ranks, can_run_as_run, sweep_as_run

    config = hf_config(model.hf_config)
    ranks = available_ranks(torch.device(args.device))
    done = {p.key for p in profile.layers}
    todo = [p for p in points if can_run_as_run(config, p, ranks) and p.layer_key(includes_comm=True) not in done]
    if not todo:
        return 0, 0
    save(profile)
    cfg = TimingConfig(warmup=args.warmup, repeats=args.repeats, dtype=dtype, device=args.device)

    def announce(tp: int, sp: int, count: int) -> None:
        print(f"timing {count} point(s) as run at tp={tp} sp={sp} in {tp * sp} processes ...", file=sys.stderr)

    return sweep_as_run(args.model, todo, profile_path=str(path), cfg=cfg, threads=torch.get_num_threads(),
                        time_budget_s=args.time_budget, on_degree=announce)


def run(args: argparse.Namespace) -> int:
    """Dispatch on the mode flags; returns the exit status."""
    if args.calibrate:
        raise ValueError("calibration is the planner's: python -m planner.calibrate RUNS [--plan PLAN ...] "
                         "[--out FILE] (it fits the cost model, and plans `args` rows, without torch)")
    if not args.model:
        raise ValueError("--model is required (a catalog name such as qwen2.5-vl-tiny, or a config.json)")
    model = get_model(args.model)
    if args.compare:
        from planner.profiles.compare import compare_main

        return compare_main(model, Path(args.out) if args.out else profile_path(FAKE_HARDWARE, model.name))
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), _dtype(args)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no GPU")
    hardware = _hardware(args, device)
    path = Path(args.out) if args.out else profile_path(hardware, model.name, PROFILES_DIR)
    fresh = provenance(hardware=hardware, device=device, dtype=dtype, argv=getattr(args, "argv", None))
    existed = path.exists()
    profile = open_profile(path, hardware=hardware, model=model, prov=fresh)
    points = list(grid_points(model, _grid(args)))

    def save(p: Profile) -> None:
        p.provenance = fresh
        save_profile(p, path)

    extra = 0  # device-level measurements and settings changed this run
    if args.time_statistic and args.time_statistic != profile.time_statistic:
        profile.time_statistic = args.time_statistic
        extra += 1
    if args.memory:
        done, left = sweep(profile, points, lambda pt: memory_point(model, pt, dtype), field="memory", save=save,
                           time_budget_s=args.time_budget)
    elif args.as_run:
        if args.remeasure_noisy:
            drop_noisy(profile, includes_comm=True)
        done, left = as_run_points(args, model, profile, points, path, dtype, save)
        profile = load_profile(path) if path.exists() else profile
    elif args.collectives:
        from runtime.profile.collectives import measure_collectives

        before = len(profile.collectives)
        profile.collectives = measure_collectives(device=device, group_sizes=args.group_sizes, existing=profile.collectives)
        done, left = len(profile.collectives) - before, 0
    else:
        if not args.no_device_bench and profile.device is None:
            profile.device = measure_device(dtype=dtype, device=device)
            extra += 1
        if not args.no_device_bench and profile.device.host_seconds_per_op is None:
            from runtime.profile.device import free_port
            from runtime.profile.ops import measure_host_dispatch

            plain, dtensor = measure_host_dispatch(free_port(), device)
            profile.device.host_seconds_per_op, profile.device.dtensor_seconds_per_op = plain, dtensor
            extra += 1
        if not args.no_device_bench and device.type == "cpu" and not profile.device.concurrency:
            profile.device.concurrency = cpu_concurrency(args.model, model, args.llm_seq)
            extra += 1
            save(profile)
        if args.remeasure_noisy:
            drop_noisy(profile, includes_comm=False)
        cfg = TimingConfig(warmup=args.warmup, repeats=args.repeats, dtype=dtype, device=args.device)
        done, left = sweep(profile, points, lambda pt: measure_point(model, pt, cfg), field="layers", save=save,
                           time_budget_s=args.time_budget)
    if done or extra or not existed:
        save(profile)
    note = f"; {left} left for lack of time (re-run to resume)" if left else ""
    print(f"wrote {path}: {done} new point(s){note}")
    return 0

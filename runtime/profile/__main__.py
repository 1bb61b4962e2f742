"""``python -m runtime.profile``: measure a model's layer shards, the device and its collectives; compare.
(Calibration from measured runs is the planner's: ``python -m planner.calibrate``.)

Examples:
  python -m runtime.profile --model qwen2.5-vl-tiny                       # layers + device -> profiles/cpu/<model>.json
  python -m runtime.profile --model qwen2.5-vl-tiny --collectives         # + gloo/NCCL collectives
  python -m runtime.profile --model qwen2.5-vl-tiny --as-run              # + TP/SP layers timed in tp*sp processes
  python -m runtime.profile --model qwen2.5-vl-32b --memory               # FakeTensor memory -> profiles/fake/<model>.json
  python -m runtime.profile --model qwen2.5-vl-32b --compare              # memory profile vs the analytical model
"""

from __future__ import annotations

import argparse
import sys

from runtime.profile.app import run


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="catalog name or config.json of the model to profile")
    p.add_argument("--hardware", help="hardware catalog name the profile is for (default: cpu, or the GPU's name)")
    p.add_argument("--out", help="profile file (default: profiles/<hardware>/<model>.json)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to time")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="dtype to measure (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--vision-seq", type=_ints, default=(256, 1024), help="vision patches per image to measure")
    p.add_argument("--llm-seq", type=_ints, default=(256, 1024), help="LLM sequence lengths to measure")
    p.add_argument("--micro-batches", type=_ints, default=(1, 2), help="micro-batch sizes to measure")
    p.add_argument("--tp", type=_ints, default=(1, 2), help="tensor-parallel degrees whose shards to measure")
    p.add_argument("--sp", type=_ints, default=(1, 2), help="Ulysses degrees whose shards to measure")
    p.add_argument("--layers", default="", help="only these module.layer names, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median recorded)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per point")
    p.add_argument("--time-statistic", choices=("median", "min"), default=None,
                   help="timing the planner uses from this profile: median (dedicated machine, the default) or min "
                        "(shared machine: other processes only add time); stored in the profile")
    p.add_argument("--remeasure-noisy", action="store_true",
                   help="first drop layer points other processes visibly disturbed (slower than a longer sequence, "
                        "above the chord of their neighbours, or a median far above the fastest repeat), then "
                        "measure what is missing (the as-run points with --as-run)")
    p.add_argument("--time-budget", type=float, default=None, help="stop measuring new points after this many seconds")
    p.add_argument("--no-device-bench", action="store_true", help="skip the matmul / bandwidth microbenchmarks")
    p.add_argument("--collectives", action="store_true", help="measure collectives (gloo on CPU, NCCL on CUDA)")
    p.add_argument("--as-run", action="store_true",
                   help="time the TP/SP degrees > 1 of the grid as the runtime runs them: tp*sp processes, the "
                        "runtime's own sharding, collectives included (points flagged includes_comm)")
    p.add_argument("--group-sizes", type=_ints, default=None, help="collective group sizes (default: 2..devices)")
    p.add_argument("--memory", action="store_true", help="FakeTensor memory breakdowns only (nothing allocated)")
    p.add_argument("--compare", action="store_true", help="print the memory profile against the analytical model")
    p.add_argument("--calibrate", nargs="*", help="moved: python -m planner.calibrate RUNS (refused in one line)")
    p.add_argument("--plan", nargs="+", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the provenance's command, also when called in-process
    try:
        return run(args)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

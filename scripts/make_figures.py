"""Regenerate the README figure from the planner's API (the same sweep as notebooks/compare_plans.ipynb).

    .venv/bin/python scripts/make_figures.py [--out docs/figures] [--gpus 8 16] [--sides 448 ... 3584]

Writes ``compare_plans_32b.png``: Qwen2.5-VL-32B on 8 and 16 H100s, LLM tokens/s of the planner's plan, uniform
TP and ZeRO-3 across image sizes 448x448 to 3584x3584, and the longest image each strategy fits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from planner.analysis import longest_sequences, plot_longest_sequences, plot_throughput, sweep  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL, GPUS = "qwen-vl-32b", (8, 16)
SIDES = (448, 896, 1344, 1792, 2688, 3584)
"""Square image sides in pixels: 1,024 to 65,536 vision tokens per sample."""
FIGURE = "compare_plans_32b.png"


def compare_plans_figure(path: Path, gpus: tuple[int, ...] = GPUS, sides: tuple[int, ...] = SIDES) -> None:
    """Throughput per strategy at each GPU count, and the longest sequence per strategy, in one row."""
    table = sweep(MODEL, gpus=list(gpus), image_sizes=list(sides), baselines=True)
    longest = longest_sequences(MODEL, list(gpus))
    fig, axes = plt.subplots(1, len(gpus) + 1, figsize=(16, 4.2))
    for ax, n in zip(axes, gpus):
        plot_throughput(table[table.num_gpus == n], ax)
        ax.set_title(f"Qwen2.5-VL-32B on {n} x H100 (x: last size that fits)")
    plot_longest_sequences(longest, axes[-1])
    axes[-1].set_title("longest square image that fits")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures", help="folder to write the PNG to")
    parser.add_argument("--gpus", type=int, nargs="+", default=list(GPUS), help="GPU counts (default: 8 16)")
    parser.add_argument("--sides", type=int, nargs="+", default=list(SIDES),
                        help="square image sides in pixels (default: the README figure's six)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    compare_plans_figure(args.out / FIGURE, tuple(args.gpus), tuple(args.sides))
    print(f"wrote {args.out / FIGURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Planning for a dataset: packing efficiency, header scans and ``plan --dataset`` time, on a generated
mixed-resolution dataset (``planner.analysis.mixed_resolution_histogram``: a stated, made-up mixture).

    .venv/bin/python benchmarks/data_pipeline.py [--samples 100000] [--packing-samples 5000] [--dir DIR]

Writes ``--samples`` rows of Qwen-VL / LLaVA conversations, each with its own image file: one real PNG is encoded
per distinct image size (sides rounded to multiples of 28 px, what the processor rounds to, to keep the encodes
few) and every row's file is a hard link to it (a complete image under a distinct path, so the scan opens and reads
the header of every one). Prints:

- packing efficiency (real LLM tokens / budget over the packs) of best-fit decreasing on ``--packing-samples``
  samples, for pack budgets of 1, 2 and 4 times the longest sample and for fixed budgets at the processor's
  default ``max_pixels`` and at 1,003,520 pixels (a common training setting);
- the header scan of all rows (``planner.dataset.read_dataset``, empty cache), the cached read, and the whole
  ``plan --dataset`` process with a cold and a warm cache;
- the runtime's loader (``runtime.data.packed_data.PackedConversations``) on the first ``--loader-samples`` rows at
  ``max_pixels`` 1,003,520: its start-up index per sample, and samples/s building samples (decode, the processor's
  resize and patchify, chat template and labels) in one process, against what one rank must build per second for
  the plan of Qwen2.5-VL-32B on 16 H100s for those rows (the plan's samples/s over its vision DP replicas: the
  TP / SP ranks of a replica each build the replica's samples). The images are flat-coloured PNGs, which decode
  faster than photographs; the tokenizer is the tests' byte-level one (one token per byte: slower per character
  than Qwen2's BPE); the tiny model's config has the 32B's patch geometry (14-pixel patches, 2 x 2 merge).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tokenizer and tiny config

from planner.analysis import mixed_resolution_histogram  # noqa: E402
from planner.api import DatasetInputs, plan  # noqa: E402
from planner.catalog import get_model  # noqa: E402
from planner.contract.data_rows import CACHE_ENV  # noqa: E402
from planner.dataset import pack_budgets, pack_dataset, read_dataset, sample_tokens  # noqa: E402

MODEL = "qwen-vl-32b"
LOADER_MAX_PIXELS = 1003520


def write_dataset(folder: Path, samples: int, seed: int = 0) -> Path:
    """``samples`` conversation rows with one image file each (hard links to one encoded PNG per size)."""
    histogram = mixed_resolution_histogram(samples, seed)
    originals = folder / "sizes"
    originals.mkdir(parents=True, exist_ok=True)
    rows, index = [], 0
    for count, text, images, _ in histogram.shapes:
        (h, w), = images
        h, w = max(28, round(h / 28) * 28), max(28, round(w / 28) * 28)
        original = originals / f"{w}x{h}.png"
        if not original.exists():
            Image.new("RGB", (w, h), (90, 120, 150)).save(original, compress_level=1)
        for _ in range(count):
            name = f"img/{index // 1000}/{index}.png"
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            os.link(original, folder / name)
            answer = "word " * max(1, (text - 30) // 2)
            rows.append(json.dumps({"image": name, "conversations": [
                {"from": "human", "value": "<image>\nDescribe the picture."}, {"from": "gpt", "value": answer}]}))
            index += 1
    path = folder / "data.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def packing_table(samples: int) -> list[str]:
    model = get_model(MODEL)
    histogram = mixed_resolution_histogram(samples, seed=1)
    lines = [f"packing efficiency over {samples:,} samples (best-fit decreasing):"]
    for label, pixels in (("processor default max_pixels", {}), ("max_pixels 1,003,520", {"max_pixels": 1003520})):
        tokens = sample_tokens(histogram, model, **pixels)
        budgets = pack_budgets(tokens) + [4096, 8192, 16384]
        for budget in sorted(set(b for b in budgets if b >= tokens.llm.max())):
            start = time.perf_counter()
            packing = pack_dataset(tokens, model, budget)
            lines.append(f"  {label:30} budget {budget:6,} LLM tokens: {packing.efficiency:6.1%} full, "
                         f"{packing.packed.samples_per_pack:5.2f} samples/pack, {packing.packs:5,} packs "
                         f"({time.perf_counter() - start:.2f} s)")
    return lines


def plan_process_s(data: Path, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "planner.cli", "--model", MODEL, "--gpus", "16", "--dataset", str(data),
                    "--out", os.devnull, "--profile", "none"],
                   check=True, env=env, capture_output=True)
    return time.perf_counter() - start


def loader_lines(data: Path, folder: Path, samples: int) -> list[str]:
    """The runtime loader's index and build rates on the first ``samples`` rows, against one rank's need."""
    from planner.cost.balance import plan_sample_work
    from runtime.models.model import hf_config_from_dict
    from runtime.data.packed_data import PackedConversations
    from runtime.models.families import family_of
    from tests.runtime.plans import tiny_hf_config
    from tests.runtime.tokenizer import save_tokenizer

    subset = data.parent / "loader.jsonl"  # beside the rows, whose image paths are relative
    subset.write_text("".join(data.read_text().splitlines(keepends=True)[:samples]))
    made = plan(MODEL, 16, dataset=DatasetInputs(source=str(subset), max_pixels=LOADER_MAX_PIXELS))
    info = made.workload.dataset
    need = made.predicted.samples_per_s / made.module("vision").dp
    start = time.perf_counter()
    config = hf_config_from_dict(tiny_hf_config())
    loader = PackedConversations(subset, save_tokenizer(folder / "tokenizer"), config=config,
                                 dataset=info.model_copy(update={"max_pixels": LOADER_MAX_PIXELS}), seed=0,
                                 work=plan_sample_work(made), normalization=family_of(config).encoder.image_normalization)
    index_s = time.perf_counter() - start
    built = min(len(loader.samples), 200)
    start = time.perf_counter()
    for i in range(built):
        loader.sample(i)
    rate = built / (time.perf_counter() - start)
    return [f"\nruntime loader on {len(loader.samples):,} samples (max_pixels {LOADER_MAX_PIXELS:,}, packs of "
            f"{info.pack_tokens:,} LLM tokens): index {index_s:.1f} s at start ({index_s / len(loader.samples) * 1e3:.2f}"
            f" ms per sample, every rank)",
            f"  builds {rate:.0f} samples/s in one process; one rank of the 32B plan on 16 H100s needs "
            f"{need:.1f} samples/s ({made.predicted.samples_per_s:.1f} samples/s over {made.module('vision').dp} vision "
            f"replicas): {rate / need:.1f}x its need"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--packing-samples", type=int, default=5_000)
    parser.add_argument("--loader-samples", type=int, default=3_000)
    parser.add_argument("--dir", help="where to write the dataset (default: a temporary folder)")
    args = parser.parse_args(argv)
    print("\n".join(packing_table(args.packing_samples)))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.dir or tmp)
        start = time.perf_counter()
        data = write_dataset(folder / "dataset", args.samples)
        print(f"\nwrote {args.samples:,} rows and image files in {time.perf_counter() - start:.1f} s")
        env = {**os.environ, CACHE_ENV: str(folder / "cache")}
        os.environ[CACHE_ENV] = str(folder / "cache-scan")
        start = time.perf_counter()
        histogram = read_dataset(data)
        scan = time.perf_counter() - start
        start = time.perf_counter()
        read_dataset(data)
        cached = time.perf_counter() - start
        print(f"header scan of {histogram.samples:,} samples: {scan:.1f} s ({scan / histogram.samples * 1e6:.0f} us "
              f"per sample); cached read {cached:.2f} s")
        cold, warm = plan_process_s(data, env), plan_process_s(data, env)
        print(f"plan --dataset ({args.samples:,} samples, 16 GPUs, 3 pack budgets): {cold:.1f} s with an empty "
              f"cache, {warm:.1f} s with the cached histogram")
        print("\n".join(loader_lines(data, folder, args.loader_samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

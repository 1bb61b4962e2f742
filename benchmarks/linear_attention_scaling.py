"""How a Gated DeltaNet (linear-attention) layer and a gated full-attention layer of Qwen3.5 grow with the sequence,
measured by the profiler's shards on this machine beside the planner's model of the same layers.

    .venv/bin/python benchmarks/linear_attention_scaling.py [--seq 512 1024 2048 4096 8192] [--repeats 3]

For each sequence length: the profiler's measured forward + backward (``runtime.profile.measure.time_shard``, medians)
of one layer of each type of ``qwen3.5-tiny`` (fp32, one sample, this CPU; transformers' torch chunked delta rule and
causal conv where fla is not installed), the ratio to the previous length (2.0 per doubling is linear, 4.0
quadratic), and the same ratio of the planner's analytical time (``planner.cost.layers.layer_terms`` on the ``cpu``
device). Then the layers' saved activations per token as the profiler's fake pass counts them (fp32) against the
planner's, priced as the profile runs: fp32 activations, transformers' torch kernel.
"""

from __future__ import annotations

import argparse

import torch

from planner.catalog import get_model
from planner.contract.hardware import get_device
from planner.cost.assumptions import CostAssumptions
from planner.cost.comm import Link
from planner.cost.layers import Shard, layer_terms
from runtime.profile.measure import TimingConfig, analyze_fake, time_shard
from runtime.profile.shards import build_shard, hf_config

MODEL = "qwen3.5-tiny"
LAYERS = ("linear_decoder_layer", "decoder_layer")
AS_PROFILED = CostAssumptions(activation_bytes=4, linear_attention_kernel="torch")
"""The profile runs fp32 on a CPU: transformers' torch fallbacks run its linear-attention layers."""


def predicted(layer, seq: int):
    """The planner's terms of one layer over one ``seq``-token sample on the ``cpu`` device, unsharded, priced as
    profiled (``AS_PROFILED``)."""
    link = Link(bandwidth=1e10, latency=1e-5)
    shard = Shard(tp=1, sp=1, cp=1, micro_batch=1, tokens=seq, segment_tokens=seq, segments=1, window_tokens=0.0,
                  windows=0, recompute="none", backward="full", tp_link=link, sp_link=link, cp_link=link,
                  device=get_device("cpu"), assumptions=AS_PROFILED)
    return layer_terms(layer, shard)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = get_model(MODEL)
    config = hf_config(model.hf_config)
    cfg = TimingConfig(warmup=1, repeats=args.repeats)
    print(f"{MODEL}: one layer of each type, fp32, 1 thread, forward + backward medians of {args.repeats}")
    print(f"{'tokens':>7} | " + " | ".join(f"{name:>34}" for name in LAYERS))
    print(f"{'':>7} | " + " | ".join(f"{'ms':>9} {'x prev':>7} {'planner x prev':>15}" for _ in LAYERS))
    previous: dict[str, tuple[float, float]] = {}
    for seq in args.seq:
        cells = []
        for name in LAYERS:
            layer = model.module("llm").layer(name)
            forward, backward, _, _ = time_shard(build_shard(config, layer, tp=1, sp=1), seq, 1, cfg)
            measured = forward.median_s + backward.median_s
            terms = predicted(layer, seq)
            planned = terms.forward_s + terms.backward_s
            if name in previous:
                was, was_planned = previous[name]
                cells.append(f"{measured * 1e3:9.1f} {measured / was:7.2f} {planned / was_planned:15.2f}")
            else:
                cells.append(f"{measured * 1e3:9.1f} {'':>7} {'':>15}")
            previous[name] = (measured, planned)
        print(f"{seq:>7} | " + " | ".join(cells))
    seq = args.seq[0]
    print(f"\nsaved activations per token at {seq} tokens (fp32 bytes): profiler's fake pass vs the planner's")
    for name in LAYERS:
        layer = model.module("llm").layer(name)
        fake = analyze_fake(lambda: build_shard(config, layer, tp=1, sp=1), seq, 1, dtype=torch.float32)
        planned = predicted(layer, seq).saved_bytes
        print(f"  {name:>22}: {fake.saved_activation_bytes / seq:8.0f} vs {planned / seq:8.0f} "
              f"({fake.saved_activation_bytes / planned:.2f}x)")


if __name__ == "__main__":
    main()

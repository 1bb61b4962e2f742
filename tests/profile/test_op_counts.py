"""The planner's operator-call table (planner/cost/op_counts.py) against the runtime's own layers, recounted: every
layer of Qwen2.5-VL, and Qwen3.5's two decoder layers (the Gated DeltaNet one on the torch kernel, over rows and
packed samples of 2 or 3 chunks each)."""

import pytest
import torch
import torch.distributed as dist

from planner.catalog import get_model
from planner.cost.linear_attention import linear_kernel_calls, linear_kernel_chunks
from planner.cost.op_counts import LAYER_OPS, context_parallel_ops, layer_pass_ops, linear_attention_pass_ops, ops_row, optimizer_pass_ops
from runtime.training.optim import adamw, grad_sq_norm, scale_gradients
from runtime.profile.as_run import build_rank, count_layer_ops
from runtime.profile.device import free_port
from runtime.profile.ops import OpCounter, host_seconds_per_op
from tests.runtime.ranks import start_ranks

MODEL = "qwen2.5-vl-tiny"
POINTS = {"vision": ((256, 1), (1024, 1), (256, 2)), "llm": ((64, 1), (64, 2))}
HYBRID = "qwen3.5-tiny"
LINEAR_POINTS = ((128, 1, False), (192, 2, False), (128, 2, True))
"""(tokens per sample, samples, packed in one row) of the linear-attention layer: 2 or 3 chunks a segment, enough to
tell the fixed, per-segment and per-chunk calls apart."""
CHUNK = 64
"""transformers' torch rule's chunk (``CostAssumptions.linear_attention_chunk``)."""


def _near(got: float, want: float, relative: float, absolute: float) -> bool:
    return abs(got - want) <= max(absolute, relative * want)


def _wrong(name: str, counted, table) -> list[str]:
    """``name`` when a (forward, backward) recount differs from the table by more than 5 % (at least 2) in calls or
    DTensor calls, or by more than a quarter (at least 3) in kernels (a leaf's gradient-accumulation kernels vary
    with the inputs)."""
    wrong = []
    for pass_name, got, want in zip(("forward", "backward"), counted, table):
        if not (_near(got.ops, want.ops, 0.05, 2) and _near(got.dtensor_ops, want.dtensor_ops, 0.05, 2)
                and _near(got.kernels, want.kernels, 0.25, 3)):
            wrong.append(f"{name} {pass_name}: counted {got}, table {want}")
    return wrong


def _hybrid_mismatches(tp: int, sp: int, rank: int) -> list[str]:
    """Qwen3.5's decoder layers: the gated full-attention layer's row; the Gated DeltaNet layer's on the torch
    kernel, its conv and rule called as often as the planner prices (``linear_kernel_calls``: once over the rows,
    once per sample of a packed row, which the planner sees as one pack of that many segments) and its loop run
    ``linear_kernel_chunks`` times."""
    ranked = build_rank(HYBRID, tp=tp, sp=sp, rank=rank, dtype=torch.float32, device=torch.device("cpu"))
    wrong = []
    for layer in get_model(HYBRID).module("llm").layers:
        if layer.kind != "decoder_layer":
            continue
        if layer.linear_attention is None:
            for seq_len, micro_batch in POINTS["llm"]:
                forward, backward, _ = count_layer_ops(ranked, layer, seq_len, micro_batch)
                table = layer_pass_ops(ops_row(layer), tp=tp, segments=0, ulysses=sp > 1)
                wrong += _wrong(f"{HYBRID} {layer.name} s{seq_len} mb{micro_batch} tp{tp} sp{sp}", (forward, backward),
                                table)
            continue
        for seq_len, samples, packed in LINEAR_POINTS:
            forward, backward, segments = count_layer_ops(ranked, layer, seq_len, samples, packed)
            calls = linear_kernel_calls(samples, 1) if packed else linear_kernel_calls(1, samples)
            name = f"{HYBRID} {layer.name} s{seq_len} x{samples} packed={packed} tp{tp} sp{sp}"
            if segments != calls:
                wrong.append(f"{name}: {segments} kernel calls, priced {calls}")
            table = linear_attention_pass_ops("torch", tp=tp, calls=calls,
                                              chunks=linear_kernel_chunks(calls, seq_len, CHUNK), ulysses=sp > 1)
            wrong += _wrong(name, (forward, backward), table)
    return wrong


def _mismatches(tp: int, sp: int, rank: int) -> list[str]:
    """Every (layer, point) whose recount differs from the table (``_wrong``), Qwen2.5-VL's and Qwen3.5's decoder
    layers' (``_hybrid_mismatches``). Under Ulysses full attention loops over the whole sequence's segments, one
    image per sample here."""
    ranked = build_rank(MODEL, tp=tp, sp=sp, rank=rank, dtype=torch.float32, device=torch.device("cpu"))
    wrong = _hybrid_mismatches(tp, sp, rank)
    for module in get_model(MODEL).modules:
        for layer in module.layers:
            if sp > 1 and layer.kind not in ("vision_block", "decoder_layer"):
                continue
            for seq_len, micro_batch in POINTS[module.name]:
                forward, backward, segments = count_layer_ops(ranked, layer, seq_len, micro_batch)
                ulysses = sp > 1 and (layer.kind == "decoder_layer" or layer.attention.window_patches is None)
                if ulysses and layer.kind == "vision_block":
                    segments = micro_batch
                table = layer_pass_ops(layer.kind, tp=tp, segments=segments, ulysses=ulysses)
                wrong += _wrong(f"{layer.name} s{seq_len} mb{micro_batch} tp{tp} sp{sp}", (forward, backward), table)
    return wrong


def test_replicated_layers_match_the_table():
    assert _mismatches(1, 1, 0) == []


@pytest.mark.parametrize("model, modules", [(MODEL, ("vision", "llm")), (HYBRID, ("llm",))])
def test_parameter_tensors_match_the_table(model, modules):
    ranked = build_rank(model, tp=1, sp=1, rank=0, dtype=torch.float32, device=torch.device("cpu"))
    for name in modules:
        for layer in get_model(model).module(name).layers:
            runner, _ = ranked.runner(layer, *POINTS[name][0])
            assert len(list(runner.parameters())) == LAYER_OPS[ops_row(layer)].param_tensors, layer.name


def test_optimizer_calls_match_the_table():
    for foreach in (True, False):
        for tensors in (4, 8):
            layers = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False) for _ in range(tensors)])
            for p in layers.parameters():
                p.grad = torch.ones_like(p)
            optimizer = adamw(layers.parameters(), lr=1e-3, weight_decay=0.1)
            optimizer.defaults["foreach"] = foreach
            for group in optimizer.param_groups:
                group["foreach"] = foreach
            optimizer.step()  # Adam's states are created at the first step
            with OpCounter() as counter:
                float(grad_sq_norm(layers).sqrt())
                scale_gradients(layers, 0.5)
                optimizer.step()
            assert counter.count.ops == optimizer_pass_ops(tensors, foreach=foreach, dtensor=False).ops


def _worker(rank: int, world: int, port: int, tp: int, sp: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        wrong = _mismatches(tp, sp, rank)
        if rank == 0:
            with open(out, "w") as f:
                f.write("\n".join(wrong))
        dist.barrier()  # a rank that tears gloo down while its peer still counts can abort that peer
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tp,sp", [(2, 1), (1, 2)])
def test_sharded_layers_match_the_table(tmp_path, tp, sp):
    out = tmp_path / "mismatches.txt"
    start_ranks(_worker, (tp * sp, free_port(), tp, sp, str(out)), tp * sp)
    assert out.read_text() == ""


def test_counter_counts_calls_and_kernels_and_the_probe_times_a_call():
    with OpCounter() as counter:
        torch.ones(3).add(1).view(3, 1)
    assert (counter.count.ops, counter.count.kernels) == (3, 2)  # ones, add, view (no kernel)
    assert 0 < host_seconds_per_op(repeats=3) < 1e-3


CP_POINTS = (("full_block", 256, 4, False, "gathered"), ("decoder_layer", 64, 1, False, "ring"),
             ("decoder_layer", 64, 2, True, "gathered_masked"))
"""(layer, tokens per sample, samples, packed in one row, CP form) recounted at cp = 2: a vision full-attention block
over two images' parts, a decoder row over the ring, a packed row of two samples."""


def _context_parallel_mismatches(rank: int, cp: int) -> list[str]:
    """Rank 0's (the ring's busiest) recount of each ``CP_POINTS`` layer against its row plus its CP form's calls
    (``context_parallel_ops``); the vision block's loop runs over the segments its part meets."""
    ranked = build_rank(MODEL, tp=1, sp=1, rank=rank, dtype=torch.float32, device=torch.device("cpu"), cp=cp)
    layers = {layer.name: layer for module in get_model(MODEL).modules for layer in module.layers}
    wrong = []
    for name, seq_len, samples, packed, form in CP_POINTS:
        layer = layers[name]
        forward, backward, segments = count_layer_ops(ranked, layer, seq_len, samples, packed)
        row = layer_pass_ops(layer.kind, tp=1, segments=segments if layer.kind == "vision_block" else 0,
                             ulysses=False)
        extra = context_parallel_ops(form, cp)
        wrong += _wrong(f"{name} s{seq_len} x{samples} packed={packed} cp{cp}", (forward, backward),
                        (row[0].plus(extra[0]), row[1].plus(extra[1])))
    return wrong


def _cp_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        wrong = _context_parallel_mismatches(rank, world)
        if rank == 0:
            with open(out, "w") as f:
                f.write("\n".join(wrong))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_context_parallel_layers_match_the_table(tmp_path):
    out = tmp_path / "mismatches.txt"
    start_ranks(_cp_worker, (2, free_port(), str(out)), 2)
    assert out.read_text() == ""

"""The measurement side: shards, FLOP formula, fake memory, and a small real profiling run of the tiny model."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from planner.catalog import get_model
from planner.profiles import load_profile
from runtime.profile.__main__ import main
from runtime.profile.flops import flop_counter
from runtime.profile.measure import analyze_fake
from runtime.profile.shards import build_shard, hf_config

TINY = get_model("qwen2.5-vl-tiny")
CONFIG = hf_config(TINY.hf_config)


def layer(module: str, name: str):
    return TINY.module(module).layer(name)


def fake(module: str, name: str, *, tp=1, sp=1, seq=128, mb=1):
    return analyze_fake(lambda: build_shard(CONFIG, layer(module, name), tp=tp, sp=sp), seq, mb, dtype=torch.float32)


def test_cpu_sdpa_flops_by_hand():
    # b=2, h=4, s=64, d=16: QK^T and PV are each 2*b*h*s*s*d = 1,048,576 FLOPs; backward is 2.5x (five matmuls).
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as stock:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert stock.get_total_flops() == 0  # why the formula has to be registered
    with flop_counter() as fwd:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with flop_counter() as bwd:
        out.sum().backward()
    assert fwd.get_total_flops() == 2 * 1_048_576
    assert bwd.get_total_flops() == 5 * 1_048_576


@pytest.mark.parametrize("module, name", [(m.name, l.name) for m in TINY.modules for l in m.layers])
def test_unsharded_shard_has_the_catalog_parameter_count(module, name):
    shard = build_shard(CONFIG, layer(module, name), tp=1, sp=1)
    assert sum(p.numel() for p in shard.parameters()) == layer(module, name).params


@pytest.mark.parametrize("module, name", [("llm", "decoder_layer"), ("vision", "full_block"), ("vision", "window_block")])
@pytest.mark.parametrize("tp, sp", [(2, 1), (1, 2)])
def test_tp_and_ulysses_shards_do_half_the_flops(module, name, tp, sp):
    # TP=2 halves every matmul and the heads; SP=2 halves the tokens of the matmuls and, in attention, the heads.
    whole, half = fake(module, name), fake(module, name, tp=tp, sp=sp)
    assert half.forward_flops * 2 == whole.forward_flops
    assert half.backward_flops * 2 == whole.backward_flops


QWEN3_5 = get_model("qwen3.5-tiny")
QWEN3_5_CONFIG = hf_config(QWEN3_5.hf_config)


@pytest.mark.parametrize("module, name", [(m.name, l.name) for m in QWEN3_5.modules for l in m.layers])
def test_qwen3_5_shards_have_the_catalog_parameter_count(module, name):
    """Qwen3.5's layers are built from its own classes (a Gated DeltaNet layer, a gated full-attention layer, the
    Qwen3-VL-style tower with its position table), not measured as Qwen2.5-VL's."""
    shard = build_shard(QWEN3_5_CONFIG, QWEN3_5.module(module).layer(name), tp=1, sp=1)
    assert sum(p.numel() for p in shard.parameters()) == QWEN3_5.module(module).layer(name).params


def _qwen3_5_fake(name: str, *, tp=1, seq=256):
    layer = QWEN3_5.module("llm").layer(name)
    return analyze_fake(lambda: build_shard(QWEN3_5_CONFIG, layer, tp=tp, sp=1), seq, 1, dtype=torch.float32)


def test_a_linear_attention_layers_work_and_memory_grow_linearly_and_a_full_attention_layers_faster():
    """The Gated DeltaNet layer's counted FLOPs and saved bytes double with the sequence (chunks of 64 tokens, a
    state carried between them); the full-attention layer's FLOPs more than double (its scores); TP2 builds half of
    every head kind."""
    linear = [_qwen3_5_fake("linear_decoder_layer", seq=seq) for seq in (256, 512)]
    full = [_qwen3_5_fake("decoder_layer", seq=seq) for seq in (256, 512)]
    assert linear[1].forward_flops == pytest.approx(2 * linear[0].forward_flops, rel=1e-4)
    assert linear[1].saved_activation_bytes == pytest.approx(2 * linear[0].saved_activation_bytes, rel=0.01)
    assert full[1].forward_flops > 2.5 * full[0].forward_flops
    shard = build_shard(QWEN3_5_CONFIG, QWEN3_5.module("llm").layer("linear_decoder_layer"), tp=2, sp=1).layer
    text = QWEN3_5_CONFIG.text_config
    assert (shard.linear_attn.num_k_heads, shard.linear_attn.num_v_heads) == (text.linear_num_key_heads // 2,
                                                                             text.linear_num_value_heads // 2)
    assert shard.mlp.gate_proj.out_features == text.intermediate_size // 2


def test_window_attention_costs_less_than_full():
    assert fake("vision", "window_block", seq=256).forward_flops < fake("vision", "full_block", seq=256).forward_flops


def test_fake_saved_bytes_of_lm_head_by_hand():
    # lm_head + loss keeps: its input (mb*s*hidden fp32), log_softmax output (mb*s*vocab fp32), int64 labels and
    # nll_loss's fp32 total_weight scalar. The weight is a parameter, not counted.
    mb, s, hidden, vocab = 2, 256, 128, 1024
    got = fake("llm", "lm_head", seq=s, mb=mb)
    assert got.saved_activation_bytes == mb * s * hidden * 4 + mb * s * vocab * 4 + mb * s * 8 + 4
    assert got.param_bytes == hidden * vocab * 4
    half = fake("llm", "lm_head", seq=s, mb=mb, tp=2)
    assert half.saved_activation_bytes == mb * s * hidden * 4 + mb * s * vocab // 2 * 4 + mb * s * 8 + 4


def test_fake_memory_scales_with_micro_batch():
    one, two = fake("llm", "decoder_layer", mb=1), fake("llm", "decoder_layer", mb=2)
    assert two.saved_activation_bytes == 2 * one.saved_activation_bytes
    assert one.peak_bytes >= one.saved_activation_bytes > 0


@pytest.mark.slow
def test_tiny_profile_run_and_resume(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    args = ["--model", "qwen2.5-vl-tiny", "--out", str(out), "--vision-seq", "256", "--llm-seq", "128",
            "--micro-batches", "1", "--tp", "1", "--sp", "1,2", "--repeats", "2", "--warmup", "0", "--no-device-bench"]
    assert main(args) == 0
    profile = load_profile(out)
    names = {(p.module, p.layer) for p in profile.layers}
    assert {("vision", "window_block"), ("vision", "full_block"), ("vision", "patch_merger"), ("llm", "decoder_layer"),
            ("llm", "embedding"), ("llm", "lm_head")} <= names
    assert {p.sp for p in profile.layers} == {1, 2}
    for p in profile.layers:
        assert p.forward.min_s <= p.forward.median_s <= p.forward.max_s and p.forward.repeats == 2
        assert p.optimizer is not None and p.optimizer.repeats == 2 and p.optimizer.median_s > 0
        assert p.optimizer_pair is not None and p.optimizer_pair.median_s > 0
    assert profile.provenance.torch_version == torch.__version__ and profile.provenance.command.startswith("python -m")
    capsys.readouterr()
    assert main(args) == 0
    assert "0 new point(s)" in capsys.readouterr().out


@pytest.mark.parametrize(("model", "message"), [
    ("no-such-model", "unknown model"),
    # its layers are not the shards the profiler builds: refused, not measured as another family's
    ("qwen3-vl-tiny", "the profiler builds the layers of qwen2_5_vl, qwen3_5 models, not qwen3_vl"),
])
def test_cli_errors_are_one_line(capsys, model, message):
    assert main(["--model", model, "--out", "unused.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and message in err


def test_compare_with_analytical_memory_model():
    from planner.profiles.compare import compare, error_by_layer, format_table
    from runtime.profile.layers import Grid, grid_points, memory_point

    grid = Grid(seq_lens={"llm": (256,)}, micro_batches=(1,), tps=(1, 2), sps=(1,), layers=("llm.lm_head", "llm.decoder_layer"))
    points = [memory_point(TINY, p, torch.bfloat16) for p in grid_points(TINY, grid)]
    rows = compare(TINY, points)
    errors = error_by_layer(rows)
    # lm_head: the model's input + fp32 log-softmax matches what autograd keeps to within the labels (int64).
    assert errors[("llm", "lm_head")][0] < 0.01
    assert all(r.param_error == pytest.approx(0, abs=0.01) for r in rows)
    assert "llm.decoder_layer" in format_table(rows)


def test_noisy_points_are_the_slower_shorter_ones():
    from planner.profiles import LayerPoint, Spread
    from runtime.profile.layers import noisy_points

    def point(seq, fwd):
        s = Spread(median_s=fwd, min_s=fwd, max_s=fwd, repeats=1)
        return LayerPoint(module="llm", layer="decoder_layer", tp=1, sp=1, seq_len=seq, micro_batch=1, forward=s,
                          backward=s, recompute=s, forward_flops=0, backward_flops=0, saved_activation_bytes=0,
                          peak_bytes=0)

    points = [point(128, 1.0), point(256, 9.0), point(512, 4.0), point(1024, 8.0)]
    assert noisy_points(points) == {points[1].key}
    # 3.0 at 512 lies above the chord of 1.0 at 256 and 4.0 at 1024 (2.0) by more than 15 %; 2.2 does not
    points = [point(256, 1.0), point(512, 3.0), point(1024, 4.0)]
    assert noisy_points(points) == {points[1].key}
    assert noisy_points([point(256, 1.0), point(512, 2.2), point(1024, 4.0)]) == set()
    # a median far above the fastest repeat: most repeats were disturbed
    disturbed = point(512, 2.0).model_copy(update={"backward": Spread(median_s=2.0, min_s=1.0, max_s=3.0, repeats=5)})
    assert noisy_points([point(256, 1.0), disturbed, point(1024, 4.0)]) == {disturbed.key}


def test_as_run_points_only_where_the_runtime_shards():
    from runtime.profile.as_run import can_run_as_run
    from runtime.profile.layers import Grid, grid_points

    grid = Grid(seq_lens={"vision": (64, 256), "llm": (64,)}, micro_batches=(1,), tps=(1, 2), sps=(1, 2))
    chosen = {(p.module, p.layer.name, p.tp, p.sp, p.seq_len) for p in grid_points(TINY, grid)
              if can_run_as_run(CONFIG, p, max_ranks=2)}
    assert ("llm", "decoder_layer", 2, 1, 64) in chosen and ("vision", "full_block", 1, 2, 256) in chosen
    assert all(tp * sp == 2 for _, _, tp, sp, _ in chosen)  # degree 1 is the single-process profile
    assert ("llm", "decoder_layer", 1, 2, 64) in chosen  # LLM Ulysses
    assert ("vision", "full_block", 1, 2, 64) not in chosen  # one 8x8 window: the runtime cannot split it over 2
    assert not any(can_run_as_run(CONFIG, p, max_ranks=1) for p in grid_points(TINY, grid))


@pytest.mark.slow
def test_as_run_profile_of_tp2_and_ulysses2(tmp_path, capsys):
    out = tmp_path / "as_run.json"
    args = ["--model", "qwen2.5-vl-tiny", "--out", str(out), "--threads", "1", "--vision-seq", "256", "--llm-seq", "64",
            "--micro-batches", "1", "--tp", "1,2", "--sp", "1,2", "--layers",
            "vision.full_block,llm.decoder_layer,llm.lm_head",
            "--repeats", "1", "--warmup", "0", "--as-run"]
    assert main(args) == 0
    profile = load_profile(out)
    assert {(p.layer, p.tp, p.sp) for p in profile.layers} == {
        (layer, tp, sp) for layer in ("full_block", "decoder_layer", "lm_head") for tp, sp in ((2, 1), (1, 2))}
    for p in profile.layers:
        assert p.includes_comm and p.forward.repeats == 1 and p.forward.median_s > 0 and p.backward.median_s > 0
        assert p.optimizer is not None and p.optimizer.median_s > 0 and p.optimizer_pair.median_s > 0
        # FLOPs are one rank's: those of the single-process shard of the same degree.
        assert p.forward_flops == fake(p.module, p.layer, tp=p.tp, sp=p.sp, seq=p.seq_len).forward_flops
    assert profile.provenance.command.endswith("--as-run")  # the arguments given, not pytest's
    capsys.readouterr()
    assert main(args) == 0
    assert "0 new point(s)" in capsys.readouterr().out

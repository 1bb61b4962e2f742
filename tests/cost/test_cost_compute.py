"""Roofline, small-GEMM efficiency and attention FLOPs against hand calculations."""

from dataclasses import replace

import pytest
from cost_toys import TOY_DEVICE

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS
from planner.cost.compute import (
    attention_core_time,
    attention_efficiency,
    attention_flops,
    elementwise_time,
    gemm_bytes,
    gemm_flops,
    gemm_time,
    matmul_efficiency,
    bucket_copy_time,
    optimizer_pass_time,
    optimizer_step_time,
    roofline_time,
)

A = DEFAULT_ASSUMPTIONS


def test_gemm_flops_and_bytes():
    assert gemm_flops(2, 3, 4) == 48  # 2 * 2 * 3 * 4
    assert gemm_bytes(2, 3, 4, 2) == 2 * (8 + 12 + 6)


def test_matmul_efficiency_curve():
    # at d = d_half the GEMM reaches half of max efficiency
    assert matmul_efficiency(4096, 128, 4096, A) == pytest.approx(A.max_matmul_efficiency / 2)
    # 1280-wide: 0.7 * 1280 / 1408; split 8 ways (160): 0.7 * 160 / 288
    wide = matmul_efficiency(9216, 1280, 1280, A)
    split = matmul_efficiency(9216, 160, 1280, A)
    assert wide == pytest.approx(0.7 * 1280 / 1408)
    assert split == pytest.approx(0.7 * 160 / 288)
    assert split < 0.65 * wide  # markedly slower per FLOP
    assert matmul_efficiency(0, 10, 10, A) == 0.0


def test_roofline_takes_the_larger():
    assert roofline_time(1e12, 1e9, 1e15, 1e12) == pytest.approx(1e-3)  # compute 1 ms vs memory 1 ms
    assert roofline_time(1e12, 4e9, 1e15, 1e12) == pytest.approx(4e-3)  # memory-bound


def test_gemm_time_compute_bound():
    # 8192^3: 2*8192^3 = 1.0995e12 FLOPs at 1e15 * 0.7 * 8192/8320
    m = 8192
    expected = 2 * m**3 / (1e15 * 0.7 * m / (m + 128))
    assert gemm_time(m, m, m, TOY_DEVICE, A) == pytest.approx(expected)


def test_gemm_time_memory_bound_for_skinny_gemm():
    # m=1 vector-matrix: bytes 2*(4096 + 4096*4096 + 4096) dominate at 2e12 * 0.8
    expected = 2 * (4096 + 4096 * 4096 + 4096) / (2e12 * 0.8)
    assert gemm_time(1, 4096, 4096, TOY_DEVICE, A) == pytest.approx(expected)


def test_gemm_time_of_split_vision_gemm_is_slower_per_flop():
    whole = gemm_time(9216, 1280, 1280, TOY_DEVICE, A) / gemm_flops(9216, 1280, 1280)
    split = gemm_time(9216, 160, 1280, TOY_DEVICE, A) / gemm_flops(9216, 160, 1280)
    assert split > 1.5 * whole


def test_attention_flops():
    # 4 s^2 width: s=1024, width=2048 (16 heads x 128) -> 4 * 2^20 * 2^11 = 2^33
    assert attention_flops(1024, 1, 2048, 1.0) == 2**33
    # causal kernel skipping masked blocks: half
    assert attention_flops(1024, 1, 2048, 0.5) == 2**32
    # 144 windows of 64 tokens vs one 9216 segment: 144 * 64^2 vs 9216^2 -> 144x fewer FLOPs
    assert attention_flops(9216, 1, 1280, 1) / attention_flops(64, 144, 1280, 1) == pytest.approx(144)


def test_attention_efficiency_saturates():
    assert attention_efficiency(128, A) == pytest.approx(A.flash_attention_efficiency / 2)
    assert attention_efficiency(64, A) < attention_efficiency(9216, A)
    eager = replace(A, attention_implementation="eager")
    assert attention_efficiency(128, eager) == pytest.approx(A.eager_attention_efficiency / 2)


def test_attention_core_time_flash_vs_eager():
    flops, keys, scores = 1e12, 4096, 1e9
    flash = attention_core_time(flops, keys, scores, TOY_DEVICE, A)
    assert flash == pytest.approx(1e12 / (1e15 * 0.55 * 4096 / (4096 + 128)))
    eager_a = replace(A, attention_implementation="eager")
    eager = attention_core_time(flops, keys, scores, TOY_DEVICE, eager_a)
    compute = 1e12 / (1e15 * 0.6 * 4096 / 4224)
    traffic = 1e9 * 16 / (2e12 * 0.8)
    assert eager == pytest.approx(compute + traffic)


def test_optimizer_step_time():
    # bf16 mixed: 2 (grad) + 2*12 (fp32 master, m, v read + written) + 2*2 (weights) = 30 B/param
    # 1e9 params * 30 B / (2e12 B/s * 0.8)
    mixed = A.bytes_per_param("bf16_mixed")
    assert optimizer_step_time(1e9, mixed, TOY_DEVICE, A) == pytest.approx(30e9 / 1.6e12)
    # bf16 pure: 2 + 2*4 + 2*2 = 14 B/param
    pure = A.bytes_per_param("bf16_pure")
    assert optimizer_step_time(1e9, pure, TOY_DEVICE, A) == pytest.approx(14e9 / 1.6e12)


def test_optimizer_pass_time_is_host_bound_over_many_small_tensors():
    from dataclasses import replace

    mixed = A.bytes_per_param("bf16_mixed")
    host = replace(A, host_seconds_per_op=5e-6, dtensor_seconds_per_op=10e-6)
    gpu = replace(TOY_DEVICE, kernel_launch_latency=0.0, host_overlap=1.0)
    # 1e6 params in 1,000 tensors: memory 30e6 / 1.6e12 = 19 us; multi-tensor host 20 + 3 * 1000 calls * 5 us = 15.1 ms
    assert optimizer_pass_time(1e6, 1000, mixed, dtensor=False, device=gpu, assumptions=host) == pytest.approx(
        3020 * 5e-6)
    # DTensor parameters: every call 10 us more
    assert optimizer_pass_time(1e6, 1000, mixed, dtensor=True, device=gpu, assumptions=host) == pytest.approx(
        3020 * 15e-6)
    # per-parameter loop: 10 + 11 per tensor
    per_param = replace(host, optimizer_foreach=False)
    assert optimizer_pass_time(1e6, 1000, mixed, dtensor=False, device=gpu, assumptions=per_param) == pytest.approx(
        11010 * 5e-6)
    # 1e10 params: memory-bound (30e10 / 1.6e12 = 0.1875 s)
    assert optimizer_pass_time(1e10, 1000, mixed, dtensor=False, device=gpu, assumptions=host) == pytest.approx(
        0.1875)


def test_elementwise_time():
    # 1e9 elements * 2 B * factor 3 / (2e12 * 0.8)
    assert elementwise_time(1e9, TOY_DEVICE, A) == pytest.approx(6e9 / 1.6e12)


def test_bucket_copy_time():
    # 2 copies x (read + write) x 1e9 B = 4e9 B at 2e12 * 0.8 B/s
    assert bucket_copy_time(1e9, 2, TOY_DEVICE, A) == pytest.approx(4e9 / 1.6e12)
    assert bucket_copy_time(1e9, 0, TOY_DEVICE, A) == 0.0

"""Device microbenchmarks: achieved matmul FLOP/s versus size and memory bandwidth, and what the machine is."""

from __future__ import annotations

import platform
import socket
import statistics
import time

import torch

from planner.profiles import DeviceMeasurements, MatmulPoint


def free_port() -> int:
    """A TCP port on localhost nothing listens on (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def matmul_flops(n: int, *, dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """Achieved FLOP/s of an n x n by n x n matmul (2 n^3 FLOPs)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / _timed(lambda: a @ b, device, repeats)


def copy_bandwidth(num_bytes: int, *, device: torch.device, repeats: int = 5) -> float:
    """Bytes/s of copying a ``num_bytes`` buffer (each byte read once and written once: 2 * bytes moved)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _timed(lambda: dst.copy_(src), device, repeats)


def measure_device(
    *, dtype: torch.dtype, device: torch.device, sizes: tuple[int, ...] = (256, 512, 1024, 2048), copy_bytes: int = 256 << 20
) -> DeviceMeasurements:
    """Matmul FLOP/s at each size and the copy bandwidth of a buffer larger than the caches."""
    return DeviceMeasurements(
        matmul=[MatmulPoint(n=n, flops_per_s=matmul_flops(n, dtype=dtype, device=device)) for n in sizes],
        memory_bandwidth=copy_bandwidth(copy_bytes, device=device),
    )


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return model


def device_detail(device: torch.device) -> str:
    """What the hardware calls itself: the GPU name, or the CPU model and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.get_num_threads()} threads)"

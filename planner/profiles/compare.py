"""Measured (FakeTensor) memory of layer shards against the analytical memory model, with the error per layer type.

Compares, for every MemoryPoint of a profile, the bytes autograd saved for backward and the shard's parameter
bytes with ``planner.cost`` (``layer_terms(...).saved_bytes``, ``layer_params_per_rank``) at the same shard
(TP, SP, tokens, no recomputation, full backward). Error = (analytical - measured) / measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from planner.cost.assumptions import CostAssumptions
from planner.cost.comm import Link
from planner.cost.layers import Shard, layer_terms
from planner.cost.memory import layer_params_per_rank
from planner.contract.hardware import get_device
from planner.contract.models import ModelSpec
from planner.profiles import MemoryPoint, load_profile

MiB = 2**20


@dataclass(kw_only=True, frozen=True)
class MemoryComparison:
    """One shard's measured and analytical memory."""

    point: MemoryPoint
    """The measured point."""
    analytical_saved_bytes: float
    """The cost model's activation bytes kept for backward."""
    analytical_param_bytes: float
    """The cost model's parameter bytes on this rank."""

    @property
    def saved_error(self) -> float:
        return (self.analytical_saved_bytes - self.point.saved_activation_bytes) / self.point.saved_activation_bytes

    @property
    def param_error(self) -> float:
        return (self.analytical_param_bytes - self.point.param_bytes) / self.point.param_bytes


def _shard(model: ModelSpec, point: MemoryPoint, assumptions: CostAssumptions) -> Shard:
    """The cost model's view of the measured shard: one image / sequence of ``seq_len`` tokens per sample."""
    layer = model.module(point.module).layer(point.layer)
    window = layer.attention.window_patches if layer.attention is not None else None
    link = Link(bandwidth=1e11, latency=1e-6)
    return Shard(
        tp=point.tp, sp=point.sp, cp=1, micro_batch=point.micro_batch,
        tokens=point.micro_batch * point.seq_len / point.sp,
        segment_tokens=point.seq_len, segments=1.0,
        window_tokens=float(window) if window else 0.0,
        windows=point.seq_len / window if window else 0.0,
        recompute="none", backward="full", tp_link=link, sp_link=link, cp_link=link,
        device=get_device("h100"), assumptions=assumptions,
    )


def compare(model: ModelSpec, points: list[MemoryPoint], assumptions: CostAssumptions | None = None) -> list[MemoryComparison]:
    """Analytical numbers next to each measured point (activation bytes as the profile's dtype: bf16 = 2)."""
    assumptions = assumptions or CostAssumptions()
    rows = []
    for p in points:
        layer = model.module(p.module).layer(p.layer)
        terms = layer_terms(layer, _shard(model, p, assumptions))
        params = layer_params_per_rank(layer, p.tp) * assumptions.activation_bytes
        rows.append(MemoryComparison(point=p, analytical_saved_bytes=terms.saved_bytes, analytical_param_bytes=params))
    return rows


def error_by_layer(rows: list[MemoryComparison]) -> dict[tuple[str, str], tuple[float, float, float]]:
    """Per layer type: (median |saved error|, worst signed saved error, median |param error|)."""
    groups: dict[tuple[str, str], list[MemoryComparison]] = {}
    for r in rows:
        groups.setdefault((r.point.module, r.point.layer), []).append(r)
    out = {}
    for key, rs in groups.items():
        saved = [r.saved_error for r in rs if r.point.saved_activation_bytes > 0]
        worst = max(saved, key=abs) if saved else float("nan")
        med = statistics.median(abs(e) for e in saved) if saved else float("nan")
        out[key] = (med, worst, statistics.median(abs(r.param_error) for r in rs))
    return out


def format_table(rows: list[MemoryComparison]) -> str:
    """Every point, then the per-layer-type summary."""
    lines = [f"{'layer':<20} {'tp':>3} {'sp':>3} {'seq':>6} {'mb':>3} {'saved MiB':>10} {'model MiB':>10} {'err':>7} "
             f"{'params MiB':>10} {'model MiB':>10} {'err':>7}"]
    for r in rows:
        p = r.point
        lines.append(
            f"{p.module + '.' + p.layer:<20} {p.tp:>3} {p.sp:>3} {p.seq_len:>6} {p.micro_batch:>3} "
            f"{p.saved_activation_bytes / MiB:>10.1f} {r.analytical_saved_bytes / MiB:>10.1f} {_pct(r.saved_error):>7} "
            f"{p.param_bytes / MiB:>10.2f} {r.analytical_param_bytes / MiB:>10.2f} {_pct(r.param_error):>7}"
        )
    lines += ["", f"{'layer type':<20} {'median |err| saved':>18} {'worst saved':>12} {'median |err| params':>20}"]
    for (module, layer), (med, worst, par) in error_by_layer(rows).items():
        lines.append(f"{module + '.' + layer:<20} {_abs_pct(med):>18} {_pct(worst):>12} {_abs_pct(par):>20}")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:+.1f}%"


def _abs_pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}%"


def compare_main(model: ModelSpec, path: Path) -> int:
    """Print the comparison of the memory profile at ``path``."""
    profile = load_profile(path)
    if profile.model != model.name:
        raise ValueError(f"{path} profiles {profile.model}, not {model.name}")
    if not profile.memory:
        raise ValueError(f"{path} has no memory points: run `python -m runtime.profile --model {model.name} --memory`")
    if profile.provenance.dtype != "bfloat16":
        raise ValueError(f"{path} was measured in {profile.provenance.dtype}; the analytical model assumes bf16")
    print(format_table(compare(model, profile.memory)))
    return 0

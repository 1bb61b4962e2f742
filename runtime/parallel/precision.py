"""The plan's numeric recipe for one module on one device type.

- CPU: fp32 everywhere (exact parity with the single-process reference).
- GPU ``bf16_mixed``: fp32 master weights, gradients and Adam states. Where FSDP2 wraps the module (ZeRO >= 1
  over more than one rank) its ``MixedPrecisionPolicy`` all-gathers bf16 copies for compute and reduces
  gradients in fp32, as FSDP2 intends; elsewhere (no FSDP) bf16 autocast runs the compute (torchtitan's choice).
- GPU ``bf16_pure``: the parameters themselves are bf16 (so are gradients, their reduction and Adam states).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

PRECISIONS = ("bf16_mixed", "bf16_pure")
"""Recipes a plan may ask for (planner.contract.schema TrainingInfo.precision)."""


@dataclass(kw_only=True, frozen=True)
class Precision:
    """How one module stores and computes."""

    param_dtype: torch.dtype
    """dtype of the stored (sharded) parameters, hence of gradients and Adam states."""
    fsdp_policy: MixedPrecisionPolicy | None
    """FSDP2's mixed-precision policy (None: FSDP computes in ``param_dtype``)."""
    autocast_dtype: torch.dtype | None
    """dtype of autocast around the module's forward (None: no autocast)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype the module computes in, hence of its activations and outputs."""
        if self.autocast_dtype is not None:
            return self.autocast_dtype
        return self.fsdp_policy.param_dtype if self.fsdp_policy is not None else self.param_dtype


def module_precision(precision: str, device_type: str, *, fsdp: bool) -> Precision:
    """The recipe of a module that FSDP2 wraps (``fsdp``) or not, for plan precision ``precision``."""
    assert precision in PRECISIONS, precision
    if device_type == "cpu":
        return Precision(param_dtype=torch.float32, fsdp_policy=None, autocast_dtype=None)
    if precision == "bf16_pure":
        return Precision(param_dtype=torch.bfloat16, fsdp_policy=None, autocast_dtype=None)
    if fsdp:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return Precision(param_dtype=torch.float32, fsdp_policy=policy, autocast_dtype=None)
    return Precision(param_dtype=torch.float32, fsdp_policy=None, autocast_dtype=torch.bfloat16)


def cast_norm_outputs(module: nn.Module, precision: Precision) -> None:
    """Under autocast, give every normalisation's output the compute dtype once. transformers' Qwen RMSNorm (and
    ``LayerNorm`` under autocast) returns fp32 for fp32 weights, and autocast then casts that same input once per
    Linear that reads it (q, k and v; gate and up), each copy saved for the backward: three extra bf16 copies of the
    hidden states per decoder layer (+1.15 GiB per 2,816-token sample at Qwen2.5-VL-3B's width, measured by the
    dry-run). The values are the ones autocast gives each Linear; nothing changes without autocast."""
    if precision.autocast_dtype is None:
        return
    for sub in module.modules():
        if isinstance(sub, nn.LayerNorm) or type(sub).__name__.endswith("RMSNorm"):
            sub.register_forward_hook(lambda _module, _args, out: out.to(precision.autocast_dtype))

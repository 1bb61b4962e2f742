"""Operator calls each layer's forward and backward dispatch in the runtime, by layer kind.

These are facts about the runtime's code (transformers' Qwen2.5-VL modules, the runtime's DTensor TP plan and
Ulysses exchange), counted with ``runtime.profile.ops.OpCounter`` on transformers 5.24 / torch 2.13; they do not
depend on widths or sequence lengths, except for the attention loop: transformers' vision attention runs one SDPA
per segment (window or image) of ``cu_seqlens``, the decoder one batched SDPA. ``tests/profile/test_op_counts.py``
recounts them on the runtime and fails when the code drifts from this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True, slots=True)
class PassOps:
    """Operator calls of one pass of one layer instance."""

    ops: float
    """All calls (each pays host dispatch)."""
    dtensor_ops: float
    """Of ``ops``, calls on DTensors (each pays sharding propagation on top)."""
    kernels: float
    """Of ``ops``, calls that launch device work (views and metadata changes do not)."""

    def plus(self, other: "PassOps", times: float = 1.0) -> "PassOps":
        """This pass with ``times`` copies of ``other`` added."""
        return PassOps(ops=self.ops + times * other.ops, dtensor_ops=self.dtensor_ops + times * other.dtensor_ops,
                       kernels=self.kernels + times * other.kernels)


NO_OPS = PassOps(ops=0, dtensor_ops=0, kernels=0)


@dataclass(kw_only=True, frozen=True, slots=True)
class LayerOps:
    """Operator calls of one layer kind: replicated (tp = 1) and tensor-parallel, plus per-segment and Ulysses
    additions."""

    param_tensors: int
    """Parameter tensors of one instance (what a per-parameter optimizer step loops over)."""
    forward: PassOps
    backward: PassOps
    tp_forward: PassOps
    """Forward under TP (DTensor weights, redistributions)."""
    tp_backward: PassOps
    per_segment_forward: PassOps = NO_OPS
    """Added per attention segment the rank attends to (one SDPA call and its slicing)."""
    per_segment_backward: PassOps = NO_OPS
    ulysses_forward: PassOps = NO_OPS
    """Added under Ulysses SP by a full-attention layer: the four all-to-alls and their reshapes."""
    ulysses_backward: PassOps = NO_OPS


def _p(ops: float, dtensor_ops: float, kernels: float) -> PassOps:
    return PassOps(ops=ops, dtensor_ops=dtensor_ops, kernels=kernels)


_VISION_BLOCK = LayerOps(
    param_tensors=12, forward=_p(61, 0, 33), backward=_p(126, 0, 81), tp_forward=_p(75, 10, 37), tp_backward=_p(140, 50, 90),
    per_segment_forward=_p(4, 0, 1), per_segment_backward=_p(5, 0, 1),
    ulysses_forward=_p(50, 0, 22), ulysses_backward=_p(52, 0, 28),
)
_PATCH_EMBED = LayerOps(param_tensors=1, forward=_p(3, 0, 1), backward=_p(4, 0, 2), tp_forward=_p(3, 0, 1), tp_backward=_p(4, 0, 2))
_PATCH_MERGER = LayerOps(param_tensors=5, forward=_p(13, 0, 9), backward=_p(42, 0, 22), tp_forward=_p(19, 4, 11),
                         tp_backward=_p(47, 20, 25))

LAYER_OPS: dict[str, LayerOps] = {
    "vision_block": _VISION_BLOCK,
    "patch_embed": _PATCH_EMBED,
    "patch_merger": _PATCH_MERGER,
    "embedding": LayerOps(param_tensors=1, forward=_p(1, 0, 1), backward=_p(3, 0, 2), tp_forward=_p(15, 0, 9),
                          tp_backward=_p(6, 1, 3)),
    "decoder_layer": LayerOps(
        param_tensors=12, forward=_p(73, 0, 38), backward=_p(149, 0, 73), tp_forward=_p(91, 28, 42), tp_backward=_p(170, 72, 86),
        ulysses_forward=_p(51, 0, 24), ulysses_backward=_p(49, 0, 22),
    ),
    "final_norm": LayerOps(param_tensors=1, forward=_p(7, 0, 6), backward=_p(20, 0, 15), tp_forward=_p(7, 0, 6),
                           tp_backward=_p(20, 0, 15)),
    "lm_head": LayerOps(param_tensors=1, forward=_p(9, 0, 5), backward=_p(16, 0, 6), tp_forward=_p(10, 9, 5),
                        tp_backward=_p(19, 15, 9)),
    # The runtime has no audio modules: their kinds take the counts of the closest measured structure (a ViT block,
    # the patchifier, the merger).
    "audio_block": _VISION_BLOCK,
    "audio_conv": _PATCH_EMBED,
    "audio_projector": _PATCH_MERGER,
}
"""Layer kind -> its operator calls (measured at tp = 1 and 2; the TP counts hold for any tp > 1)."""


def layer_pass_ops(kind: str, *, tp: int, segments: float, ulysses: bool) -> tuple[PassOps, PassOps]:
    """(forward, backward) operator calls of one instance of a ``kind`` layer on one rank attending to
    ``segments`` attention segments, with the Ulysses exchange when ``ulysses``."""
    table = LAYER_OPS[kind]
    forward, backward = (table.tp_forward, table.tp_backward) if tp > 1 else (table.forward, table.backward)
    forward = forward.plus(table.per_segment_forward, segments)
    backward = backward.plus(table.per_segment_backward, segments)
    if ulysses:
        forward, backward = forward.plus(table.ulysses_forward), backward.plus(table.ulysses_backward)
    return forward, backward


@dataclass(kw_only=True, frozen=True, slots=True)
class OptimizerOps:
    """Operator calls of the runtime's optimizer step (runtime/training/optim.py: gradient norm, clipping scale, AdamW) over
    a module's parameter tensors."""

    fixed: float
    """Calls independent of the tensor count."""
    per_tensor: float
    """Calls per parameter tensor."""


OPTIMIZER_OPS = {
    "foreach": OptimizerOps(fixed=20, per_tensor=3),
    "per_parameter": OptimizerOps(fixed=10, per_tensor=11),
}
"""Counted over 4 and 8 tensors: torch's multi-tensor AdamW (its default on CUDA) makes a fixed number of calls
per step, leaving the per-tensor clipping scale and norm bookkeeping; its per-parameter loop (the default on CPU)
makes 11 calls per tensor."""


def optimizer_pass_ops(tensors: float, *, foreach: bool, dtensor: bool) -> PassOps:
    """Operator calls of one optimizer step over ``tensors`` parameter tensors; on DTensor parameters (TP, ZeRO)
    every call is a DTensor call."""
    table = OPTIMIZER_OPS["foreach" if foreach else "per_parameter"]
    ops = table.fixed + table.per_tensor * tensors
    return PassOps(ops=ops, dtensor_ops=ops if dtensor else 0, kernels=ops)

"""Operator calls each layer's forward and backward dispatch in the runtime, by layer kind.

These are facts about the runtime's code (transformers' Qwen2.5-VL and Qwen3.5 modules, the runtime's DTensor TP plan
and Ulysses exchange), counted with ``runtime.profile.ops.OpCounter`` on transformers 5.24-5.25 / torch 2.13; they do
not depend on widths or sequence lengths, except for the loops: transformers' vision attention runs one SDPA per
segment (window or image) of ``cu_seqlens``, the decoder one batched SDPA; a Gated DeltaNet layer on the torch kernel
runs its conv and chunked rule once per packed sample, and the rule loops over the sample's chunks.
``tests/profile/test_op_counts.py`` recounts them on the runtime and fails when the code drifts from this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.contract.models import LayerSpec


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
    """Added under Ulysses SP by a full-attention layer: the four all-to-alls and their reshapes (a linear-attention
    layer: its two exchanges, of the projections and of the rule's output)."""
    ulysses_backward: PassOps = NO_OPS
    per_chunk_forward: PassOps = NO_OPS
    """Added per iteration of a loop over chunks of a segment (transformers' torch chunked gated delta rule: one per
    ``linear_attention_chunk`` tokens)."""
    per_chunk_backward: PassOps = NO_OPS


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
    # Qwen3.5's gated full attention (q_proj doubled for the output gate, q/k RMSNorm, partial rotary): 30-45 % more
    # calls than Qwen2's layer, counted on qwen3.5-tiny.
    "gated_decoder_layer": LayerOps(
        param_tensors=11, forward=_p(105, 0, 64), backward=_p(192, 0, 117), tp_forward=_p(125, 28, 68),
        tp_backward=_p(215, 63, 132), ulysses_forward=_p(48, 0, 21), ulysses_backward=_p(49, 0, 22),
    ),
    # Qwen3.5's Gated DeltaNet layer on the torch kernel (runtime.models.linear_attention), counted on qwen3.5-tiny at
    # 1 to 8 chunks and 1 to 4 packed samples: the fixed calls are the layer outside its conv and rule; per segment,
    # one conv and one rule call (their set-up: l2 norms, padding, decays, two triangular solves) with the segment's
    # first chunk's extra calls; per chunk, one iteration of the rule's loop. A segment of a single chunk makes 4
    # forward and 16 backward calls fewer (no state flows between chunks), which the row leaves out: it fits
    # segments of 2 or more chunks (128 tokens or more) exactly.
    "linear_decoder_layer": LayerOps(
        param_tensors=14, forward=_p(87, 0, 53), backward=_p(170, 0, 100), tp_forward=_p(111, 32, 57),
        tp_backward=_p(200, 75, 119), per_segment_forward=_p(103, 0, 54), per_segment_backward=_p(126, 0, 75),
        ulysses_forward=_p(80, 0, 28), ulysses_backward=_p(80, 0, 35), per_chunk_forward=_p(37, 0, 13),
        per_chunk_backward=_p(54, 0, 32),
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
"""Row (``ops_row``) -> its operator calls (measured at tp = 1 and 2; the TP counts hold for any tp > 1)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ContextParallelOps:
    """Operator calls a layer's attention adds under ring context parallelism (runtime.parallel.ring), on its
    busiest rank: ``fixed`` once, ``per_step`` for each of the ``cp - 1`` ring steps (blocks received, or parts
    gathered, beyond the rank's own)."""

    fixed_forward: PassOps
    fixed_backward: PassOps
    step_forward: PassOps
    step_backward: PassOps


CONTEXT_PARALLEL_OPS: dict[str, ContextParallelOps] = {
    # torch's templated ring (``_RingAttention``) under the head-tail layout, counted on rank 0 (it computes every
    # step's block in full: rank r makes 5 r forward calls fewer); per step, the block's send/receive, its SDPA with
    # log-sum-exp and the merge (backward: the SDPA backward and the dK/dV pass).
    "ring": ContextParallelOps(fixed_forward=_p(25, 0, 10), fixed_backward=_p(32, 0, 21),
                               step_forward=_p(25, 0, 12), step_backward=_p(29, 0, 11)),
    # ``gathered_bidirectional_attention``: pad, all-gather, narrow and cat of keys and values (per step, one more
    # part's buffer and narrow each); backward, the all-reduce of their gradient.
    "gathered": ContextParallelOps(fixed_forward=_p(26, 0, 13), fixed_backward=_p(18, 0, 9),
                                   step_forward=_p(4, 0, 2), step_backward=_p(2, 0, 2)),
    # A packed row's all-gather form: the gather above and one SDPA under the sample-and-causal mask.
    "gathered_masked": ContextParallelOps(fixed_forward=_p(32, 0, 17), fixed_backward=_p(24, 0, 13),
                                          step_forward=_p(4, 0, 2), step_backward=_p(2, 0, 2)),
}
"""Form of ring CP (``ring``: a decoder's causal ring; ``gathered``: a bidirectional block's all-gather;
``gathered_masked``: a decoder's packed row) -> the calls it adds to the layer's row, counted with ``OpCounter`` on
qwen2.5-vl-tiny's full-attention vision block and decoder layer at cp = 2, 3 and 4 on gloo (torch 2.13)."""


def context_parallel_ops(form: str, cp: int) -> tuple[PassOps, PassOps]:
    """(forward, backward) calls ring CP of form ``form`` adds to one layer instance at degree ``cp``:
    ``fixed + (cp - 1) x per_step`` (none at cp = 1)."""
    if cp == 1:
        return NO_OPS, NO_OPS
    table = CONTEXT_PARALLEL_OPS[form]
    return (table.fixed_forward.plus(table.step_forward, cp - 1),
            table.fixed_backward.plus(table.step_backward, cp - 1))


def ops_row(layer: LayerSpec) -> str:
    """The table's row of ``layer``: a Gated DeltaNet decoder layer's (``linear_decoder_layer``), a gated
    full-attention decoder layer's (``gated_decoder_layer``), else its kind's."""
    if layer.linear_attention is not None:
        return "linear_decoder_layer"
    if layer.kind == "decoder_layer" and layer.attention is not None and layer.attention.output_gate:
        return "gated_decoder_layer"
    return layer.kind


def layer_pass_ops(row: str, *, tp: int, segments: float, ulysses: bool,
                   chunks: float = 0.0) -> tuple[PassOps, PassOps]:
    """(forward, backward) operator calls of one instance of a layer of table row ``row`` on one rank attending to
    ``segments`` attention segments (looping over ``chunks`` chunks in all), with the Ulysses exchange when
    ``ulysses``."""
    table = LAYER_OPS[row]
    forward, backward = (table.tp_forward, table.tp_backward) if tp > 1 else (table.forward, table.backward)
    forward = forward.plus(table.per_segment_forward, segments).plus(table.per_chunk_forward, chunks)
    backward = backward.plus(table.per_segment_backward, segments).plus(table.per_chunk_backward, chunks)
    if ulysses:
        forward, backward = forward.plus(table.ulysses_forward), backward.plus(table.ulysses_backward)
    return forward, backward


FLA_CONV_OPS = (PassOps(ops=3, dtensor_ops=0, kernels=1), PassOps(ops=9, dtensor_ops=0, kernels=4))
"""(forward, backward) calls of fla's causal conv (fla-core 0.6.0, ``fla/modules/causal_conv1d/ops.py``,
``CausalConv1dFunction`` with SiLU), read from its source: forward, the output's allocation, one Triton launch and a
view; backward, the forward re-run before SiLU, two allocations, one Triton launch, the weight gradient's sum over
chunks and its cast, a view. ``kernels`` are launches (Triton's and torch's compute), not allocations."""
FLA_RULE_OPS = (PassOps(ops=27, dtensor_ops=0, kernels=11), PassOps(ops=42, dtensor_ops=0, kernels=15))
"""(forward, backward) calls of fla's chunked gated delta rule (fla-core 0.6.0,
``fla/ops/gated_delta_rule/chunk.py``, ``ChunkGatedDeltaRuleFunction`` with ``use_qk_l2norm_in_kernel``, key heads
fewer than value heads), read from its source. Forward: ``input_guard``'s copies of the runtime's strided q, k, v
(3), ``l2norm_fwd`` of q and of k (2 x 6: views, 2 allocations, 1 launch), ``chunk_local_cumsum`` (2),
``chunk_gated_delta_rule_fwd_intra`` (the zeroed ``A``, the fused kkt + solve_tril launch, ``recompute_w_u_fwd``'s 2
allocations and launch: 5), ``chunk_gated_delta_rule_fwd_h`` (3), ``chunk_fwd_o`` (2): 27 calls, 11 launches.
Backward (``chunk_gated_delta_rule_bwd``): ``recompute_w_u_fwd`` (3), ``chunk_gated_delta_rule_fwd_h`` (3),
``chunk_bwd_dv_local`` (2), ``chunk_gated_delta_rule_bwd_dhu`` (3), ``chunk_bwd_dqkwg`` (4 allocations, 1 launch, dq
and dk summed to the key heads, dg over its splits: 10), ``prepare_wy_repr_bwd`` (4 allocations, 1 launch, dk
summed: 7), two in-place adds, the reverse ``chunk_local_cumsum`` (2), ``l2norm_bwd`` of q and of k (2 x 5): 42
calls, 15 launches. A packed row's chunk indices (``prepare_chunk_indices``, cached per ``cu_seqlens``) add a few
small calls, left out."""


def linear_kernel_ops(kernel: str, *, calls: float, chunks: float) -> tuple[PassOps, PassOps]:
    """(forward, backward) operator calls of a Gated DeltaNet layer's conv and delta rule in one micro-batch on one
    rank: on ``torch``, ``calls`` calls of each (one per packed sample) and ``chunks`` iterations of the rule's loop
    (``linear_decoder_layer``'s per-segment and per-chunk rows); on ``fla``, one call each over the whole row
    (``FLA_CONV_OPS`` + ``FLA_RULE_OPS``), whatever the segments and chunks."""
    if kernel == "fla":
        return (FLA_CONV_OPS[0].plus(FLA_RULE_OPS[0]), FLA_CONV_OPS[1].plus(FLA_RULE_OPS[1]))
    table = LAYER_OPS["linear_decoder_layer"]
    return (NO_OPS.plus(table.per_segment_forward, calls).plus(table.per_chunk_forward, chunks),
            NO_OPS.plus(table.per_segment_backward, calls).plus(table.per_chunk_backward, chunks))


def linear_attention_pass_ops(kernel: str, *, tp: int, calls: float, chunks: float,
                              ulysses: bool) -> tuple[PassOps, PassOps]:
    """(forward, backward) operator calls of one Gated DeltaNet decoder layer on one rank: ``linear_decoder_layer``'s
    fixed calls (and Ulysses exchange when ``ulysses``) plus its kernel's (``linear_kernel_ops``)."""
    forward, backward = layer_pass_ops("linear_decoder_layer", tp=tp, segments=0, ulysses=ulysses)
    kernel_forward, kernel_backward = linear_kernel_ops(kernel, calls=calls, chunks=chunks)
    return forward.plus(kernel_forward), backward.plus(kernel_backward)


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

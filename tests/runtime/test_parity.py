"""The runtime on Ray (gloo, CPU, fp32) against the unmodified single-process transformers model.

Same tiny Qwen2.5-VL (4 vision blocks: 2 window, 2 full attention, merger; 4 decoder layers; or the tiny Qwen2-VL),
same seed, same samples. Checked on every plan:

- the parallelism was applied (tests/runtime/sharding_checks.py): before the first step, every parameter's DTensor
  layout, local shard shape and ``requires_grad`` on every rank as the plan implies; during the first step,
  FSDP's resharding around each block's forwards as the plan's ZeRO stage implies. Numerics alone cannot show
  this: a TP module that runs replicated computes the same numbers;
- the loss of 3 steps;
- the pre-clip global gradient norm every rank reports for each step (the norm runtime.training.optim.clip_grad_norm
  computes before scaling), against the norm torch.nn.utils.clip_grad_norm_ returns in the reference;
- every gradient of step 1 before clipping. The runtime's gradients can only be read after its step, that is
  clipped: clipping multiplied all of them by one factor, min(1, max_norm / (norm + 1e-6)), so dividing by that
  factor computed from the runtime's own reported norm recovers exactly what its backward produced. A uniform
  scale error s (a dropped or doubled gradient divide factor, a sum instead of a mean) multiplies the runtime's
  norm by s, and its un-clipped gradients by s, so both comparisons fail; compared after clipping, s cancels
  (clipping binds on step 1 in every plan: norms 2.4-9.9 against max_norm 1). Keeping the plan's binding clip
  norm, rather than one that never binds, also keeps the clipping path itself under test through the parameters;
- every parameter after step 3.

Tolerances, and why they are not zero: the runtime sums the same fp32 numbers in a different order (TP splits
matmul reductions and all-reduces partial sums; SP computes gradients per shard and sums them; DP/ZeRO sums
per-replica gradients; micro-batching sums per-micro-batch losses). Each reorder changes results by a few fp32
ulps, so:
- loss: relative 1e-5 (observed <= 3e-7);
- pre-clip gradient norm: relative 1e-5 (observed <= 1.2e-6): a square root of a sum of squares of gradients that
  each carry the error below, so of the same relative size; a scale error is at least a factor of 2 (a missing
  divide factor over a degree-2 group);
- gradients: per tensor, max |g - g_ref| <= 1e-5 * max |g_ref| (observed <= 2.1e-6 relative, before clipping), or
  below ``GRADIENT_FLOOR`` (a gradient that cancels to almost nothing);
- parameters after 3 AdamW steps: max |p - p_ref| <= 0.1 * lr (observed <= 3e-5 with lr = 1e-3). Adam divides
  each gradient by its own magnitude, so an element whose gradient is near the fp32 noise floor (e.g. key
  biases, whose exact gradient is zero) moves by a noise-directed fraction of lr; a tenth of one step is far
  below what a wrong gradient (a whole step in the wrong direction) produces; elements whose step-1 gradient is
  a noise-sized share of their tensor's (``ADAM_NOISE_SHARE``) are left out. Being scale-invariant,
  Adam does not see a uniform gradient scale error: the gradient checks above do.
"""

from __future__ import annotations

import pytest
import torch

from planner.contract.schema import Plan
from runtime.launch import launcher
from runtime.training.trainer import RunOptions
from tests.runtime import sharding_checks
from tests.runtime.plans import (QWEN3_IMAGE_SIZE, make_plan, tiny_hf_config, tiny_qwen2_audio_config,
                                 tiny_qwen2_vl_config, tiny_qwen3_5_config, tiny_qwen3_5_moe_config,
                                 tiny_qwen3_vl_config, tiny_qwen3_vl_moe_config)
from tests.runtime.reference import reference_run

STEPS = 3
SEED = 0
LR = 1e-3

PLANS = {
    "vision_sp2__llm_tp2": dict(vision=dict(sp=2), llm=dict(tp=2)),
    "uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2)),
    "zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3)),
    "vision_dp2__llm_tp2": dict(vision=dict(dp=2), llm=dict(tp=2, micro_batch=2)),
    "disjoint_1_1__2_micro_batches": dict(vision=dict(grad_accum=2), llm=dict(grad_accum=2), placement="disjoint"),
    "recompute_full_vision__selective_llm": dict(
        vision=dict(dp=2, zero=1, recompute="full"), llm=dict(tp=2, micro_batch=2, recompute="selective")
    ),
    # LLM Ulysses SP. 9 text tokens: a 33-token sequence, slices of 17 and 16 that split the 24 image tokens
    "vision_sp2__llm_sp2_selective__uneven_slices": dict(
        vision=dict(sp=2), llm=dict(sp=2, recompute="selective"), text_tokens=9
    ),
    # 1 local KV head per TP rank, repeated to 2 for the exchange; 64 tokens: slice 2 holds no image token
    "vision_dp2xtp2__llm_tp2xsp2_zero1_full": dict(
        vision=dict(dp=2, tp=2), llm=dict(tp=2, sp=2, micro_batch=2, zero=1, recompute="full")
    ),
    "disjoint_1__llm_sp2__2_micro_batches": dict(
        vision=dict(grad_accum=2), llm=dict(sp=2, grad_accum=2), placement="disjoint", text_tokens=7
    ),
}

PIPELINE_PLANS = {
    # the LLM's 4 decoder layers over 2 stages (1F1B over 2 micro-batches); the vision tower on both ranks
    "llm_pp2__vision_dp2": dict(vision=dict(dp=2, grad_accum=2),
                                llm=dict(pp=2, pp_layers=[2, 2], micro_batch=2, grad_accum=2)),
    # TP inside each stage (vocab-parallel embedding on stage 0, loss_parallel on stage 1)
    "llm_pp2xtp2__vision_dp2xtp2": dict(vision=dict(dp=2, tp=2, grad_accum=2),
                                        llm=dict(pp=2, tp=2, pp_layers=[2, 2], micro_batch=2, grad_accum=2)),
    # vision Ulysses SP2 on the same ranks; an uneven split
    "llm_pp2_3_1__vision_sp2": dict(vision=dict(sp=2, grad_accum=2),
                                    llm=dict(pp=2, pp_layers=[3, 1], grad_accum=2)),
    # Ulysses SP2 inside each stage: a 33-token sequence, slices of 17 and 16 (different stage shapes per SP rank)
    "llm_pp2xsp2__vision_dp4": dict(vision=dict(dp=4, grad_accum=2),
                                    llm=dict(pp=2, sp=2, pp_layers=[2, 2], micro_batch=4, grad_accum=2),
                                    text_tokens=9),
    # the vision tower on its own rank feeding stage 0
    "disjoint_vision_1__llm_pp2": dict(vision=dict(grad_accum=2), llm=dict(pp=2, pp_layers=[2, 2], grad_accum=2),
                                       placement="disjoint"),
    # 2 model chunks per stage: stage 0 runs layers 0 and 2, stage 1 layers 1 and 3
    "llm_pp2_interleaved_2_chunks": dict(vision=dict(dp=2, grad_accum=2), llm=dict(
        pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2, pp_layers=[1, 1, 1, 1], micro_batch=2,
        grad_accum=2)),
    # interleaved zero-bubble: input gradients first, weight gradients deferred into the bubble
    "llm_pp2_zero_bubble_2_chunks": dict(vision=dict(dp=2, grad_accum=2), llm=dict(
        pp=2, pp_schedule="interleaved_zb", virtual_stages=2, pp_layers=[1, 1, 1, 1], micro_batch=2,
        grad_accum=2)),
    # ... with TP inside each stage and ZeRO-1 over the vision tower
    "llm_pp2xtp2_zero_bubble__vision_dp2xtp2_zero1": dict(vision=dict(dp=2, tp=2, zero=1, grad_accum=2), llm=dict(
        pp=2, tp=2, pp_schedule="interleaved_zb", virtual_stages=2, pp_layers=[1, 1, 1, 1], micro_batch=2,
        grad_accum=2)),
    # a frozen pipeline still passes the image tokens' gradient back to the vision tower
    "frozen_llm_pp2__vision_dp2": dict(vision=dict(dp=2, grad_accum=2), llm=dict(
        pp=2, pp_layers=[2, 2], micro_batch=2, grad_accum=2, frozen=True)),
    # ZeRO-3 over each stage's 2 DP ranks. 24 text tokens: with 40, an embedding element at the fp32 noise floor
    # moved 0.103 lr (Adam normalises noise to a full step) on this machine, against the 0.1 lr bound
    "llm_pp2xdp2_zero3__vision_dp4_zero1": dict(vision=dict(dp=4, zero=1, grad_accum=2),
                                                llm=dict(pp=2, dp=2, zero=3, pp_layers=[2, 2], micro_batch=2,
                                                         grad_accum=2), text_tokens=24),
}
"""Pipelined LLM plans (runtime.models.pipeline)."""


def tied_embeddings_config() -> dict:
    """The tiny model with lm_head tied to the embedding (as Qwen2.5-VL-3B and Qwen2-VL-2B are)."""
    return {**tiny_hf_config(), "tie_word_embeddings": True}


def four_kv_heads_config() -> dict:
    """The tiny model with as many KV heads as query heads (4), so that LLM TP can be 4."""
    config = tiny_hf_config()
    return {**config, "text_config": {**config["text_config"], "num_key_value_heads": 4}}


def one_kv_head_config() -> dict:
    """The tiny model with a single KV head for its 4 query heads, so that LLM TP2 replicates it."""
    config = tiny_hf_config()
    return {**config, "text_config": {**config["text_config"], "num_key_value_heads": 1}}


REPLICATED_KV_PLANS = {
    # TP4 over the tiny model's 2 KV heads: each KV head replicated on 2 ranks, its gradient summed over them
    "llm_tp4_replicated_kv__vision_tp4": dict(vision=dict(tp=4), llm=dict(tp=4)),
    # ... under FSDP (ZeRO-3 over 2 DP replicas of TP2 replicating 1 KV head). 24 text tokens: with 40, an
    # embedding row first used at step 2 gets a gradient at the fp32 noise floor there, which Adam's first update
    # turns into +-lr (seen: 2 lr after 3 steps, while every step-1 gradient matched to 3e-7 relative)
    "llm_dp2xtp2_zero3_replicated_kv__vision_sp2xtp2": dict(
        vision=dict(sp=2, tp=2, micro_batch=2), llm=dict(dp=2, tp=2, zero=3), hf_config=one_kv_head_config(),
        text_tokens=24,
    ),
}
"""TP degrees that are multiples of the LLM's KV heads (runtime.parallel.tensor_parallel.ReplicatedHeadsColwise)."""

SLOW_PLANS = {
    "zero1_zero2_grad_accum2": dict(vision=dict(dp=2, zero=1, grad_accum=2), llm=dict(dp=2, zero=2, grad_accum=2)),
    "zero0_dp2_grad_accum2": dict(vision=dict(dp=2, grad_accum=2), llm=dict(dp=2, grad_accum=2)),
    "frozen_vision_sp2__llm_tp2": dict(vision=dict(sp=2, frozen=True), llm=dict(tp=2)),
    "tied_embeddings_uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2), hf_config=tied_embeddings_config()),
    "vision_sp2xtp2_zero2__llm_dp2xtp2_zero1": dict(
        vision=dict(sp=2, tp=2, micro_batch=2, zero=2), llm=dict(dp=2, tp=2, zero=1)
    ),
    "disjoint_vision_sp2__llm_tp2__3_micro_batches": dict(
        vision=dict(sp=2, grad_accum=3), llm=dict(tp=2, grad_accum=3), placement="disjoint"
    ),
    "zero3_dp2xtp2": dict(vision=dict(dp=2, tp=2, zero=3), llm=dict(dp=2, tp=2, zero=3)),
    "frozen_llm_tp2__vision_dp2_zero3": dict(vision=dict(dp=2, zero=3), llm=dict(tp=2, micro_batch=2, frozen=True)),
    "disjoint_vision_dp2_zero2__llm_dp2_zero3__2_micro_batches": dict(
        vision=dict(dp=2, zero=2, grad_accum=2), llm=dict(dp=2, zero=3, grad_accum=2), placement="disjoint"
    ),
    # 16 x 12 patches: 4 attention windows, one per vision SP rank
    "vision_sp4__llm_tp4": dict(
        vision=dict(sp=4), llm=dict(tp=4), image_size=(224, 168), hf_config=four_kv_heads_config()
    ),
    "qwen2_vl_vision_sp2xtp2__llm_tp2xsp2": dict(
        vision=dict(sp=2, tp=2), llm=dict(tp=2, sp=2), hf_config=tiny_qwen2_vl_config()
    ),
}


QWEN3_VL = dict(hf_config=tiny_qwen3_vl_config(), image_size=QWEN3_IMAGE_SIZE)
"""The tiny Qwen3-VL: DeepStack features from vision blocks 1 and 2 added after decoder layers 0 and 1."""
QWEN3_VL_PLANS = {
    "qwen3_vl_zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3), **QWEN3_VL),
    # the q/k norms' weights replicated over TP, their gradients summed
    "qwen3_vl_uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2), **QWEN3_VL),
    # each LLM slice takes the DeepStack rows of its own image tokens: a 33-token sequence, slices of 17 and 16
    "qwen3_vl_vision_sp2__llm_sp2": dict(vision=dict(sp=2), llm=dict(sp=2), text_tokens=9, **QWEN3_VL),
    # ring CP2 over images and a clip: each CP rank's head and tail chunks take the DeepStack rows of their tokens
    "qwen3_vl_image_and_a_clip__llm_cp2": dict(vision=dict(dp=2), llm=dict(cp=2, micro_batch=2),
                                               videos=((4, 64, 96),), **QWEN3_VL),
    # the merged output and both features cross to another rank as one row per image token
    "qwen3_vl_disjoint__2_micro_batches": dict(vision=dict(grad_accum=2), llm=dict(grad_accum=2),
                                               placement="disjoint", **QWEN3_VL),
    # the first stage receives the features and holds both layers they are added after
    "qwen3_vl_llm_pp2__vision_dp2": dict(vision=dict(dp=2, grad_accum=2),
                                         llm=dict(pp=2, pp_layers=[2, 2], micro_batch=2, grad_accum=2), **QWEN3_VL),
    # two images of different sizes and a clip of 4 frames in every sample: 2 temporal groups, each its own
    # attention segment and timestamp; the rows reach the LLM in sequence order (images, then the clip's groups)
    "qwen3_vl_two_images_and_a_clip__vision_sp2__llm_sp2": dict(
        vision=dict(sp=2), llm=dict(sp=2), videos=((4, 64, 96),),
        **{**QWEN3_VL, "image_size": (QWEN3_IMAGE_SIZE, (64, 64))}),
    # no windows: merge units split over the CP ranks; the clip's temporal groups and the image are the segments
    "qwen3_vl_image_and_a_clip__vision_cp2xtp2__llm_cp2xtp2": dict(vision=dict(cp=2, tp=2), llm=dict(cp=2, tp=2),
                                                               videos=((4, 64, 96),), **QWEN3_VL),
    "qwen3_vl_video__zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3), videos=((4, 64, 96),),
                                      **QWEN3_VL),
    "qwen3_vl_video__llm_pp2__vision_tp2": dict(vision=dict(tp=2, grad_accum=2),
                                                llm=dict(pp=2, pp_layers=[2, 2], grad_accum=2),
                                                videos=((4, 64, 96),), **QWEN3_VL),
}
"""Qwen3-VL plans (runtime.models.families.qwen3_vl)."""

QWEN2_AUDIO = dict(hf_config=tiny_qwen2_audio_config(), audio_seconds=2.0, text_tokens=12)
"""Two 1 s clips per sample (2 x 25 audio tokens) and 12 text tokens."""
QWEN2_AUDIO_PLANS = {
    "qwen2_audio_zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3), **QWEN2_AUDIO),
    # the encoder's heads and MLP width split as the LLM's
    "qwen2_audio_uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2), **QWEN2_AUDIO),
    # a micro-batch's 4 clips end to end split on pooling pairs (100 + 100 positions), attention within each clip;
    # 1-D RoPE positions sliced with the tokens
    "qwen2_audio_sp2__llm_sp2": dict(vision=dict(sp=2, micro_batch=2), llm=dict(sp=2, micro_batch=2), **QWEN2_AUDIO),
    # one clip per sample: the SP split falls inside the clip (positions 0-24 and 25-49, one attention segment)
    "qwen2_audio_one_clip__sp2": dict(vision=dict(sp=2, micro_batch=2), llm=dict(dp=2), **{**QWEN2_AUDIO, "audio_seconds": 1.0}),
    "qwen2_audio_disjoint__2_micro_batches": dict(vision=dict(grad_accum=2), llm=dict(grad_accum=2),
                                                  placement="disjoint", **QWEN2_AUDIO),
    "qwen2_audio_llm_pp2__audio_dp2": dict(vision=dict(dp=2, grad_accum=2),
                                           llm=dict(pp=2, pp_layers=[2, 2], micro_batch=2, grad_accum=2),
                                           **QWEN2_AUDIO),
}
"""Qwen2-Audio plans (runtime.models.families.qwen2_audio); ``vision`` holds the audio encoder's degrees."""


QWEN3_VL_MOE = dict(hf_config=tiny_qwen3_vl_moe_config(), image_size=QWEN3_IMAGE_SIZE)
QWEN3_VL_MOE_PLANS = {
    # 8 experts over 2 data ranks (4 each), ZeRO-0: expert gradients stay on their rank, the rest is summed; the
    # routers re-run by full recomputation save what their forward saved
    "moe_ep2": dict(vision=dict(dp=2), llm=dict(dp=2, ep=2, recompute="full"), **QWEN3_VL_MOE),
    # EP groups {0,1} and {2,3}; each expert's weights and states ZeRO-3-sharded over the 2 ranks holding it
    "moe_ep2_dp4_zero3": dict(vision=dict(dp=4, zero=3), llm=dict(dp=4, ep=2, zero=3), **QWEN3_VL_MOE),
    # EP group = 2 data ranks x 2 TP ranks (2 experts each); each TP rank sends its half of the tokens
    "moe_ep2_tp2_zero1": dict(vision=dict(dp=2, tp=2, zero=1), llm=dict(dp=2, tp=2, ep=2, zero=1), **QWEN3_VL_MOE),
    # two stages, each with its own EP group of 2; no balancing loss (refused with PP)
    "moe_ep2_pp2": dict(vision=dict(dp=2, tp=2, grad_accum=2),
                        llm=dict(pp=2, pp_layers=[2, 2], dp=2, ep=2, grad_accum=2),
                        **{**QWEN3_VL_MOE, "hf_config": tiny_qwen3_vl_moe_config(balancing=False)}),
    # the vision tower's sequence split beside the LLM's experts split over its 2 data ranks
    "moe_vision_sp2__llm_ep2": dict(vision=dict(sp=2, micro_batch=2), llm=dict(dp=2, ep=2), **QWEN3_VL_MOE),
    # experts over the 2 CP ranks (each holds the head and tail chunks of the sequence: different tokens); the
    # balancing loss over the micro-batch's tokens on both
    "moe_llm_cp2_ep2__vision_cp2": dict(vision=dict(cp=2), llm=dict(cp=2, ep=2), **QWEN3_VL_MOE),
}
"""Qwen3-VL-MoE plans (runtime.parallel.experts), one micro-batch per rank where the balancing loss is on (the
reference computes it over the whole batch at once)."""


CONTEXT_PARALLEL_PLANS = {
    # ring CP2 (runtime.parallel.ring): a 33-token sequence padded to 36, head-tail chunks of 9 (rank 0: tokens 0-8
    # and 27-35, rank 1: 9-26), the 24 image tokens split 8 / 16
    "llm_cp2__vision_dp2": dict(vision=dict(dp=2), llm=dict(cp=2, micro_batch=2), text_tokens=9),
    # 2-D: Ulysses SP2 inside each CP rank's two chunks (64 tokens: chunks of 16, slices of 16)
    "llm_cp2xsp2_selective__vision_sp2xdp2": dict(vision=dict(sp=2, dp=2, micro_batch=2),
                                                  llm=dict(cp=2, sp=2, micro_batch=4, recompute="selective")),
    # ZeRO-3 over dp x cp; TP inside each CP rank
    "llm_cp2_zero3__vision_dp2_zero3": dict(vision=dict(dp=2, zero=3), llm=dict(cp=2, zero=3, micro_batch=2)),
    "llm_cp2xtp2__vision_dp2xtp2": dict(vision=dict(dp=2, tp=2), llm=dict(cp=2, tp=2, micro_batch=2)),
    # the vision tower over CP2 (the all-gather form, runtime.parallel.ring): its two windows of 64 and 32 patches one
    # per CP rank, the image's full-attention segment across both
    "vision_cp2__llm_tp2": dict(vision=dict(cp=2), llm=dict(tp=2)),
    # two images per sample, windows 64 | 32 + 16: CP rank 1's part meets both segments; ZeRO-3 over dp x cp
    "two_images__vision_cp2_zero3__llm_tp2": dict(vision=dict(cp=2, zero=3), llm=dict(tp=2),
                                                  image_size=((112, 168), (56, 56))),
    # 2-D on both modules: 4 windows of the 16 x 12 image, Ulysses SP2 inside each vision CP rank's two windows
    "vision_cp2xsp2__llm_cp2xsp2": dict(vision=dict(cp=2, sp=2), llm=dict(cp=2, sp=2), image_size=(224, 168),
                                        hf_config=four_kv_heads_config()),
}
"""Ring context-parallel plans (the LLM's ring, the vision tower's gathered form)."""


GRADIENT_FLOOR = 1e-8
"""Absolute gradient error below which a tensor passes whatever its own magnitude: a gradient summed from terms
that cancel to almost nothing keeps their fp32 rounding (Qwen3.5's ``dt_bias``: 3e-7 at most, off by 1.6e-9 under
another micro-batching of the same sums). A wrong gradient of such a tensor still fails once wrong by 3 %."""


ADAM_NOISE_SHARE = 1e-2
"""Parameters after the steps are compared where the step-1 gradient is at least this share of its tensor's largest
(and above ``GRADIENT_FLOOR``): a tensor's fp32 rounding scales with its largest terms, so an element 100x smaller
carries it at 10 % and more, which Adam, dividing each gradient by its own size, turns into a noise-directed step
(Qwen3.5's ``A_log`` and ``dt_bias`` elements of 6e-8 beside 1e-5: 0.13 lr apart after 3 steps)."""


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor global-norm clipping multiplies every gradient by (torch.nn.utils.clip_grad_norm_'s formula)."""
    return min(1.0, max_norm / (norm + 1e-6))


def plan_of(spec: dict) -> Plan:
    """The tiny-model plan a table entry describes (``vision`` and ``llm`` module arguments, the rest
    ``make_plan``'s), at the parity tests' learning rate."""
    spec = dict(spec)
    return make_plan(spec.pop("vision"), spec.pop("llm"), learning_rate=LR, **spec)


def run_runtime(plan, options: RunOptions | None = None, pool: launcher.WorkerPool | None = None) -> dict:
    """Train STEPS steps on Ray; check the parameters' layouts before the first step and FSDP's resharding during
    it. Returns each step's loss and every rank's reported pre-clip gradient norm, the first step's gradients
    un-clipped with the runtime's own reported norm (rank 0's; all ranks' are checked), and the parameters after
    the last step."""
    job = launcher.start(plan, options or RunOptions(seed=SEED), pool=pool)
    try:
        sharding_checks.assert_parameters_sharded_as_planned(
            plan, sharding_checks.call_on_workers(job, sharding_checks.parameter_summary)
        )
        sharding_checks.call_on_workers(job, sharding_checks.install_block_probes)
        results = [job.step()]
        sharding_checks.assert_reshard_as_planned(
            plan, sharding_checks.call_on_workers(job, sharding_checks.collect_block_probes)
        )
        sharding_checks.assert_gradients_sharded_as_parameters(
            sharding_checks.call_on_workers(job, sharding_checks.parameter_summary)
        )
        grads = job.gather("grad")
        results += [job.step() for _ in range(STEPS - 1)]
        params = job.gather("param")
    finally:
        job.shutdown()
    losses = [next(r["loss"] for r in step if r["loss"] is not None) for step in results]
    grad_norms = [[r["grad_norm"] for r in step] for step in results]
    coef = clip_coefficient(grad_norms[0][0], plan.training.grad_clip_norm)
    return {"losses": losses, "grad_norms": grad_norms, "grads": {n: g / coef for n, g in grads.items()},
            "params": params, "results": results}


def assert_parity(plan, options: RunOptions | None = None, pool: launcher.WorkerPool | None = None) -> dict:
    """The runtime's run (``run_runtime``) after checking it against the reference."""
    ref = reference_run(plan, seed=SEED, steps=STEPS, options=options)
    got = run_runtime(plan, options, pool)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for step, (norms, norm_ref) in enumerate(zip(got["grad_norms"], ref["grad_norms"])):
        for rank, norm in enumerate(norms):
            assert abs(norm - norm_ref) <= 1e-5 * norm_ref, (
                f"step {step}: rank {rank} reports pre-clip gradient norm {norm:.7g}, reference {norm_ref:.7g}"
            )
    assert set(got["grads"]) == set(ref["grads"]), "runtime and reference disagree on which parameters exist"
    for name, g_ref in ref["grads"].items():
        err = (got["grads"][name] - g_ref).abs().max().item()
        assert err <= 1e-5 * g_ref.abs().max().item() + GRADIENT_FLOOR, f"pre-clip gradient of {name}: max error {err:.3g}"
    for name, p_ref in ref["params"].items():
        error = (got["params"][name] - p_ref).abs()
        if name in ref["grads"]:  # Adam makes a gradient at the noise floor a full step in a noise-chosen direction
            g_ref = ref["grads"][name].abs()
            error = error.masked_fill(g_ref < max(ADAM_NOISE_SHARE * g_ref.max().item(), GRADIENT_FLOOR), 0.0)
        err = error.max().item()
        assert err <= 0.1 * LR, f"parameter {name} after {STEPS} steps: max error {err:.3g}"
    return got


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_parity(name, worker_pool):
    assert_parity(plan_of(PLANS[name]), pool=worker_pool)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_PLANS))
def test_parity_more_plans(name, worker_pool):
    assert_parity(plan_of(SLOW_PLANS[name]), pool=worker_pool)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REPLICATED_KV_PLANS))
def test_parity_replicated_kv_heads(name, worker_pool):
    assert_parity(plan_of(REPLICATED_KV_PLANS[name]), pool=worker_pool)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PIPELINE_PLANS))
def test_parity_pipelined(name, worker_pool):
    assert_parity(plan_of(PIPELINE_PLANS[name]), pool=worker_pool)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONTEXT_PARALLEL_PLANS))
def test_parity_context_parallel(name, worker_pool):
    assert_parity(plan_of(CONTEXT_PARALLEL_PLANS[name]), pool=worker_pool)


QWEN3_5 = dict(hf_config=tiny_qwen3_5_config(), image_size=QWEN3_IMAGE_SIZE)
"""The tiny Qwen3.5: 3 Gated DeltaNet (linear attention) layers, then a gated full-attention layer."""
QWEN3_5_PLANS = {
    "qwen3_5_zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3), **QWEN3_5),
    # both head kinds split: 1 key head with its 2 value heads per rank; gated attention's 2 query heads, 1 KV head
    "qwen3_5_uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2), **QWEN3_5),
    # Ulysses SP2: each rank runs 1 key head with its 2 value heads over the whole 33-token sequence
    "qwen3_5_vision_sp2__llm_sp2": dict(vision=dict(sp=2), llm=dict(sp=2), text_tokens=9, **QWEN3_5),
    "qwen3_5_disjoint__2_micro_batches": dict(vision=dict(grad_accum=2), llm=dict(grad_accum=2),
                                              placement="disjoint", **QWEN3_5),
    # a stage boundary between layer kinds: stage 0 the 3 linear-attention layers, stage 1 the full-attention one
    "qwen3_5_llm_pp2_3_1__vision_dp2": dict(vision=dict(dp=2, grad_accum=2),
                                            llm=dict(pp=2, pp_layers=[3, 1], micro_batch=2, grad_accum=2), **QWEN3_5),
}
"""Qwen3.5 (runtime.models.families.qwen3_5, runtime.models.linear_attention)."""
QWEN3_5_MOE = dict(hf_config=tiny_qwen3_5_moe_config(), image_size=QWEN3_IMAGE_SIZE)
"""The tiny Qwen3.5-MoE: Qwen3.5's hybrid layers, each with 8 routed experts (top-2) and a shared expert."""
QWEN3_5_MOE_PLANS = {
    "qwen3_5_moe_ep2": dict(vision=dict(dp=2), llm=dict(dp=2, ep=2), **QWEN3_5_MOE),
    # experts over EP2 x TP2, the shared expert and both head kinds split by TP, ZeRO-1
    "qwen3_5_moe_ep2_tp2_zero1": dict(vision=dict(dp=2, tp=2, zero=1), llm=dict(dp=2, tp=2, ep=2, zero=1),
                                      **QWEN3_5_MOE),
}
"""Qwen3.5-MoE (runtime.models.families.qwen3_5_moe)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QWEN3_5_PLANS))
def test_parity_qwen3_5(name, worker_pool):
    assert_parity(plan_of(QWEN3_5_PLANS[name]), pool=worker_pool)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QWEN3_5_MOE_PLANS))
def test_parity_qwen3_5_moe(name, worker_pool):
    assert_parity(plan_of(QWEN3_5_MOE_PLANS[name]), pool=worker_pool)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QWEN3_VL_PLANS))
def test_parity_qwen3_vl(name, worker_pool):
    assert_parity(plan_of(QWEN3_VL_PLANS[name]), pool=worker_pool)


@pytest.mark.parametrize("name", list(QWEN3_VL_MOE_PLANS))
def test_parity_qwen3_vl_moe(name, worker_pool):
    """Parity, and every LLM rank reports the step's routed tokens per expert: each token of the global batch
    routed to ``k`` experts in each of the 4 MoE layers."""
    plan = plan_of(QWEN3_VL_MOE_PLANS[name])
    text = plan.model.hf_config["text_config"]
    for step in assert_parity(plan, pool=worker_pool)["results"]:
        for result in (r for r in step if "llm" in r["modules"]):
            routed = result["llm_tokens"] * text["num_experts_per_tok"] * text["num_hidden_layers"]
            assert len(result["expert_tokens"]) == 8 and sum(result["expert_tokens"]) == routed
            assert result["moe_load_imbalance"] >= 1.0


@pytest.mark.parametrize("name", list(QWEN2_AUDIO_PLANS))
def test_parity_qwen2_audio(name, worker_pool):
    assert_parity(plan_of(QWEN2_AUDIO_PLANS[name]), pool=worker_pool)


@pytest.mark.slow
def test_parity_on_conversations(tmp_path, worker_pool):
    """Conversation samples whose answers differ in length (so the label tokens per sample and per DP replica
    differ) under DP2 x TP2 for both modules, against the single-process model on the same samples."""
    import json

    import numpy as np
    from PIL import Image

    from tests.runtime.tokenizer import save_tokenizer

    Image.fromarray(np.random.default_rng(1).integers(0, 256, (80, 120, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    rows = [{"image": "a.png", "conversations": [{"from": "human", "value": f"<image>\nQuestion {i}?"},
                                                 {"from": "gpt", "value": "word " * (1 + 7 * i % 11)}]}
            for i in range(8)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = RunOptions(seed=SEED, data=str(tmp_path / "chat.jsonl"), tokenizer=str(save_tokenizer(tmp_path / "tok")))
    assert_parity(make_plan(dict(dp=2, tp=2), dict(dp=2, tp=2), learning_rate=LR, text_tokens=120), options,
                  worker_pool)


def _live_meshes(worker) -> int:
    """On one pooled actor: DeviceMesh objects still alive (no collection forced here: the job's close must have
    freed them)."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    return sum(isinstance(o, DeviceMesh) for o in gc.get_objects())


@pytest.mark.slow
def test_a_pooled_worker_keeps_no_mesh_of_its_finished_job(worker_pool):
    """A worker that serves job after job keeps none of a finished job's device meshes: DTensor's redistribution and
    topology caches hold meshes, and through them every gloo group of the job with its threads (a pooled worker
    held 111 gloo loop threads after a suite's jobs, which woke up for nothing)."""
    import ray

    run_runtime(make_plan(dict(tp=2, micro_batch=2), dict(dp=2, zero=3), learning_rate=LR), pool=worker_pool)
    assert ray.get([w.__ray_call__.remote(_live_meshes) for w in worker_pool.workers[:2]]) == [0, 0]

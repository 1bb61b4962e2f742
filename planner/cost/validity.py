"""Validity rules of one module's strategy: one-line reasons, empty when valid."""

from __future__ import annotations

import math

from planner.contract.hardware import Cluster
from planner.contract.models import LayerSpec, ModelSpec, ModuleSpec
from planner.contract.rules import (
    CONTEXT_PARALLEL_MODULES,
    attention_rules,
    balancing_loss_rule,
    expert_parallel_rule,
    linear_attention_rules,
    split_rule,
    width_rule,
)
from planner.contract.schema import ZERO_BUBBLE_SCHEDULES, zero_bubble_reasons
from planner.contract.strategy import ModuleStrategy
from planner.contract.workload import ModuleTokens, Workload, module_tokens


def check_strategy(
    model: ModelSpec,
    module: str,
    strategy: ModuleStrategy,
    cluster: Cluster,
    workload: Workload,
    *,
    allow_cross_node_tp: bool = False,
) -> list[str]:
    """Why ``strategy`` cannot run ``module`` on ``cluster`` for ``workload``; [] when it can.

    Rules: TP divides the attention heads (KV heads divided or replicated) and Ulysses SP divides the heads of
    a TP rank (KV heads are repeated as needed); the module fits the cluster; TP stays inside a node unless
    allowed; SP (the vision tower: CP x SP) leaves at least one attention window per rank on window-attention
    blocks; the audio encoder uses no CP (``CONTEXT_PARALLEL_MODULES``); dp * micro_batch * grad_accum equals the global batch; experts split
    over ep x tp ranks as ``expert_parallel_rule`` allows; pipeline parallelism as ``pipeline_reasons`` allows.
    """
    spec = model.module(module)
    s = strategy
    reasons: list[str] = []
    if s.gpus > cluster.num_devices:
        reasons.append(f"pp*dp*cp*sp*tp = {s.gpus} GPUs but the cluster has {cluster.num_devices}")
    if s.pp > 1:
        reasons += pipeline_reasons(model, spec, s)
    if s.samples_per_step != workload.global_batch:
        reasons.append(
            f"dp*micro_batch*grad_accum = {s.dp}*{s.micro_batch}*{s.grad_accum} = {s.samples_per_step} "
            f"but the global batch is {workload.global_batch}"
        )
    if not allow_cross_node_tp and (s.tp > cluster.devices_per_node or cluster.devices_per_node % s.tp):
        reasons.append(f"tp={s.tp} does not fit inside a node of {cluster.devices_per_node} GPUs")
    for layer in spec.layers:
        if layer.attention is not None:
            reasons += attention_rules(s.tp, s.sp, layer.attention.num_heads, layer.attention.num_kv_heads, layer.name)
        if (la := layer.linear_attention) is not None:
            reasons += linear_attention_rules(s.tp, s.sp, s.cp, la.num_key_heads, la.num_value_heads, layer.name)
        reasons += [problem for width, what in _tp_widths(layer) if (problem := width_rule(s.tp, width, what))]
    if problem := expert_parallel_rule(s.ep, s.tp, s.dp, s.sp, s.cp, _num_experts(spec), spec.name):
        reasons.append(problem)
    if s.cp > 1 and module not in CONTEXT_PARALLEL_MODULES:
        reasons.append(f"{module} uses cp={s.cp}; context parallelism is run for the LLM and the vision tower only")
    tokens = module_tokens(workload, model)[module]
    if (problem := _sequence_split_reason(model, module, s, tokens)):
        reasons.append(problem)
    if s.cp > 1 and module == "llm" and tokens.tokens < 2 * s.cp:
        reasons.append(f"cp={s.cp} needs at least {2 * s.cp} tokens per sample, got {tokens.tokens}")
    if s.cp > 1 and s.pp > 1:
        reasons.append(f"cp={s.cp} with pp={s.pp}: the runtime does not run ring context parallelism inside a "
                       "pipeline yet")
    return reasons


def _num_experts(spec: ModuleSpec) -> int | None:
    """Experts of the module's MoE layers (None without any)."""
    return next((layer.moe.num_experts for layer in spec.layers if layer.moe is not None), None)


def _tp_widths(layer: LayerSpec) -> list[tuple[int, str]]:
    """(width, what) of each dimension TP splits in ``layer`` besides its attention heads (not the routed experts:
    TP ranks hold whole experts, ``expert_parallel_rule``)."""
    widths = []
    if layer.mlp is not None:
        widths.append((layer.mlp.intermediate_size, f"MLP hidden width of {layer.name}"))
    if layer.moe is not None and layer.moe.shared_expert_intermediate_size:
        widths.append((layer.moe.shared_expert_intermediate_size, f"shared expert's hidden width of {layer.name}"))
    if layer.kind == "patch_merger":
        widths.append((layer.in_features, f"input width of {layer.name}"))
    if layer.kind == "lm_head":
        widths.append((layer.out_features, "vocabulary entries"))
    return widths


def _sequence_split_reason(model: ModelSpec, module: str, s: ModuleStrategy, tokens: ModuleTokens) -> str | None:
    """``split_rule`` for ``module``'s Ulysses split: windows per micro-batch on window-attention blocks, merge units
    per micro-batch on other vision towers (the tower splits them over cp x sp ranks), tokens per sample on the LLM
    (and audio positions)."""
    spec = model.module(module)
    degree = s.sp * s.cp if module == "vision" else s.sp
    if degree == 1:
        return None
    if any(layer.attention is not None and layer.attention.window_patches for layer in spec.layers):
        return split_rule(degree, math.floor(tokens.windows * s.micro_batch), "attention windows", "a micro-batch")
    if module == "vision":
        return split_rule(degree, math.floor(tokens.output_tokens * s.micro_batch), "merged tokens", "a micro-batch")
    return split_rule(degree, math.floor(tokens.tokens), f"{module} tokens", "a sample")


def pipeline_reasons(model: ModelSpec, spec: ModuleSpec, s: ModuleStrategy) -> list[str]:
    """Why ``spec`` cannot be pipelined as ``s`` says: only the LLM is (its decoder layers are the repeated block
    stages divide); every model chunk needs a decoder layer, the first one per injection level the encoder's
    features reach; torch's ``Schedule1F1B`` needs at least as many
    micro-batches as stages, and the interleaved schedules a micro-batch count that their rounds
    (``max(1, grad_accum // pp)``) divide. What the runtime does not run inside a pipeline yet is ruled out too:
    an lm_head tied to the embedding (on the first and the last stage), and a zero-bubble schedule with ZeRO-3 or
    full recomputation (``zero_bubble_reasons``), and the load-balancing loss (``balancing_loss_rule``)."""
    if spec.name != "llm":
        return [f"{spec.name} uses pp={s.pp}; pipeline parallelism is planned for the LLM only"]
    reasons = []
    if model.tie_word_embeddings:
        reasons.append(f"pp={s.pp}: {model.name} ties lm_head to the embedding, which the runtime does not split "
                       "over pipeline stages yet")
    if problem := balancing_loss_rule(s.pp, any(layer.moe is not None and layer.moe.balancing_loss
                                                for layer in spec.layers)):
        reasons.append(problem)
    blocks = [layer for layer in spec.layers if layer.kind == "decoder_layer"]
    if len(blocks) > 1 and not spec.layer_order:
        reasons.append(f"pp={s.pp}: {model.name} mixes dense and mixture-of-experts decoder layers, which pipeline "
                       "stages do not split yet")
    layers = sum(layer.count for layer in blocks)
    chunks = s.pp * s.virtual_stages
    first = max(1, len(model.injection_layers))
    if layers < chunks - 1 + first:
        needs = f" ({first} in the first, which the vision features reach)" if first > 1 else ""
        reasons.append(f"pp={s.pp} x virtual_stages={s.virtual_stages} = {chunks} pipeline chunks need "
                       f"{chunks - 1 + first} decoder layers{needs}, {spec.name} has {layers}")
    if s.grad_accum < s.pp:
        reasons.append(f"pp={s.pp} needs grad_accum >= {s.pp} micro-batches (1F1B), got {s.grad_accum}")
    rounds = max(1, s.grad_accum // s.pp)
    if s.virtual_stages > 1 and s.grad_accum % rounds:
        reasons.append(f"{s.pp_schedule} over pp={s.pp} runs grad_accum in {rounds} rounds, which do not divide "
                       f"grad_accum={s.grad_accum}")
    if s.pp_schedule in ZERO_BUBBLE_SCHEDULES:
        reasons += zero_bubble_reasons(s.zero, s.recompute)
    return reasons

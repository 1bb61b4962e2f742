"""Validity rules the planner and the runtime share, so that a plan one accepts the other runs: plain numbers in,
a one-line reason (or None / []) out. Nothing here imports the cost model, OR-Tools or torch."""

from __future__ import annotations


CONTEXT_PARALLEL_MODULES = ("vision", "llm")
"""Modules that run context parallelism: the LLM (causal ring, or gathered for packed rows) and the vision tower
(bidirectional, gathered per segment); not the audio encoder."""


def heads_rule(degree: int, axis: str, num_heads: int, num_kv_heads: int, layer: str) -> str | None:
    """A TP or Ulysses degree must divide the query heads and divide, or be a multiple of, the KV heads.

    When the degree is a multiple of the KV heads, each KV head is replicated degree/num_kv_heads times
    (Megatron-LM GQA handling); the cost model charges the replicated K/V weights and activations.
    """
    if num_heads % degree:
        return f"{axis}={degree} does not divide the {num_heads} attention heads of {layer}"
    if num_kv_heads % degree and degree % num_kv_heads:
        return f"{axis}={degree} neither divides nor is a multiple of the {num_kv_heads} KV heads of {layer}"
    return None


def attention_rules(tp: int, sp: int, num_heads: int, num_kv_heads: int, layer: str) -> list[str]:
    """Why ``tp`` x Ulysses ``sp`` cannot split the heads of an attention ``layer``: TP as ``heads_rule`` allows,
    and SP dividing the query heads of a TP rank (KV heads are repeated for the exchange as needed). The planner
    and the runtime both apply it."""
    reasons = []
    if tp > 1 and (problem := heads_rule(tp, "tp", num_heads, num_kv_heads, layer)):
        reasons.append(problem)
    if sp > 1 and num_heads % (tp * sp):
        per_rank = num_heads // tp if num_heads % tp == 0 else num_heads / tp
        reasons.append(f"sp={sp} does not divide the {per_rank:g} attention heads per TP rank of {layer} (tp={tp})")
    return reasons


def linear_attention_rules(tp: int, sp: int, cp: int, num_key_heads: int, num_value_heads: int,
                           layer: str) -> list[str]:
    """Why ``tp`` x Ulysses ``sp`` x ring ``cp`` cannot run a linear-attention (Gated DeltaNet) ``layer``: TP splits
    its key heads and its value heads alike (each rank keeps whole key heads with the value heads that read them), so
    it divides both; Ulysses gives each rank whole sequences of ``1 / sp`` of a TP rank's heads (the recurrence and
    the short conv then run unchanged), so ``tp * sp`` divides both; ring CP would split a recurrence that carries
    its state along the sequence over ranks, which nobody here runs. The planner and the runtime both apply it."""
    reasons = []
    for degree, axis in ((tp, "tp"), (tp * sp, "tp*sp")):
        for heads, kind in ((num_key_heads, "key"), (num_value_heads, "value")):
            if degree > 1 and heads % degree:
                reasons.append(f"{axis}={degree} does not divide the {heads} linear-attention {kind} heads of {layer}")
                break
        if reasons:
            break
    if cp > 1:
        reasons.append(f"cp={cp}: ring context parallelism of {layer}'s linear attention (a recurrence along the "
                       "sequence) is not run; plan with --fix llm.cp=1 (Ulysses SP splits it by heads)")
    return reasons


def split_rule(sp: int, parts: int, unit: str, where: str) -> str | None:
    """Ulysses SP splits a sequence into ``sp`` contiguous slices of at least one indivisible part each: the LLM's
    tokens of a sample (the runtime's ``split_sequence``), a vision micro-batch's attention windows or, without
    windows, its merge units (``split_windows``). Planner and runtime both apply it."""
    if sp > parts:
        return f"sp={sp} but {where} has only {parts} {unit}; each SP rank needs at least one"
    return None


def width_rule(tp: int, width: int, what: str) -> str | None:
    """TP splits a layer's ``width`` (an MLP's hidden width, a patch merger's input, the vocabulary) into equal
    parts: the runtime's column- and row-parallel pairs are DTensor ``Shard`` layouts that must split both
    matrices alike. Planner and runtime both apply it."""
    if tp > 1 and width % tp:
        return f"tp={tp} does not divide the {width} {what}"
    return None


def injection_rule(pp_layers: tuple[int, ...] | list[int], injections: int) -> str | None:
    """A pipelined LLM's first model chunk receives the encoder's hand-off, so it holds every decoder layer an
    injected feature is added after (Qwen3-VL's DeepStack: layers 0 .. ``injections`` - 1). The planner splits
    chunks so (``balanced_chunk_layers``), the runtime checks it."""
    if pp_layers and injections > pp_layers[0]:
        return (f"the first pipeline chunk holds {pp_layers[0]} decoder layers, but the vision features are added "
                f"after the first {injections}: give it at least {injections}")
    return None


def expert_parallel_rule(ep: int, tp: int, dp: int, sp: int, cp: int, num_experts: int | None,
                         layer: str) -> str | None:
    """Expert parallelism splits the experts of each MoE layer (``num_experts``; None: the module has none) over an
    EP group of ``ep`` of a stage's dp x cp x sp ranks with all their ``tp`` ranks, ``ep * tp`` ranks holding whole
    experts (TP ranks take disjoint slices of their tokens; torchtitan's etp=1, transformers ``AllToAllEP``): ``ep *
    tp`` divides the experts whenever the module has experts (so tp alone splits them, with ep=1), and for ep > 1
    ``ep`` divides dp * cp * sp, the ranks holding different tokens (an EP group is ``ep`` consecutive of them in the
    grid's (dp, cp, sp) order, one run of ranks). Planner and runtime both apply it."""
    if num_experts is None:
        if ep > 1:
            return f"ep={ep} but {layer} has no experts (expert parallelism is for mixture-of-experts layers)"
        return None
    if num_experts % (ep * tp):
        return (f"ep*tp = {ep}*{tp} = {ep * tp} does not divide the {num_experts} experts of {layer} (experts are "
                f"split over an EP group's ep x tp ranks)")
    if ep == 1:
        return None
    if (dp * cp * sp) % ep:
        return (f"ep={ep} does not divide dp*cp*sp = {dp}*{cp}*{sp} = {dp * cp * sp}, the ranks experts are split "
                f"over")
    return None


def balancing_loss_rule(pp: int, balancing_loss: bool) -> str | None:
    """A mixture-of-experts LLM trained with transformers' load-balancing loss (``output_router_logits``) is not
    pipelined: the loss's expert counts span every stage's layers. Planner and runtime both apply it."""
    if pp > 1 and balancing_loss:
        return (f"pp={pp}: the load-balancing loss (text_config.output_router_logits) is not run with a pipelined "
                "LLM, its expert counts span every stage's layers; set it false or plan with --fix llm.pp=1")
    return None

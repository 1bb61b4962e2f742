"""What both launchers (Ray: ``launcher.py``, torchrun: ``torchrun.py``) do around the Trainers, without Ray:
validate a plan against the model before any process group starts, and write gathered weights as a Hugging Face
folder."""

from __future__ import annotations

from planner.contract.rules import (attention_rules, expert_parallel_rule, injection_rule, linear_attention_rules,
                                    width_rule)
from planner.contract.schema import Plan
from runtime.run import preflight
from runtime.models.model import hf_config_from_dict
from runtime.parallel.ulysses import split_sequence
from runtime.parallel.parallel_dims import plan_dims
from runtime.run.preflight import module_names
from runtime.training.trainer import RunOptions
from runtime.models.families import family_of


def validate_plan(plan: Plan, options: RunOptions) -> None:
    """Everything that can be checked before any worker starts; raises ValueError / NotImplementedError in one
    line. The checks that need no torch (``preflight``) run first."""
    preflight.check_plan(plan)
    if options.memory_cap_bytes is not None and not preflight.is_cpu_plan(plan):
        raise ValueError("--memory-cap-gib caps a CPU run's workers; a GPU plan's cap is its GPUs' own memory")
    preflight.check_inputs(plan, data=options.data, checkpoint=options.checkpoint, tokenizer=options.tokenizer)
    names = module_names(plan)
    encoder, llm = (plan_dims(plan, name) for name in names)
    config = hf_config_from_dict(plan.model.hf_config)
    family = family_of(config)
    tc = config.get_text_config()
    reasons = family.encoder.rules(encoder.tp, encoder.sp, config)
    reasons += attention_rules(llm.tp, llm.sp, tc.num_attention_heads, tc.num_key_value_heads, "the LLM")
    widths = [(getattr(tc, "intermediate_size", None), "MLP hidden width of the LLM's decoder layers"),
              (getattr(tc, "shared_expert_intermediate_size", None), "shared expert's hidden width of the LLM"),
              (tc.vocab_size, "vocabulary entries")]  # a MoE decoder (Qwen3.5-MoE) may have no dense MLP
    reasons += [problem for width, what in widths if width and (problem := width_rule(llm.tp, width, what))]
    reasons += [problem for dims, what in ((encoder, f"the {encoder.name} encoder"), (llm, "the LLM"))
                if (problem := expert_parallel_rule(dims.ep, dims.tp, dims.dp, dims.sp, dims.cp, dims.experts or None,
                                                    what))]
    if "linear_attention" in (getattr(tc, "layer_types", None) or ()):
        reasons += linear_attention_rules(llm.tp, llm.sp, llm.cp, tc.linear_num_key_heads, tc.linear_num_value_heads,
                                          "the LLM's linear-attention layers")
    injection = injection_rule(llm.pp_layers, family.handoff_tensors(config) - 1)
    reasons += [injection] if injection else []
    if reasons:
        raise ValueError(reasons[0])
    if plan.workload.dataset is not None:
        return  # each packed micro-batch's shapes are known once the data is indexed
    layout = family.encoder.layout_from_plan(plan.workload, config)
    split_sequence(layout.seq_len, llm.sp)  # a token per SP rank at least
    layout.output_positions_per_rank(encoder.micro_batch, config, encoder.sequence_ranks)  # a unit per sequence rank

"""What both launchers (Ray: ``launcher.py``, torchrun: ``torchrun.py``) do around the Trainers, without Ray:
validate a plan against the model before any process group starts, and write gathered weights as a Hugging Face
folder."""

from __future__ import annotations

import torch

from planner.rules import attention_rules, injection_rule, width_rule
from planner.schema import Plan
from runtime import preflight
from runtime.data import layout_from_plan
from runtime.model import hf_config_from_dict
from runtime.parallel.ulysses import split_sequence
from runtime.parallel_dims import ParallelDims
from runtime.preflight import MODULES
from runtime.trainer import RunOptions
from runtime.families import family_of
from runtime.vision import merged_positions_per_rank


def validate_plan(plan: Plan, options: RunOptions) -> None:
    """Everything that can be checked before any worker starts; raises ValueError / NotImplementedError in one
    line. The checks that need no torch (``preflight``) run first."""
    preflight.check_plan(plan)
    preflight.check_inputs(plan, data=options.data, checkpoint=options.checkpoint, tokenizer=options.tokenizer)
    dims = {name: ParallelDims.from_plan(plan.module(name)) for name in MODULES}
    vision, llm = dims["vision"], dims["llm"]
    config = hf_config_from_dict(plan.model.hf_config)
    vc, tc = config.vision_config, config.get_text_config()
    reasons = attention_rules(vision.tp, vision.sp, vc.num_heads, vc.num_heads, "the vision tower")
    reasons += attention_rules(llm.tp, llm.sp, tc.num_attention_heads, tc.num_key_value_heads, "the LLM")
    vision_width = getattr(vc, "embed_dim", None) or vc.hidden_size  # Qwen2-VL names it embed_dim
    widths = [(vision.tp, getattr(vc, "intermediate_size", None) or int(vision_width * vc.mlp_ratio),
               "MLP hidden width of the vision blocks"),
              (vision.tp, vision_width * vc.spatial_merge_size**2, "input width of the patch merger"),
              (llm.tp, tc.intermediate_size, "MLP hidden width of the LLM's decoder layers"),
              (llm.tp, tc.vocab_size, "vocabulary entries")]
    reasons += [problem for tp, width, what in widths if (problem := width_rule(tp, width, what))]
    injection = injection_rule(llm.pp_layers, family_of(config).handoff_tensors(config) - 1)
    reasons += [injection] if injection else []
    if reasons:
        raise ValueError(reasons[0])
    if plan.workload.dataset is not None:
        return  # each packed micro-batch's shapes are known once the data is indexed
    layout = layout_from_plan(plan.workload, config)
    split_sequence(layout.seq_len, llm.sp)  # a token per SP rank at least
    merged_positions_per_rank(torch.tensor(layout.grids() * vision.micro_batch), vc, vision.sp)  # enough windows for SP


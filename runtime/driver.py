"""What both launchers (Ray: ``launcher.py``, torchrun: ``torchrun.py``) do around the Trainers, without Ray:
validate a plan against the model before any process group starts, and write gathered weights as a Hugging Face
folder."""

from __future__ import annotations

import torch

from planner.schema import Plan
from runtime import preflight
from runtime.data import layout_from_plan
from runtime.model import hf_config_from_dict
from runtime.parallel.ulysses import split_sequence
from runtime.parallel_dims import ParallelDims
from runtime.preflight import MODULES
from runtime.trainer import RunOptions
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
    if vc.num_heads % (vision.tp * vision.sp):
        raise ValueError(f"vision tp*sp = {vision.tp * vision.sp} does not divide its {vc.num_heads} heads")
    if tc.num_attention_heads % llm.tp or tc.num_key_value_heads % llm.tp:
        raise ValueError(
            f"llm tp = {llm.tp} does not divide its {tc.num_attention_heads} q / {tc.num_key_value_heads} kv heads"
        )
    if (tc.num_attention_heads // llm.tp) % llm.sp:
        raise ValueError(
            f"llm sp = {llm.sp} does not divide the {tc.num_attention_heads // llm.tp} attention heads of a TP rank "
            f"(tp = {llm.tp})"
        )
    if plan.workload.dataset is not None:
        return  # each packed micro-batch's shapes are known once the data is indexed
    layout = layout_from_plan(plan.workload, config)
    split_sequence(layout.seq_len, llm.sp)  # a token per SP rank at least
    grid = torch.tensor([(1, h // layout.patch_size, w // layout.patch_size) for h, w in layout.image_sizes])
    merged_positions_per_rank(grid.repeat(vision.micro_batch, 1), vc, vision.sp)  # enough windows for SP


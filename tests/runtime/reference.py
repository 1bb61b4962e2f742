"""The unmodified single-process transformers model trained on the same samples: the parity reference."""

from __future__ import annotations

import torch

from planner.contract.schema import Plan
from runtime.data.samples import IGNORE_INDEX, collate
from runtime.models.model import build_model, split_model
from runtime.training.optim import warmup_factor
from runtime.run.preflight import module_names
from runtime.training.step_inputs import data_source
from runtime.training.trainer import RunOptions


def reference_run(plan: Plan, *, seed: int, steps: int, options: RunOptions | None = None) -> dict:
    """Loss and pre-clip global gradient norm of each step, the first step's gradients before clipping, and the
    parameters after the last step (HF names -> tensors), on the samples ``options`` names (the runtime's
    ``data_source``; synthetic by default)."""
    torch.set_num_threads(1)
    model = build_model(plan.model.hf_config, seed=seed)
    encoder = module_names(plan)[0]
    split_model(model)[0].requires_grad_(not plan.module(encoder).frozen)
    model.model.language_model.requires_grad_(not plan.module("llm").frozen)
    model.lm_head.requires_grad_(not plan.module("llm").frozen)
    data = data_source(plan, options or RunOptions(seed=seed), model.config)
    training = plan.training
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_factor(s, training.warmup_steps))
    losses, grad_norms, grads = [], [], None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for batch, weight in _step_batches(plan, data, step):
            loss = model(**batch).loss * weight
            loss.backward()
            total += float(loss.detach())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip_norm)))
        optimizer.step()
        schedule.step()
        losses.append(total)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": grad_norms, "grads": grads, "params": params}


def _step_batches(plan: Plan, data, step: int) -> list[tuple[dict, float]]:
    """(HF model inputs, loss weight) of a step: the whole global batch at once (weight 1) for a fixed-shape plan;
    for a dataset plan, each sample of the step's packs alone, weighted by its share of the step's target tokens,
    so that the weighted mean losses sum to the step's mean over all of them."""
    if plan.workload.dataset is None:
        size = plan.workload.global_batch
        return [(collate([data.sample(step * size + i) for i in range(size)]), 1.0)]
    llm = plan.module("llm")
    slots = data.step_slots(step * plan.workload.global_batch, llm.grad_accum, llm.dp, llm.micro_batch)
    samples = [data.sample(i) for pack in slots for i in pack]
    targets = [int((s["labels"][1:] != IGNORE_INDEX).sum()) for s in samples]
    batches = [({k: v[None] if k in ("input_ids", "mm_token_type_ids", "labels") else v for k, v in s.items()
                 if k not in _absent(s)}, n) for s, n in zip(samples, targets)]
    return [(batch, n / sum(targets)) for batch, n in batches]


def _absent(sample: dict) -> set[str]:
    """The keys of a sample's images (or clips) when it has none: transformers' forward takes absent ones only."""
    return {key for grid, keys in (("image_grid_thw", ("pixel_values", "image_grid_thw")),
                                   ("video_grid_thw", ("pixel_values_videos", "video_grid_thw")))
            if grid in sample and len(sample[grid]) == 0 for key in keys}

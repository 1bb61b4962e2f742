"""The unmodified single-process transformers model trained on the same samples: the parity reference."""

from __future__ import annotations

import torch

from planner.schema import Plan
from runtime.data import collate, layout_from_plan
from runtime.model import build_model
from runtime.optim import warmup_factor
from runtime.trainer import RunOptions, data_source


def reference_run(plan: Plan, *, seed: int, steps: int, options: RunOptions | None = None) -> dict:
    """Loss and pre-clip global gradient norm of each step, the first step's gradients before clipping, and the
    parameters after the last step (HF names -> tensors), on the samples ``options`` names (the runtime's
    ``data_source``; synthetic by default)."""
    torch.set_num_threads(1)
    model = build_model(plan.model.hf_config, seed=seed)
    model.model.visual.requires_grad_(not plan.module("vision").frozen)
    model.model.language_model.requires_grad_(not plan.module("llm").frozen)
    model.lm_head.requires_grad_(not plan.module("llm").frozen)
    layout = layout_from_plan(plan.workload, model.config)
    data = data_source(options or RunOptions(seed=seed), layout)
    training = plan.training
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_factor(s, training.warmup_steps))
    batch_size = plan.workload.global_batch
    losses, grad_norms, grads = [], [], None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        batch = collate([data.sample(step * batch_size + i) for i in range(batch_size)])
        loss = model(**batch).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip_norm)))
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": grad_norms, "grads": grads, "params": params}

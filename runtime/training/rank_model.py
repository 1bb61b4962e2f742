"""This rank's part of the model: its modules' shards, built on ``meta``, parallelised there, then materialised and
filled (runtime.checkpoints.hf_folder), with their optimizers and numeric recipes (runtime.parallel.precision). Only this
rank's shards ever get storage. Reading the model back whole is runtime.training.full_model's.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch

from planner.contract.schema import Plan
from runtime.checkpoints.hf_folder import HFFolder, TensorSource, materialize
from runtime.checkpoints.dcp_checkpoint import Unfilled
from runtime.models.model import RandomInit, meta_model, split_model
from runtime.training.optim import build_optimizer
from runtime.parallel import attention
from runtime.parallel.precision import Precision
from runtime.parallel.parallel_dims import ParallelDims
from runtime.models.families import family_of
from runtime.models.parallelize import parallelize_encoder, parallelize_llm, parallelize_pipelined_llm


class RankModel:
    """The modules this rank holds (``modules``: the encoder, ``vision`` or ``audio``, and/or ``llm``, a pipelined
    LLM as its stage's chunks),
    the trainable ones' optimizers and LR schedules, and the RoPE index function of the full model. ``weights``
    overrides where the shards' values come from (``_weights_source``)."""

    def __init__(self, plan: Plan, *, rank: int, dims: dict[str, ParallelDims], precision: dict[str, Precision],
                 device: torch.device, seed: int, checkpoint: str | None, resume: bool,
                 weights: TensorSource | None = None):
        self.plan, self.rank, self.dims, self.precision, self.device = plan, rank, dims, precision, device
        model = meta_model(plan.model.hf_config, attention=attention.register())
        attention.use_planned_calls(model, {m.name: m.attention for m in plan.modules})
        self.init = RandomInit(copy.deepcopy(model), seed)
        """The random init; its ``meta`` copy of the whole model also says what a saved checkpoint holds."""
        self.modules, self.rope_index = self._build(model, weights or self._weights_source(checkpoint, resume))
        self.trainable = {name: m for name, m in self.modules.items() if not dims[name].frozen}
        self.optimizers = {name: build_optimizer(m, plan.training) for name, m in self.trainable.items()}

    def _build(self, model: torch.nn.Module, params: TensorSource):
        """Split and shard ``model`` on ``meta``, then give this rank's shards (only) storage and their values from
        ``params``."""
        family = family_of(model.config)
        encoder = family.encoder.name
        tower, llm, rope_index = split_model(model)
        if family.prepare_llm is not None:
            family.prepare_llm(llm, self.plan.module("llm"))
        modules = {}
        for name, module in ((encoder, tower), ("llm", llm)):
            module.to(self.precision[name].param_dtype)
            module.requires_grad_(not self.dims[name].frozen)
        if self.rank in self.dims[encoder].ranks:
            parallelize_encoder(tower, self.dims[encoder], self.precision[encoder], family)
            modules[encoder] = tower
        if self.rank in self.dims["llm"].ranks and self.dims["llm"].pp_enabled:
            modules["llm"] = parallelize_pipelined_llm(llm, self.dims["llm"], self.precision["llm"], self.rank,
                                                       family)
            for chunk in modules["llm"].chunks:
                chunk.forward_context = functools.partial(self.autocast, "llm")
        elif self.rank in self.dims["llm"].ranks:
            parallelize_llm(llm, self.dims["llm"], self.precision["llm"], family)
            modules["llm"] = llm
        else:
            model.model.language_model, model.lm_head = None, None
        for name, module in modules.items():
            materialize(module, hf_name=module.hf_name, params=params, buffers=self.init, device=self.device,
                        row_order=functools.partial(self.row_order, name))
        self.init.release()
        return modules, rope_index

    def _weights_source(self, checkpoint: str | None, resume: bool) -> TensorSource:
        """Where the parameters' initial values come from: nowhere when resuming (``load_checkpoint`` fills the
        shards), the checkpoint folder, else the random init."""
        if resume:
            return Unfilled()
        return self.init if checkpoint is None else HFFolder(checkpoint)

    def row_order(self, module_name: str, local_name: str, rows: int) -> torch.Tensor | None:
        """HF row of each stored row of a parameter, where a parallelism reordered them (vision qkv, Qwen3.5's
        linear-attention q/k/v under TP)."""
        config = self.init.meta.config
        family, tp = family_of(config), self.dims[module_name].tp
        if module_name == "llm":
            return family.llm_row_order(local_name, config, tp) if family.llm_row_order is not None else None
        return family.encoder.row_order(local_name, tp, rows)

    def autocast(self, module_name: str):
        """The module's autocast context (a no-op where its recipe computes in the parameters' dtype)."""
        dtype = self.precision[module_name].autocast_dtype
        # No weight cache: it would hold a bf16 copy of every weight the forward used until the context exits (the
        # whole TP-local LLM); uncached, each cast lives as long as its op, or its layer's saved tensors.
        return (contextlib.nullcontext() if dtype is None
                else torch.autocast(self.device.type, dtype=dtype, cache_enabled=False))

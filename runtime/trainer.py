"""The step loop on one rank: data -> vision forward -> hand-off -> LLM forward/backward -> hand-back ->
vision backward -> optimizer. Colocated and disjoint placements differ only in ``train_step``'s one branch.

Start-up holds only this rank's shards: the model is built on ``meta``, sharded there, then each shard is
materialised and filled (runtime.checkpoint).

Numerics (runtime.parallel.precision): on CPU everything runs in fp32 (for exact parity with the single-process
model). On GPU ``bf16_mixed`` keeps fp32 weights/grads/Adam and computes in bf16 (FSDP2's MixedPrecisionPolicy
where FSDP wraps the module, else autocast); ``bf16_pure`` = bf16 everywhere.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import resource
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import PretrainedConfig

from planner.schema import Plan
from runtime.conversations import ConversationData
from runtime.data import (
    IGNORE_INDEX,
    CaptionData,
    Sample,
    Source,
    SyntheticData,
    collate,
    layout_from_plan,
    pack_rows,
    token_sequence,
)
from runtime.handoff import Handoff, Posted, Routes
from runtime.llm import LLMShard, image_slots_per_rank, packed_position_ids, pad_packed_row, shard_llm_batch
from runtime.checkpoint import HFFolder, TensorSource, materialize, save_hf_folder
from runtime.dcp_checkpoint import Unfilled, load_checkpoint
from runtime.model import RandomInit, hf_config_from_dict, meta_model, split_model
from runtime.optim import build_optimizer, clip_grad_norm
from runtime.packed_data import PackedConversations
from runtime.prefetch import Prefetcher
from runtime.parallel import attention
from runtime.parallel.fsdp import all_reduce_gradients, set_gradient_sync
from runtime.parallel.precision import module_precision
from runtime.parallel.tensor_parallel import qkv_from_tp_layout, qkv_row_order
from runtime.parallel.ulysses import split_sequence
from runtime.parallel_dims import BATCH_AXIS, ParallelDims
from runtime.preflight import MODULES, is_conversation_file
from runtime.parallelize import parallelize_llm, parallelize_pipelined_llm, parallelize_vision, uses_fsdp
from runtime.pipeline import MicroBatchShapes, build_schedule, stage_of_parameter
from runtime.vision import merged_positions_per_rank, shard_vision_batch, vision_forward, window_layout


MAX_VISION_IN_FLIGHT = 2
"""Disjoint placement: micro-batches the vision group runs ahead of its backward (activation memory bound)."""


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """What the command line adds to a plan."""

    seed: int = 0
    """Seed of the random init and of the synthetic data."""
    data: str | None = None
    """Image-caption folder or JSONL, or a conversation file; synthetic data when None."""
    tokenizer: str | None = None
    """Model folder whose tokenizer and chat template conversation data goes through."""
    checkpoint: str | None = None
    """Hugging Face folder (save_pretrained or Hub download) to start from; random init when None."""
    prefetch: bool = False
    """Build the next step's samples in a worker process during each step (the command line's default)."""
    resume: str | None = None
    """Complete training checkpoint (runtime.dcp_checkpoint) to continue from: weights, optimizer, LR schedule,
    counters and RNG states; written under this plan or any other of the same model."""


def numerics_device_type(plan: Plan) -> str:
    """The device type whose numeric recipe (runtime.parallel.precision) the plan runs: the plan's device, whatever
    the tensors' (the dry-run runs a GPU plan's recipe on fake CPU tensors)."""
    return "cpu" if plan.cluster.device.name.lower() == "cpu" else "cuda"


def device_for(plan: Plan) -> torch.device:
    """CPU for a plan made for ``--gpu cpu``, else this worker's GPU."""
    return torch.device("cpu") if numerics_device_type(plan) == "cpu" else torch.device("cuda", 0)


def data_source(plan: Plan, options: RunOptions, config: PretrainedConfig) -> Source | PackedConversations:
    """A dataset plan's packed conversations; else, in the plan's fixed layout, conversations (through
    ``options.tokenizer``), image-caption pairs, or synthetic samples."""
    if plan.workload.dataset is not None:
        return PackedConversations(options.data, options.tokenizer, config=config, dataset=plan.workload.dataset,
                                   seed=options.seed)
    layout = layout_from_plan(plan.workload, config)
    if options.data and is_conversation_file(Path(options.data)):
        if not options.tokenizer:
            raise ValueError(f"{options.data} holds conversations: give --tokenizer DIR, the model folder whose "
                             "tokenizer and chat template they go through")
        return ConversationData(options.data, layout, options.tokenizer)
    if options.data:
        return CaptionData(options.data, layout)
    return SyntheticData(layout, options.seed)


class Trainer:
    """Everything one rank holds: its modules' shards, optimizers, data and the hand-off routes."""

    def __init__(self, plan: Plan, *, rank: int, options: RunOptions):
        self.plan, self.rank, self.options = plan, rank, options
        self.device = device_for(plan)
        self.dims = {name: ParallelDims.from_plan(plan.module(name)) for name in MODULES}
        for dims in self.dims.values():
            dims.build_mesh(self.device.type)
        self.numerics = numerics_device_type(plan)
        self.precision = {name: module_precision(plan.training.precision, self.numerics, fsdp=uses_fsdp(dims))
                          for name, dims in self.dims.items()}
        config = hf_config_from_dict(plan.model.hf_config)
        self.packed = plan.workload.dataset is not None
        """A dataset plan: packed micro-batches of native-resolution samples (runtime.packed_data)."""
        self.layout = None if self.packed else layout_from_plan(plan.workload, config)
        self.vision_config = config.vision_config
        self.source = data_source(plan, options, config)
        self.prefetcher = Prefetcher(self.source) if options.prefetch else None
        self._step_slots: list[list[int]] | None = None
        self.modules, self.rope_index = self._build_modules(attention.register())
        self.trainable = {name: m for name, m in self.modules.items() if not self.dims[name].frozen}
        self.optimizers = {name: build_optimizer(m, plan.training) for name, m in self.trainable.items()}
        self.handoff = Handoff(llm=self._receiving_llm, vision_trainable=not self.dims["vision"].frozen,
                               hidden=config.get_text_config().hidden_size, rank=self.rank,
                               dtype=self._handoff_dtype(), device=self.device)
        self._fixed_routes = None if self.packed else self._layout_routes()
        self.schedule, self.pipeline_shapes = None, None
        if self.dims["llm"].pp_enabled and "llm" in self.modules:
            self.pipeline_shapes = self._micro_batch_shapes(config)
            self.schedule = build_schedule(self.modules["llm"], self.dims["llm"], self.device, self.pipeline_shapes,
                                           self._pipeline_loss, functools.partial(self._timed, "pp_compute_s"))
        if self.packed:
            check_vision_windows(self.source, self.dims["vision"], self.vision_config)
        self.step = 0
        self.samples_seen = 0
        """Global index of the next sample: the data position, independent of the plan."""
        if options.resume is not None:
            load_checkpoint(self, options.resume)

    # ---- construction -------------------------------------------------------------------------------
    def _build_modules(self, attn: str):
        """Build the model on ``meta``, split and shard it there, then give this rank's shards (only) storage and
        their values: the random init or the checkpoint's slices (runtime.checkpoint)."""
        model = meta_model(self.plan.model.hf_config, attention=attn)
        self._init = RandomInit(copy.deepcopy(model), self.options.seed)
        vision, llm, rope_index = split_model(model)
        modules = {}
        for name, module in (("vision", vision), ("llm", llm)):
            module.to(self.precision[name].param_dtype)
            module.requires_grad_(not self.dims[name].frozen)
        if self.rank in self.dims["vision"].ranks:
            parallelize_vision(vision, self.dims["vision"], self.precision["vision"])
            vision.set_forward(vision_forward)
            modules["vision"] = vision
        else:
            model.model.visual = None
        if self.rank in self.dims["llm"].ranks and self.dims["llm"].pp_enabled:
            modules["llm"] = parallelize_pipelined_llm(llm, self.dims["llm"], self.precision["llm"], self.rank)
            for chunk in modules["llm"].chunks:
                chunk.forward_context = functools.partial(self._autocast, "llm")
        elif self.rank in self.dims["llm"].ranks:
            parallelize_llm(llm, self.dims["llm"], self.precision["llm"])
            modules["llm"] = llm
        else:
            model.model.language_model, model.lm_head = None, None
        params = self._weights_source()
        for name, module in modules.items():
            materialize(module, hf_name=module.hf_name, params=params, buffers=self._init, device=self.device,
                        row_order=functools.partial(self._row_order, name))
        self._init.release()
        return modules, rope_index

    def _weights_source(self) -> TensorSource:
        """Where the parameters' initial values come from: nowhere when resuming (load_checkpoint fills the
        shards), the checkpoint folder, else the random init."""
        if self.options.resume is not None:
            return Unfilled()
        return self._init if self.options.checkpoint is None else HFFolder(self.options.checkpoint)

    def _row_order(self, module_name: str, local_name: str, rows: int) -> torch.Tensor | None:
        """HF row of each stored row of a parameter, where a parallelism reordered them (vision qkv under TP)."""
        dims = self.dims[module_name]
        if module_name == "vision" and dims.tp_enabled and ".attn.qkv." in local_name:
            return qkv_row_order(rows, dims.tp)
        return None

    @property
    def _receiving_llm(self) -> ParallelDims:
        """The LLM ranks the hand-off feeds: all of them, or a pipeline's first stage."""
        llm = self.dims["llm"]
        return llm.stage_view(0) if llm.pp_enabled else llm

    def _layout_routes(self) -> Routes:
        """The hand-off routes of every micro-batch of a fixed-shape plan (all samples share the layout)."""
        vision, llm = self.dims["vision"], self._receiving_llm
        positions = merged_positions_per_rank(self._grid(vision.micro_batch), self.vision_config, vision.sp)
        template = self._sample_ids()
        row = (len(template), (template == self.layout.image_token_id).nonzero().flatten())
        slots = image_slots_per_rank([row] * llm.micro_batch, llm.sp)
        return Routes.build(vision, llm, [positions] * vision.dp, [slots] * llm.dp, self.device)

    def _packed_routes(self, micro: int) -> Routes:
        """The hand-off routes of packed micro-batch ``micro``, from the index alone (no sample is built)."""
        vision, llm = self.dims["vision"], self._receiving_llm
        index = self.source.samples
        positions = []
        for d in range(vision.dp):
            grid = torch.tensor([g for i in self._slot_samples(micro, vision, d) for g in index[i].grids])
            positions.append(merged_positions_per_rank(grid, self.vision_config, vision.sp))
        slots = []
        for e in range(llm.dp):
            samples = [index[i] for i in self._slot_samples(micro, llm, e)]
            starts = itertools.accumulate((s.length for s in samples), initial=0)
            row = (sum(s.length for s in samples), torch.cat([s.image_positions + a for s, a in zip(samples, starts)]))
            slots.append(image_slots_per_rank([row], llm.sp))
        return Routes.build(vision, llm, positions, slots, self.device)

    def _routes(self, micro: int) -> Routes:
        return self._fixed_routes if self._fixed_routes is not None else self._step_routes[micro]

    def _sample_ids(self) -> torch.Tensor:
        """The token ids of every sample of a fixed-shape plan where it matters here: its image tokens' places."""
        return token_sequence([], self.layout)["input_ids"]

    def _grid(self, samples: int) -> torch.Tensor:
        sizes = [(1, h // self.layout.patch_size, w // self.layout.patch_size) for h, w in self.layout.image_sizes]
        return torch.tensor(sizes * samples)

    def _micro_batch_shapes(self, config) -> MicroBatchShapes:
        """What one micro-batch of the pipelined LLM looks like at this rank's chunk boundaries: a fixed-shape
        plan's samples (under SP, the rank's slice of every sequence), or a dataset plan's packed row padded to the
        micro-batch's budget, with room for the most image tokens its packs can hold (``pad_packed_row``)."""
        text, dims = config.get_text_config(), self.dims["llm"]
        if self.packed:
            samples, seq_len = 1, dims.micro_batch * self.source.budget
            image_tokens = self.source.most_image_tokens(dims.micro_batch)
        else:
            template = self._sample_ids()
            bounds = split_sequence(len(template), dims.sp)
            j = dims.coordinate(self.rank)["sp"]
            ids = template[bounds[j]:bounds[j + 1]]
            samples, seq_len = dims.micro_batch, len(ids)
            image_tokens = int((ids == self.layout.image_token_id).sum())
        return MicroBatchShapes(samples=samples, seq_len=seq_len, image_tokens=image_tokens, hidden=text.hidden_size,
                                vocab=text.vocab_size, compute_dtype=self.precision["llm"].compute_dtype,
                                handoff_dtype=self._handoff_dtype(), rows_require_grad=not self.dims["vision"].frozen)

    def _handoff_dtype(self) -> torch.dtype:
        return torch.float32 if self.numerics == "cpu" else torch.bfloat16

    def _autocast(self, module_name: str):
        dtype = self.precision[module_name].autocast_dtype
        # No weight cache: it would hold a bf16 copy of every weight the forward used until the context exits (the
        # whole TP-local LLM); uncached, each cast lives as long as its op, or its layer's saved tensors.
        return (contextlib.nullcontext() if dtype is None
                else torch.autocast(self.device.type, dtype=dtype, cache_enabled=False))

    # ---- data ---------------------------------------------------------------------------------------
    @property
    def num_micro_batches(self) -> int:
        return self.dims["llm"].grad_accum

    @property
    def positions_per_step(self) -> int:
        """How far a step moves the data position (samples; a dataset plan's packs)."""
        llm = self.dims["llm"]
        return llm.grad_accum * llm.dp * llm.micro_batch

    def _slots_at(self, position: int) -> list[list[int]] | None:
        """A dataset plan's packs of the step at data position ``position`` (``PackedConversations.step_slots``)."""
        llm = self.dims["llm"]
        return self.source.step_slots(position, llm.grad_accum, llm.dp, llm.micro_batch) if self.packed else None

    def _slot_samples(self, micro: int, dims: ParallelDims, replica: int) -> list[int]:
        """This step's ``slot_samples``."""
        return slot_samples(micro, dims, replica, position=self.samples_seen, slots=self._step_slots)

    def _indexes_at(self, position: int, slots: list[list[int]] | None) -> list[int]:
        """The samples this rank's modules run in the step at ``position``, each once."""
        indexes = {}
        for micro in range(self.num_micro_batches):
            for name in self.modules:
                dims = self.dims[name]
                replica = dims.coordinate(self.rank)["dp"]
                indexes.update(dict.fromkeys(slot_samples(micro, dims, replica, position=position, slots=slots)))
        return list(indexes)

    def _samples(self, micro: int, name: str) -> Sample:
        """This rank's samples of micro-batch ``micro`` for module ``name`` (its DP replica's slice), in host memory
        (pinned on a GPU): a stage moves only its own shard of a micro-batch to the device, when it runs, so the
        step's pixels are never all on the device (32 micro-batches of 16,384-patch fp32 images are 2.3 GiB). Modules
        that hold the same samples share them. A dataset plan's micro-batch is one packed row (``pack_rows``)."""
        dims = self.dims[name]
        key = tuple(self._slot_samples(micro, dims, dims.coordinate(self.rank)["dp"]))
        if key not in self._batches:
            samples = [self._step_samples[i] for i in key]
            batch = pack_rows(samples) if self.packed else collate(samples)
            pin = self.device.type == "cuda"
            self._batches[key] = {k: v.pin_memory() if pin else v for k, v in batch.items()}
            self.on_host_data(self._batches[key].values())
        return self._batches[key]

    @staticmethod
    def on_host_data(tensors) -> None:
        """Called with each host-memory sample and batch; a memory measurement on the CPU sets it to
        ``runtime.dry_run.StepMemTracker.forget`` (host memory is not the device's, though on the CPU it is one)."""

    def _prepare_inputs(self) -> float:
        """This rank's samples of the step (from the prefetch worker, which built them during the previous step,
        else built here), its micro-batches and the LLM's token shards, before the step's clock starts; then the
        worker starts on the next step. Returns the seconds it took (reported as ``data_s``)."""
        start = time.perf_counter()
        self._batches: dict[tuple[int, ...], Sample] = {}
        self._llm_shards: dict[int, LLMShard] = {}
        self._step_slots = self._slots_at(self.samples_seen)
        if self.packed:
            self._step_routes = [self._packed_routes(micro) for micro in range(self.num_micro_batches)]
            self._step_tokens = sum(self.source.pack_tokens(pack) for pack in self._step_slots)
        else:
            self._step_tokens = self.positions_per_step * self.layout.seq_len
        indexes = self._indexes_at(self.samples_seen, self._step_slots)
        if self.prefetcher is None:
            self._step_samples = {i: self.source.sample(i) for i in indexes}
        else:
            self._step_samples = self.prefetcher.take(self.samples_seen, indexes)
            following = self.samples_seen + self.positions_per_step
            self.prefetcher.submit(following, self._indexes_at(following, self._slots_at(following)))
        for sample in self._step_samples.values():
            self.on_host_data(sample.values())
        for micro in range(self.num_micro_batches):
            for name in self.modules:
                self._samples(micro, name)
            if "llm" in self.modules:
                self._llm_shard(micro)
        return time.perf_counter() - start

    def _llm_shard(self, micro: int) -> LLMShard:
        """This rank's slice of micro-batch ``micro`` for the LLM (the whole sequences without SP)."""
        if micro not in self._llm_shards:
            dims, batch = self.dims["llm"], self._samples(micro, "llm")
            ids, labels, segments = batch["input_ids"], batch["labels"], None
            if self.packed:
                position_ids = packed_position_ids(batch, self.rope_index)
                segments = tuple(batch["sample_lens"].tolist())
                if self.pipeline_shapes is not None:
                    ids, position_ids, labels = pad_packed_row(ids, position_ids, labels, self.pipeline_shapes.seq_len)
            else:
                position_ids, _ = self.rope_index(ids, mm_token_type_ids=batch["mm_token_type_ids"],
                                                  image_grid_thw=batch["image_grid_thw"])
            sp_group = dims.grid_mesh["sp"].get_group() if dims.sp_enabled else None
            self._llm_shards[micro] = _to_device(shard_llm_batch(
                ids, position_ids, labels, sp_rank=dims.coordinate(self.rank)["sp"],
                sp_group=sp_group, sp=dims.sp, segment_lens=segments,
            ), self.device)
        return self._llm_shards[micro]

    def _count_target_tokens(self) -> torch.Tensor:
        """Tokens the loss averages over in this step, across all LLM replicas and sequence slices."""
        count = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(self.num_micro_batches):
            count += (self._llm_shard(micro).targets_Bs != IGNORE_INDEX).sum()
        dims = self.dims["llm"]
        if dims.batch_enabled:
            dist.all_reduce(count, group=dims.mesh[BATCH_AXIS].get_group())
        return count

    # ---- the step's named stages -------------------------------------------------------------------------
    def vision_forward(self, micro: int) -> torch.Tensor:
        """This rank's merged image tokens of micro-batch ``micro`` (window order)."""
        dims = self.dims["vision"]
        batch = self._samples(micro, "vision")
        sp_group = dims.grid_mesh["sp"].get_group() if dims.sp_enabled else None
        shard = shard_vision_batch(batch["pixel_values"], batch["image_grid_thw"].cpu(), self.vision_config,
                                   sp_rank=dims.coordinate(self.rank)["sp"], sp_group=sp_group, sp=dims.sp)
        shard = _to_device(shard, self.device)
        with self._timed("vision_forward_s"), self._autocast("vision"), torch.set_grad_enabled(not dims.frozen):
            return self.modules["vision"](shard)

    def hand_off(self, rows: torch.Tensor | None, micro: int) -> Posted:
        """Post the sends of this rank's vision piece and, on LLM ranks, the receives of the image tokens it places."""
        return self.handoff.activations(rows, micro, self._routes(micro))

    def llm_forward_backward(
        self, micro: int, embeds: torch.Tensor, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor | None, float]:
        """LLM forward and backward of this rank's sequence slice on its received image tokens; returns their
        gradient and the loss share."""
        shard = self._llm_shard(micro)
        llm, dims = self.modules["llm"], self.dims["llm"]
        embeds.requires_grad_(not self.dims["vision"].frozen)
        set_gradient_sync(llm, zero=dims.zero, last_micro_batch=micro == self.num_micro_batches - 1)
        with loss_parallel() if dims.tp_enabled else contextlib.nullcontext():
            with self._timed("llm_forward_s"), self._autocast("llm"):
                # the logits die with the loss's frame: only the log-softmax the backward reads stays
                loss = self._loss(llm(shard.input_ids_Bs, embeds, shard.position_ids_3Bs, shard.ulysses),
                                  shard.targets_Bs, num_tokens)
            with self._timed("llm_backward_s"):
                loss.backward()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return embeds.grad, float(value.detach())

    def hand_back(self, grad: torch.Tensor | None, micro: int) -> Posted:
        """Post the image-token gradients back to the vision ranks and, on those, the receives of their own."""
        return self.handoff.gradients(grad, micro, self._routes(micro))

    def vision_backward(self, rows: torch.Tensor, grad: torch.Tensor | None, micro: int) -> None:
        """Backpropagate this rank's piece gradient through the vision tower (nothing when it is frozen)."""
        dims = self.dims["vision"]
        if dims.frozen:
            return
        set_gradient_sync(self.modules["vision"], zero=dims.zero, last_micro_batch=micro == self.num_micro_batches - 1)
        with self._timed("vision_backward_s"):
            rows.backward(grad.to(rows.dtype))

    def optimizer_step(self) -> float:
        """Sum ZeRO-0 gradients, clip by the global norm over all modules, step AdamW and the LR schedule."""
        with self._timed("grad_sync_s"):
            for name, module in self.trainable.items():
                dims = self.dims[name]
                if dims.zero == 0 and dims.batch_enabled:
                    all_reduce_gradients(module, dims.mesh[BATCH_AXIS].get_group())
        with self._timed("optimizer_s"):
            norm = clip_grad_norm(*self._norm_parts(), self.plan.training.grad_clip_norm, self.device)
            for optimizer, schedule in self.optimizers.values():
                optimizer.step()
                schedule.step()
        return norm

    def _norm_parts(self) -> tuple[dict[str, torch.nn.Module], list[str]]:
        """The trainable parts whose gradient norms make the global norm: each module, or each pipeline stage of a
        pipelined one (its stages hold different parameters), as (the parts this rank holds, all parts)."""
        held, every = {}, []
        for name in MODULES:
            dims = self.dims[name]
            keys = [f"{name}.stage{k}" for k in range(dims.pp)] if dims.pp_enabled else [name]
            every += keys
            if name in self.trainable:
                held[keys[dims.stage_of(self.rank)] if dims.pp_enabled else name] = self.trainable[name]
        return held, every

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy summed over this rank's positions, divided by the step's target-token count:
        the sum over micro-batches, replicas and sequence slices is transformers' mean loss over the global batch."""
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
        return ce / num_tokens

    # ---- the step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns this rank's measurements."""
        self.timings: dict[str, float] = defaultdict(float)
        self.handoff.comm_seconds = 0.0
        data_s = self._prepare_inputs()
        start = time.perf_counter()
        for optimizer, _ in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        num_tokens = self._count_target_tokens() if "llm" in self.modules else None
        if self.dims["llm"].pp_enabled:
            loss = self._pipelined_step(num_tokens)
        elif self.plan.placement == "colocated":
            loss = self._colocated_step(num_tokens)
        else:
            loss = self._disjoint_step(num_tokens)
        loss = self._reduce_loss(loss)
        lr = next(iter(self.optimizers.values()))[1].get_last_lr()[0] if self.optimizers else None
        pipeline = {}
        if self.schedule is not None:  # this rank's stage: its compute, and the rest of the schedule's time idle
            idle = self.timings["llm_pipeline_s"] - self.timings["pp_compute_s"]
            pipeline = {"pp_stage": self.dims["llm"].stage_of(self.rank), "pp_idle_s": max(idle, 0.0)}
        norm = self.optimizer_step()
        self.step += 1
        self.samples_seen += self.positions_per_step
        _sync(self.device)
        return {
            "rank": self.rank, "modules": sorted(self.modules), "loss": loss, "grad_norm": norm,
            "lr": lr,
            "step_time_s": time.perf_counter() - start, "llm_tokens": self._step_tokens, "data_s": data_s,
            "handoff_comm_s": self.handoff.comm_seconds,
            "peak_memory_bytes": _peak_memory(self.device), **self.timings, **pipeline,
            **({"data_skipped": dict(self.source.skipped)} if getattr(self.source, "skipped", None) else {}),
        }

    def _colocated_step(self, num_tokens: torch.Tensor) -> float:
        loss = 0.0
        for micro in range(self.num_micro_batches):
            rows = self.vision_forward(micro)
            embeds = self.handoff.wait(self.hand_off(rows, micro))
            grad, share = self.llm_forward_backward(micro, embeds, num_tokens)
            loss += share
            self.vision_backward(rows, self.handoff.wait(self.hand_back(grad, micro)), micro)
        return loss

    def _pipelined_step(self, num_tokens: torch.Tensor | None) -> float:
        """With the LLM pipelined, in either placement: every micro-batch's vision forward and hand-off to the first
        stage, the LLM's pipeline schedule over all of them, then every hand-back and vision backward (each rank
        does the parts of the modules it holds)."""
        micros = range(self.num_micro_batches)
        rows = [self.vision_forward(micro) if "vision" in self.modules else None for micro in micros]
        embeds = [self.handoff.wait(self.hand_off(rows[micro], micro)) for micro in micros]
        grads, loss = [None] * len(micros), 0.0
        if "llm" in self.modules:
            grads, loss = self.llm_pipeline(embeds, num_tokens)
        for micro in micros:
            grad = self.handoff.wait(self.hand_back(grads[micro], micro))
            if "vision" in self.modules:
                self.vision_backward(rows[micro], grad, micro)
        return loss

    def llm_pipeline(self, embeds: list[torch.Tensor | None], num_tokens: torch.Tensor
                     ) -> tuple[list[torch.Tensor | None], float]:
        """Every micro-batch through the LLM's pipeline schedule (runtime.pipeline). Returns, on the first stage,
        the gradient of each micro-batch's image tokens (None elsewhere) and this rank's loss share (0 off the
        last stage)."""
        dims = self.dims["llm"]
        shards = [self._llm_shard(micro) for micro in range(self.num_micro_batches)]
        position_ids = torch.cat([s.position_ids_3Bs for s in shards], dim=1)
        chunks = self.modules["llm"].ids
        first, last = 0 in chunks, len(dims.pp_layers) - 1 in chunks
        for chunk in self.modules["llm"].chunks:  # every micro-batch has the same slices (SP: fixed-shape plans only)
            chunk.ulysses_group = shards[0].ulysses
        inputs, rows = (), None
        if first:  # a packed row's image tokens padded to the stage's room for them (zero rows no token takes)
            per_micro = [F.pad(e, (0, 0, 0, self.pipeline_shapes.image_tokens - len(e)))[None] if self.packed
                         else e.reshape(dims.micro_batch, -1, e.shape[-1]) for e in embeds]
            rows = torch.cat(per_micro).requires_grad_(not self.dims["vision"].frozen)
            inputs = (torch.cat([s.input_ids_Bs for s in shards]), rows)
        losses: list[torch.Tensor] = []
        target = torch.cat([s.targets_Bs for s in shards]) if last else None
        self._step_num_tokens = num_tokens
        with loss_parallel() if dims.tp_enabled else contextlib.nullcontext():
            with self._timed("llm_pipeline_s"):
                self.schedule.step(*inputs, target=target, losses=losses if last else None, return_outputs=False,
                                   position_ids=position_ids)
        loss = sum((float((l.full_tensor() if isinstance(l, DTensor) else l).detach()) for l in losses), 0.0)
        if rows is None or rows.grad is None:
            return [None] * self.num_micro_batches, loss
        grads = rows.grad.chunk(self.num_micro_batches)
        return [g.reshape(-1, g.shape[-1])[:len(e)] for g, e in zip(grads, embeds)], loss

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch on the last stage (``_loss`` over the step's target tokens)."""
        return self._loss(logits, targets, self._step_num_tokens)

    def _disjoint_step(self, num_tokens: torch.Tensor | None) -> float:
        """1F1B across the two groups: the vision group runs up to MAX_VISION_IN_FLIGHT forwards ahead, then
        alternates backward / forward; the LLM group alternates receive / forward-backward / send."""
        loss, posted = 0.0, []
        if "vision" in self.modules:
            in_flight = {}
            for micro in range(min(MAX_VISION_IN_FLIGHT, self.num_micro_batches)):
                in_flight[micro] = self._forward_and_send(micro)
            for micro in range(self.num_micro_batches):
                rows, sent = in_flight.pop(micro)
                self.vision_backward(rows, self.handoff.wait(self.hand_back(None, micro)), micro)
                posted.append(sent)
                if micro + MAX_VISION_IN_FLIGHT < self.num_micro_batches:
                    in_flight[micro + MAX_VISION_IN_FLIGHT] = self._forward_and_send(micro + MAX_VISION_IN_FLIGHT)
        if "llm" in self.modules:
            for micro in range(self.num_micro_batches):
                embeds = self.handoff.wait(self.hand_off(None, micro))
                grad, share = self.llm_forward_backward(micro, embeds, num_tokens)
                loss += share
                posted.append(self.hand_back(grad, micro))
        for sent in posted:
            self.handoff.wait(sent)
        return loss

    def _forward_and_send(self, micro: int) -> tuple[torch.Tensor, Posted]:
        rows = self.vision_forward(micro)
        return rows, self.hand_off(rows, micro)

    def _reduce_loss(self, loss: float) -> float | None:
        """The step's mean loss over the global batch (on LLM ranks; None elsewhere)."""
        dims = self.dims["llm"]
        if "llm" not in self.modules:
            return None
        value = torch.tensor(loss, device=self.device)
        if dims.pp_enabled:  # the last stage computed it
            dist.all_reduce(value, group=dims.mesh["pp"].get_group())
        if dims.batch_enabled:
            dist.all_reduce(value, group=dims.mesh[BATCH_AXIS].get_group())
        return float(value)

    # ---- inspection (tests, checkpoints) ---------------------------------------------------------------
    def iter_full_tensors(self, module_name: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, unsharded tensor in HF layout on CPU) of each parameter (``kind="param"``) or gradient
        (``"grad"``) of a module this rank holds, one at a time: collective over the module's ranks, and no rank
        holds more than one unsharded tensor at once."""
        module, dims = self.modules[module_name], self.dims[module_name]
        for local_name, param in module.named_parameters():
            tensor = param if kind == "param" else param.grad
            if tensor is None:
                continue
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            if self._row_order(module_name, local_name, tensor.shape[0]) is not None:
                tensor = qkv_from_tp_layout(tensor, dims.tp)
            yield module.hf_name(local_name), tensor.detach().cpu()

    def full_tensors(self, kind: str) -> dict[str, torch.Tensor]:
        """Unsharded parameters (``kind="param"``) or gradients (``"grad"``) under their HF names, on CPU, fp32.

        Every rank of a module must call this (gathering is collective); the module's first rank (of each pipeline
        stage) returns them.
        """
        out = {}
        for name in self.modules:
            dims = self.dims[name]
            first = dims.ranks[dims.stage_of(self.rank) * dims.stage_devices]
            for hf_name, tensor in self.iter_full_tensors(name, kind):
                if self.rank == first:
                    out[hf_name] = tensor.float().clone()
        return out

    def tensor_parts(self) -> dict[str, tuple[tuple[int, ...], list[tuple[str, torch.Size, torch.dtype]]]]:
        """Every parameter of every module, held here or not (tied weights once), as (HF name, full shape, dtype)
        in ``iter_full_tensors`` order, by the ranks that hold it: each module's, or each pipeline stage's of a
        pipelined one (``part -> (ranks, parameters)``). What a saved checkpoint holds."""
        vision, llm, _ = split_model(self._init.meta)
        parts = {}
        for name, module in (("vision", vision), ("llm", llm)):
            dims = self.dims[name]
            entries = [(module.hf_name(n), p.shape, self.precision[name].param_dtype)
                       for n, p in module.named_parameters()]
            if not dims.pp_enabled:
                parts[name] = (dims.ranks, entries)
                continue
            for stage in range(dims.pp):
                mine = [e for e in entries if stage_of_parameter(e[0], dims) == stage]
                parts[f"{name}.stage{stage}"] = (dims.stage_view(stage).ranks, mine)
        return parts

    def hf_config(self) -> PretrainedConfig:
        """The model's transformers config, as a saved checkpoint's ``config.json`` has it."""
        config = hf_config_from_dict(self.plan.model.hf_config)
        config._attn_implementation = None
        return config

    def close(self) -> None:
        """Stop the prefetch worker."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    def save_hf_folder(self, path: str, *, dtype: torch.dtype | None = None) -> None:
        """Write the weights as a Hugging Face folder from the shards (runtime.checkpoint.save_hf_folder);
        every rank calls it."""
        save_hf_folder(self, path, dtype=dtype)

    @contextlib.contextmanager
    def _timed(self, key: str):
        start = time.perf_counter()
        yield
        _sync(self.device)
        self.timings[key] += time.perf_counter() - start


def check_vision_windows(source: PackedConversations, vision: ParallelDims, config: Any) -> None:
    """Every vision micro-batch of the data splits over the vision SP ranks on window boundaries: its fewest
    attention windows (the smallest pack's, times the packs per micro-batch) are at least ``sp``.

    Raises:
        ValueError: in one line, with the smallest pack and what would make it fit.
    """
    if vision.sp == 1:
        return
    windows = {}
    for pack in source.packs:
        grid = torch.tensor([g for i in pack for g in source.samples[i].grids])
        windows[len(window_layout(grid, config)[1]) - 1] = pack
    fewest = min(windows)
    if fewest * vision.micro_batch < vision.sp:
        rows = [source.samples[i].row for i in windows[fewest]]
        raise ValueError(f"vision sp={vision.sp} needs at least {vision.sp} attention windows per micro-batch, and a "
                         f"pack of rows {rows} has {fewest} ({vision.micro_batch} pack(s) per micro-batch): plan with "
                         "a lower vision sp, more packs per vision micro-batch, or a larger --min-pixels")


def slot_samples(micro: int, dims: ParallelDims, replica: int, *, position: int,
                 slots: list[list[int]] | None) -> list[int]:
    """Indexes of the samples of micro-batch ``micro`` for DP replica ``replica`` of a module, in the step at data
    position ``position``: its slice of the global micro-batch (consecutive samples of a fixed-shape plan; for a
    dataset plan, its packs among the step's ``slots``, flattened)."""
    first = micro * dims.dp * dims.micro_batch + replica * dims.micro_batch
    if slots is None:
        return list(range(position + first, position + first + dims.micro_batch))
    return [i for pack in slots[first:first + dims.micro_batch] for i in pack]


def _to_device(shard, device: torch.device):
    if device.type == "cpu":
        return shard
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in shard.__dict__.items()}
    return type(shard)(**fields)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_memory(device: torch.device) -> int:
    """Peak bytes: allocated device memory on GPU, the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

"""The step loop on one rank: data -> encoder forward -> hand-off -> LLM forward/backward -> hand-back ->
encoder backward -> optimizer. The encoder is the vision tower or the audio encoder (its family's ``encoder``, runtime.models.families).
Colocated and disjoint placements differ only in ``train_step``'s one branch.

The parts live in their own modules: this rank's shards of the model (built on ``meta``, sharded there, then
materialised and filled: runtime.training.rank_model), a step's inputs (runtime.training.step_inputs) and the model read back whole
(runtime.training.full_model); the Trainer runs the step.

Numerics (runtime.parallel.precision): on CPU everything runs in fp32 (for exact parity with the single-process
model). On GPU ``bf16_mixed`` keeps fp32 weights/grads/Adam and computes in bf16 (FSDP2's MixedPrecisionPolicy
where FSDP wraps the module, else autocast); ``bf16_pure`` = bf16 everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import resource
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import PretrainedConfig

from planner.contract.schema import Plan
from runtime.checkpoints.dcp_checkpoint import load_checkpoint
from runtime.checkpoints.hf_folder import TensorSource, save_hf_folder
from runtime.data.samples import IGNORE_INDEX
from runtime.models.families import family_of
from runtime.models.handoff import Handoff, Posted
from runtime.models.loss import cross_entropy_sum
from runtime.models.model import hf_config_from_dict
from runtime.models.parallelize import uses_fsdp
from runtime.models.pipeline import build_schedule
from runtime.observability.memory import CappedTensorMemory, StepOutOfMemory, requested_bytes
from runtime.observability.trace import HANDOFF_WAIT, STEP, profiled
from runtime.parallel.experts import RouterStats, busiest_rank_load, moe_layers
from runtime.parallel.fsdp import all_reduce_gradients, set_gradient_sync
from runtime.parallel.parallel_dims import BATCH_AXIS, plan_dims
from runtime.parallel.precision import module_precision
from runtime.run.preflight import module_names
from runtime.training import full_model
from runtime.training.optim import clip_grad_norm
from runtime.training.rank_model import RankModel
from runtime.training.step_inputs import StepInputs, to_device

MAX_ENCODER_IN_FLIGHT = 2
"""Disjoint placement: micro-batches the encoder group runs ahead of its backward (activation memory bound)."""


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """What the command line adds to a plan."""

    seed: int = 0
    """Seed of the random init and of the synthetic data."""
    data: str | None = None
    """Image-caption folder or JSONL, or a conversation file; synthetic data when None."""
    tokenizer: str | None = None
    """Model folder whose tokenizer and chat template conversation data goes through."""
    data_root_only: bool = False
    """Read only files inside ``data``'s folder (resolved, symlinks followed): a conversation row naming one outside
    is skipped and counted, a caption line refused (``--data-root-only``)."""
    checkpoint: str | None = None
    """Hugging Face folder (save_pretrained or Hub download) to start from; random init when None."""
    prefetch: bool = False
    """Build the next step's samples in a worker process during each step (the command line's default)."""
    resume: str | None = None
    """Complete training checkpoint (runtime.checkpoints.dcp_checkpoint) to continue from: weights, optimizer, LR schedule,
    counters and RNG states; written under this plan or any other of the same model."""
    trace: str | None = None
    """Folder the measured steps' Chrome traces go to (runtime.observability.trace; ``--trace DIR``)."""
    trace_profiler: bool = False
    """With ``trace``: each rank also writes torch.profiler's trace of every step there (``--trace-profiler``)."""
    balance: str = "modules"
    """How a dataset plan's steps are split over the replicas (``--balance``; ``preflight.BALANCE_POLICIES``)."""
    memory_cap_bytes: int | None = None
    """CPU plans: the tensor bytes a rank may hold; an operation of a step that takes its tensors (as torch's
    ``MemTracker`` counts them) past it fails as out of memory, as a device of that size would
    (``--memory-cap-gib``; runtime.observability.memory)."""


def freeze_startup_heap() -> None:
    """Take every object alive now, the imported torch, transformers and Ray (~0.4 M objects), out of the cyclic
    garbage collector's reach (``gc.freeze``): called once a training process has started, before its first Trainer.
    Each full collection would otherwise traverse them all (0.2-0.4 s here), inside steps and at each job's
    clean-up (``close``); they live as long as the process. torchtitan keeps the collector out of its steps for
    the same pauses (``torchtitan.tools.utils.GarbageCollection``)."""
    gc.collect()
    gc.freeze()


def numerics_device_type(plan: Plan) -> str:
    """The device type whose numeric recipe (runtime.parallel.precision) the plan runs: the plan's device, whatever
    the tensors' (the dry-run runs a GPU plan's recipe on fake CPU tensors)."""
    return "cpu" if plan.cluster.device.name.lower() == "cpu" else "cuda"


def device_for(plan: Plan) -> torch.device:
    """CPU for a plan made for ``--gpu cpu``, else this worker's GPU."""
    return torch.device("cpu") if numerics_device_type(plan) == "cpu" else torch.device("cuda", 0)


class Trainer:
    """One rank's training: its part of the model (``model``: runtime.training.rank_model), its steps' inputs (``inputs``:
    runtime.training.step_inputs), the hand-off between the modules, and the step itself. Its progress (``step``,
    ``samples_seen``) is checkpointable state (``state_dict`` / ``load_state_dict``, torch.distributed.checkpoint's
    ``Stateful``)."""

    inputs_type: type[StepInputs] = StepInputs
    """What builds the steps' inputs (the dry-run's stand in planned shapes)."""

    def __init__(self, plan: Plan, *, rank: int, options: RunOptions, weights: TensorSource | None = None):
        self.plan, self.rank, self.options = plan, rank, options
        self.capped: CappedTensorMemory | None = None
        """The running step's tracker under a memory cap (``_tensor_memory``)."""
        self.device = device_for(plan)
        self.module_names = module_names(plan)
        self.encoder = self.module_names[0]
        """The encoder module's name (``vision`` or ``audio``)."""
        self.dims = {name: plan_dims(plan, name) for name in self.module_names}
        for dims in self.dims.values():
            dims.build_mesh(self.device.type)
        self.numerics = numerics_device_type(plan)
        precision = {name: module_precision(plan.training.precision, self.numerics, fsdp=uses_fsdp(dims))
                     for name, dims in self.dims.items()}
        config = hf_config_from_dict(plan.model.hf_config)
        self.model = RankModel(plan, rank=rank, dims=self.dims, precision=precision, device=self.device,
                               seed=options.seed, checkpoint=options.checkpoint, resume=options.resume is not None,
                               weights=weights)
        self.modules, self.optimizers = self.model.modules, self.model.optimizers
        self.inputs = self.inputs_type(plan, rank=rank, dims=self.dims, held=tuple(self.modules), config=config,
                                 options=options, device=self.device, rope_index=self.model.rope_index)
        self.family = family_of(config)
        self.handoff = Handoff(llm=self.inputs.receiving_llm, encoder_trainable=not self.dims[self.encoder].frozen,
                               width=config.get_text_config().hidden_size * self.family.handoff_tensors(config),
                               rank=self.rank,
                               dtype=self._handoff_dtype(), device=self.device)
        self.schedule = None
        if self.dims["llm"].pp_enabled and "llm" in self.modules:
            self.inputs.pipeline_shapes = self.inputs.micro_batch_shapes(
                config, compute_dtype=precision["llm"].compute_dtype, handoff_dtype=self._handoff_dtype())
            self.schedule = build_schedule(self.modules["llm"], self.dims["llm"], self.device,
                                           self.inputs.pipeline_shapes, self._pipeline_loss,
                                           functools.partial(self._timed, "pp_compute_s"))
        text = config.get_text_config()
        self.loss_chunk_tokens = plan.module("llm").loss_chunk_tokens
        """Tokens per chunk of the LLM's loss (runtime.models.loss), 0 for the whole slice at once."""
        self.balancing_coef = text.router_aux_loss_coef if getattr(text, "output_router_logits", False) else 0.0
        """Weight of transformers' load-balancing loss in the LLM's loss (0: the config leaves it out)."""
        experts = self.dims["llm"].experts
        self.routers = RouterStats(self.modules["llm"], experts, probabilities=bool(self.balancing_coef)) if (
            "llm" in self.modules and experts) else None
        """The MoE routers' choices (runtime.parallel.experts); None for a dense LLM or off its ranks."""
        self.step = 0
        self.samples_seen = 0
        """Global index of the next sample: the data position, independent of the plan."""
        if options.resume is not None:
            load_checkpoint(self, options.resume)

    # ---- checkpointable state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The run's progress: optimizer steps done and the data position (plan-independent)."""
        return {"step": self.step, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.samples_seen = state["step"], state["samples_seen"]

    @property
    def num_micro_batches(self) -> int:
        return self.inputs.num_micro_batches

    @property
    def on_host_data(self):
        """``StepInputs.on_host_data``: what sees each host-memory sample and batch."""
        return self.inputs.on_host_data

    @on_host_data.setter
    def on_host_data(self, hook) -> None:
        self.inputs.on_host_data = hook

    def _handoff_dtype(self) -> torch.dtype:
        return torch.float32 if self.numerics == "cpu" else torch.bfloat16

    # ---- the step's named stages -------------------------------------------------------------------------
    def encoder_forward(self, micro: int) -> torch.Tensor:
        """This rank's hand-off rows of micro-batch ``micro``: its encoder tokens (vision: merged image tokens in
        window order, each followed by its injected features where the family has them; audio: projected audio
        tokens)."""
        dims = self.dims[self.encoder]
        batch = self.inputs.samples(micro, self.encoder)
        sp_group = dims.grid_mesh["sp"].get_group() if dims.sp_enabled else None
        coord = dims.coordinate(self.rank)
        ring = {} if dims.cp == 1 else dict(cp_rank=coord["cp"], ring=dims.ring_group())
        shard = self.family.encoder.shard(batch, self.inputs.config, sp_rank=coord["sp"], sp_group=sp_group,
                                          sp=dims.sp, **ring)
        shard = to_device(shard, self.device)
        with self._timed(f"{self.encoder}_forward_s"), self.model.autocast(self.encoder), \
                torch.set_grad_enabled(not dims.frozen):
            return self.modules[self.encoder](shard)

    def hand_off(self, rows: torch.Tensor | None, micro: int) -> Posted:
        """Post the sends of this rank's encoder piece and, on LLM ranks, the receives of the tokens it places."""
        return self.handoff.activations(rows, micro, self.inputs.routes(micro))

    def llm_forward_backward(
        self, micro: int, embeds: torch.Tensor, num_tokens: torch.Tensor
    ) -> tuple[torch.Tensor | None, float]:
        """LLM forward and backward of this rank's sequence slice on its received image tokens; returns their
        gradient and the loss share."""
        shard = self.inputs.llm_shard(micro)
        llm, dims = self.modules["llm"], self.dims["llm"]
        embeds.requires_grad_(not self.dims[self.encoder].frozen)
        set_gradient_sync(llm, zero=dims.zero, last_micro_batch=micro == self.num_micro_batches - 1)
        balancing = torch.zeros((), device=self.device)
        with loss_parallel() if dims.tp_enabled else contextlib.nullcontext():
            with self._timed("llm_forward_s"), self.model.autocast("llm"), self._routing():
                loss = llm(shard.input_ids_Bs, embeds, shard.position_ids_3Bs, shard.ulysses,
                           targets_BL=shard.targets_Bs, loss_chunk_tokens=self.loss_chunk_tokens) / num_tokens
                if self.balancing_coef:
                    group = dims.mesh[BATCH_AXIS].get_group() if dims.batch_enabled else None
                    targets = (shard.targets_Bs != IGNORE_INDEX).sum()
                    balancing = self.balancing_coef * self.routers.balancing_loss(group, targets, num_tokens)
            with self._timed("llm_backward_s"):
                torch.autograd.backward([loss, balancing] if balancing.requires_grad else [loss])
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return embeds.grad, float(value.detach()) + float(balancing.detach())

    @contextlib.contextmanager
    def _routing(self):
        """Record the MoE routers' choices (runtime.parallel.experts ``RouterStats``) around a forward."""
        if self.routers is None:
            yield
            return
        self.routers.start()
        try:
            yield
        finally:
            self.routers.stop()

    def hand_back(self, grad: torch.Tensor | None, micro: int) -> Posted:
        """Post the encoder tokens' gradients back to the encoder ranks and, on those, the receives of their own."""
        return self.handoff.gradients(grad, micro, self.inputs.routes(micro))

    def encoder_backward(self, rows: torch.Tensor, grad: torch.Tensor | None, micro: int) -> None:
        """Backpropagate this rank's piece gradient through the encoder (nothing when it is frozen)."""
        dims = self.dims[self.encoder]
        if dims.frozen:
            return
        set_gradient_sync(self.modules[self.encoder], zero=dims.zero,
                          last_micro_batch=micro == self.num_micro_batches - 1)
        with self._timed(f"{self.encoder}_backward_s"):
            rows.backward(grad.to(rows.dtype))

    def optimizer_step(self) -> float:
        """Sum ZeRO-0 gradients, clip by the global norm over all modules, step AdamW and the LR schedule."""
        with self._timed("grad_sync_s"):
            for name, module in self.model.trainable.items():
                dims = self.dims[name]
                if dims.zero == 0 and dims.batch_enabled:
                    all_reduce_gradients(module, dims.mesh[BATCH_AXIS].get_group())
                if dims.zero == 0 and dims.experts_split and dims.expert_fsdp_degree > 1:
                    all_reduce_gradients(module, dims.expert_mesh["efsdp"].get_group(), experts=True)
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
        for name in self.module_names:
            dims = self.dims[name]
            keys = [f"{name}.stage{k}" for k in range(dims.pp)] if dims.pp_enabled else [name]
            every += keys
            if name in self.model.trainable:
                held[keys[dims.stage_of(self.rank)] if dims.pp_enabled else name] = self.model.trainable[name]
        return held, every

    @staticmethod
    def _loss(logits: torch.Tensor, targets: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy summed over this rank's positions, divided by the step's target-token count:
        the sum over micro-batches, replicas and sequence slices is transformers' mean loss over the global batch."""
        return cross_entropy_sum(logits, targets) / num_tokens

    # ---- the step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One optimizer step (under torch.profiler if the run asked for its traces); returns this rank's
        measurements, with ``spans``: (timer, start, end) seconds from the step's start (runtime.observability.trace)."""
        try:
            with profiled(self.options.trace if self.options.trace_profiler else None, self.rank, self.step):
                with self._tensor_memory():
                    result = self._train_step()
        except torch.OutOfMemoryError as e:
            raise self._out_of_memory(e) from None
        if self.capped is not None:
            result["peak_tensor_bytes"] = self.capped.peak().get("Total", 0)
        elif self.device.type == "cuda":
            result["peak_tensor_bytes"] = torch.cuda.max_memory_allocated(self.device)
            result["device_memory_bytes"] = torch.cuda.mem_get_info(self.device)[1]
        return result

    @contextlib.contextmanager
    def _tensor_memory(self):
        """The step's tensors counted: under the run's memory cap (a CPU run's ``memory_cap_bytes``: ``capped``, its
        tracker), or on a GPU by its allocator (its peak statistics reset)."""
        self.capped = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.options.memory_cap_bytes is None:
            yield
            return
        self.capped = CappedTensorMemory(self.options.memory_cap_bytes)
        self.capped.track_external(*self.modules.values(), *(o for o, _ in self.optimizers.values()))
        with self.capped:
            yield

    def _out_of_memory(self, error: torch.OutOfMemoryError) -> StepOutOfMemory:
        """The step's out-of-memory error with what it measured: the tensors when the allocation failed (the CUDA
        allocator's, with the failed request; the cap's tracker's on a CPU) and what the device holds."""
        if self.capped is not None:
            held, capacity = self.capped.peak().get("Total", 0), self.options.memory_cap_bytes
        else:
            held = torch.cuda.memory_allocated(self.device) + requested_bytes(str(error))
            capacity = torch.cuda.mem_get_info(self.device)[1]
        return StepOutOfMemory(self.rank, sorted(self.modules), self.step + 1, held, capacity)

    def _train_step(self) -> dict[str, Any]:
        self.timings: dict[str, float] = defaultdict(float)
        self.handoff.comm_seconds, self.handoff.waits = 0.0, []
        data_s = self.inputs.prepare(self.samples_seen)
        start = self._step_start = time.perf_counter()
        self.spans: list[tuple[str, float, float]] = []
        for optimizer, _ in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        num_tokens = self.inputs.count_target_tokens() if "llm" in self.modules else None
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
        experts = self._expert_load()
        self.step += 1
        self.samples_seen += self.inputs.positions_per_step
        _sync(self.device)
        skipped = getattr(self.inputs.source, "skipped", None)
        step_time = time.perf_counter() - start
        spans = self.spans + [(HANDOFF_WAIT, s - start, e - start) for s, e in self.handoff.waits]
        return {
            "rank": self.rank, "modules": sorted(self.modules), "loss": loss, "grad_norm": norm,
            "lr": lr,
            "step_time_s": step_time, "llm_tokens": self.inputs.step_tokens, "data_s": data_s,
            "spans": [(STEP, 0.0, step_time), *spans],
            "handoff_comm_s": self.handoff.comm_seconds,
            "peak_memory_bytes": _peak_memory(self.device), **self.timings, **pipeline, **experts,
            **self.inputs.assigned_work(),
            **({"data_skipped": dict(skipped)} if skipped else {}),
            **self.inputs.prefetch_report(),
        }

    def _expert_load(self) -> dict[str, Any]:
        """The step's routed tokens per expert (summed over the MoE layers and the LLM's ranks) and the busiest EP
        rank's load over the mean (runtime.parallel.experts ``busiest_rank_load``); nothing for a dense LLM."""
        if self.routers is None:
            return {}
        dims = self.dims["llm"]
        groups = [dims.mesh[BATCH_AXIS].get_group()] if dims.batch_enabled else []
        groups += [dims.mesh["pp"].get_group()] if dims.pp_enabled else []
        counts = self.routers.step_counts(moe_layers(self.inputs.config.get_text_config()), groups)
        return {"expert_tokens": [int(c) for c in counts.sum(0).tolist()],
                "moe_load_imbalance": busiest_rank_load(counts.cpu(), dims.ep * dims.tp if dims.experts_split else 1)}

    def _colocated_step(self, num_tokens: torch.Tensor) -> float:
        loss = 0.0
        for micro in range(self.num_micro_batches):
            rows = self.encoder_forward(micro)
            embeds = self.handoff.wait(self.hand_off(rows, micro))
            grad, share = self.llm_forward_backward(micro, embeds, num_tokens)
            loss += share
            self.encoder_backward(rows, self.handoff.wait(self.hand_back(grad, micro)), micro)
        return loss

    def _pipelined_step(self, num_tokens: torch.Tensor | None) -> float:
        """With the LLM pipelined, in either placement: every micro-batch's encoder forward and hand-off to the first
        stage, the LLM's pipeline schedule over all of them, then every hand-back and encoder backward (each rank
        does the parts of the modules it holds)."""
        micros = range(self.num_micro_batches)
        rows = [self.encoder_forward(micro) if self.encoder in self.modules else None for micro in micros]
        embeds = [self.handoff.wait(self.hand_off(rows[micro], micro)) for micro in micros]
        grads, loss = [None] * len(micros), 0.0
        if "llm" in self.modules:
            grads, loss = self.llm_pipeline(embeds, num_tokens)
        for micro in micros:
            grad = self.handoff.wait(self.hand_back(grads[micro], micro))
            if self.encoder in self.modules:
                self.encoder_backward(rows[micro], grad, micro)
        return loss

    def llm_pipeline(self, embeds: list[torch.Tensor | None], num_tokens: torch.Tensor
                     ) -> tuple[list[torch.Tensor | None], float]:
        """Every micro-batch through the LLM's pipeline schedule (runtime.models.pipeline). Returns, on the first stage,
        the gradient of each micro-batch's image tokens (None elsewhere) and this rank's loss share (0 off the
        last stage)."""
        dims = self.dims["llm"]
        shards = [self.inputs.llm_shard(micro) for micro in range(self.num_micro_batches)]
        position_ids = torch.cat([s.position_ids_3Bs for s in shards], dim=1)
        chunks = self.modules["llm"].ids
        first, last = 0 in chunks, len(dims.pp_layers) - 1 in chunks
        for chunk in self.modules["llm"].chunks:  # every micro-batch has the same slices (SP: fixed-shape plans only)
            chunk.ulysses_group = shards[0].ulysses
        inputs, rows = (), None
        if first:  # a packed row's image tokens padded to the stage's room for them (zero rows no token takes)
            room = self.inputs.pipeline_shapes.image_tokens
            per_micro = [F.pad(e, (0, 0, 0, room - len(e)))[None] if self.inputs.packed
                         else e.reshape(dims.micro_batch, -1, e.shape[-1]) for e in embeds]
            rows = torch.cat(per_micro).requires_grad_(not self.dims[self.encoder].frozen)
            inputs = (torch.cat([s.input_ids_Bs for s in shards]), rows)
        losses: list[torch.Tensor] = []
        target = torch.cat([s.targets_Bs for s in shards]) if last else None
        self._step_num_tokens = num_tokens
        with loss_parallel() if dims.tp_enabled else contextlib.nullcontext():
            with self._timed("llm_pipeline_s"), self._routing():
                self.schedule.step(*inputs, target=target, losses=losses if last else None, return_outputs=False,
                                   position_ids=position_ids)
        loss = sum((float((l.full_tensor() if isinstance(l, DTensor) else l).detach()) for l in losses), 0.0)
        if rows is None or rows.grad is None:
            return [None] * self.num_micro_batches, loss
        grads = rows.grad.chunk(self.num_micro_batches)
        return [g.reshape(-1, g.shape[-1])[:len(e)] for g, e in zip(grads, embeds)], loss

    def _pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch on the last stage: its cross-entropy over the step's target-token
        count (the sum over micro-batches, replicas and sequence slices is transformers' mean over the batch)."""
        return cross_entropy_sum(logits, targets) / self._step_num_tokens

    def _disjoint_step(self, num_tokens: torch.Tensor | None) -> float:
        """1F1B across the two groups: the encoder group runs up to MAX_ENCODER_IN_FLIGHT forwards ahead, then
        alternates backward / forward; the LLM group alternates receive / forward-backward / send."""
        loss, posted = 0.0, []
        if self.encoder in self.modules:
            in_flight = {}
            for micro in range(min(MAX_ENCODER_IN_FLIGHT, self.num_micro_batches)):
                in_flight[micro] = self._forward_and_send(micro)
            for micro in range(self.num_micro_batches):
                rows, sent = in_flight.pop(micro)
                self.encoder_backward(rows, self.handoff.wait(self.hand_back(None, micro)), micro)
                posted.append(sent)
                if micro + MAX_ENCODER_IN_FLIGHT < self.num_micro_batches:
                    in_flight[micro + MAX_ENCODER_IN_FLIGHT] = self._forward_and_send(micro + MAX_ENCODER_IN_FLIGHT)
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
        rows = self.encoder_forward(micro)
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

    # ---- the model read back whole (runtime.training.full_model; tests, checkpoints, export) ---------------------
    def iter_full_tensors(self, module_name: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
        return full_model.iter_full_tensors(self.model, module_name, kind)

    def full_tensors(self, kind: str) -> dict[str, torch.Tensor]:
        return full_model.full_tensors(self.model, kind)

    def tensor_parts(self) -> full_model.TensorParts:
        return full_model.tensor_parts(self.model)

    def hf_config(self) -> PretrainedConfig:
        return full_model.saved_hf_config(self.plan.model.hf_config)

    def save_hf_folder(self, path: str, *, dtype: torch.dtype | None = None) -> None:
        """Write the weights as a Hugging Face folder from the shards (runtime.checkpoints.hf_folder.save_hf_folder);
        every rank calls it."""
        save_hf_folder(self, path, dtype=dtype)

    def close(self) -> None:
        """Stop the prefetch worker."""
        self.inputs.close()

    @contextlib.contextmanager
    def _timed(self, key: str, span: str | None = None):
        """Add the block's seconds to the step's ``key`` timer and record its span (named ``span`` or ``key``)."""
        start = time.perf_counter()
        yield
        _sync(self.device)
        end = time.perf_counter()
        self.timings[key] += end - start
        self.spans.append((span or key, start - self._step_start, end - self._step_start))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_memory(device: torch.device) -> int:
    """Peak bytes: allocated device memory on GPU, the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

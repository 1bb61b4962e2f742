"""A step's inputs on one rank: the samples of the modules it holds, their micro-batches, the LLM's token shards
and the hand-off routes, built before the step's clock starts (from the prefetch worker where there is one).

Fixed-shape plans share one sample layout (``layout_from_plan``); a dataset plan's micro-batch is one packed row of
native-resolution samples (runtime.data.packed_data).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from planner.contract.schema import Plan
from planner.cost.balance import plan_sample_work
from runtime.data.conversations import ConversationData
from runtime.data.packed_data import IndexedSample, PackedConversations
from runtime.data.prefetch import Prefetcher
from runtime.data.samples import IGNORE_INDEX, CaptionData, Sample, Source, collate, pack_rows
from runtime.models.families import family_of
from runtime.models.handoff import Routes
from runtime.models.llm import LLMShard, image_slots_per_rank, packed_position_ids, pad_packed_row, shard_llm_batch
from runtime.models.pipeline import MicroBatchShapes
from runtime.models.vision import filler_grid
from runtime.parallel.windows import merged_positions_per_rank, window_layout
from runtime.parallel.parallel_dims import BATCH_AXIS, ParallelDims
from runtime.parallel.ulysses import split_sequence
from runtime.run.preflight import DATA_ENCODERS, is_conversation_file, module_names, no_data_reader


def data_source(plan: Plan, options: Any, config: PretrainedConfig) -> Source | PackedConversations:
    """A dataset plan's packed conversations; else, in the plan's fixed layout, conversations (through
    ``options.tokenizer``), image-caption pairs, or synthetic samples (``options``: runtime.training.trainer.RunOptions)."""
    encoder = family_of(config).encoder
    if plan.workload.dataset is not None:
        return PackedConversations(options.data, options.tokenizer, config=config, dataset=plan.workload.dataset,
                                   seed=options.seed, work=plan_sample_work(plan), balance=options.balance,
                                   normalization=encoder.image_normalization, data_root_only=options.data_root_only)
    layout = encoder.layout_from_plan(plan.workload, config)
    if not options.data:
        return encoder.synthetic(layout, options.seed)
    if encoder.name not in DATA_ENCODERS:
        raise ValueError(no_data_reader(encoder.name, options.data))
    if layout.videos:
        raise ValueError(f"the plan's samples hold video clips of one fixed shape: a fixed-shape video plan trains on "
                         f"synthetic clips; plan {options.data} with --dataset to train on its video rows")
    if is_conversation_file(Path(options.data)):
        if not options.tokenizer:
            raise ValueError(f"{options.data} holds conversations: give --tokenizer DIR, the model folder whose "
                             "tokenizer and chat template they go through")
        return ConversationData(options.data, layout, options.tokenizer, data_root_only=options.data_root_only)
    return CaptionData(options.data, layout, data_root_only=options.data_root_only)


class StepInputs:
    """What ``prepare`` builds for each step of the modules ``held`` here, and the layout facts the trainer's
    hand-off and pipeline schedule are built from."""

    def __init__(self, plan: Plan, *, rank: int, dims: dict[str, ParallelDims], held: tuple[str, ...],
                 config: PretrainedConfig, options: Any, device: torch.device, rope_index: Any):
        self.rank, self.dims, self.held, self.device, self.rope_index = rank, dims, held, device, rope_index
        self.config = config
        self.encoder = module_names(plan)[0]
        self.packed = plan.workload.dataset is not None
        """A dataset plan: packed micro-batches of native-resolution samples (runtime.data.packed_data)."""
        self.layout = None if self.packed else family_of(config).encoder.layout_from_plan(plan.workload, config)
        self.source = data_source(plan, options, config)
        self.prefetcher = Prefetcher(self.source) if options.prefetch else None
        self.pipeline_shapes: MicroBatchShapes | None = None
        """A pipelined LLM's micro-batch at this rank's chunk boundaries (``micro_batch_shapes``), once set."""
        self._step_slots: list[list[int]] | None = None
        self._vision_micro: list[VisionMicroBatch] = []
        """A dataset plan's prepared step: each micro-batch's images and which of them each vision replica runs."""
        self._fixed_routes = None if self.packed else self._layout_routes()

    @property
    def num_micro_batches(self) -> int:
        return self.dims["llm"].grad_accum

    @property
    def positions_per_step(self) -> int:
        """How far a step moves the data position (samples; a dataset plan's packs)."""
        llm = self.dims["llm"]
        return llm.grad_accum * llm.dp * llm.micro_batch

    @property
    def receiving_llm(self) -> ParallelDims:
        """The LLM ranks the hand-off feeds: all of them, or a pipeline's first stage."""
        llm = self.dims["llm"]
        return llm.stage_view(0) if llm.pp_enabled else llm

    @staticmethod
    def on_host_data(tensors) -> None:
        """Called with each host-memory sample and batch; a memory measurement on the CPU sets it to
        ``runtime.observability.memory.TensorMemory.forget`` (host memory is not the device's, though on the CPU it is one)."""

    def prefetch_report(self) -> dict[str, Any]:
        """When this rank's prefetch worker stalled and was killed (runtime.data.prefetch): how many did, and where
        the last one was stuck; else nothing."""
        if self.prefetcher is None or not self.prefetcher.stalls:
            return {}
        return {"prefetch_stalls": self.prefetcher.stalls, "prefetch_stalled_at": self.prefetcher.stalled_at}

    # ---- the step's inputs ----------------------------------------------------------------------------
    def prepare(self, position: int) -> float:
        """This rank's samples of the step at data position ``position`` (from the prefetch worker, which built
        them during the previous step, else built here), its micro-batches and the LLM's token shards; then the
        worker starts on the next step. Returns the seconds it took (reported as ``data_s``)."""
        start = time.perf_counter()
        self.position = position
        self.batches: dict[tuple[int, ...], Sample] = {}
        self._llm_shards: dict[int, LLMShard] = {}
        self._step_slots = self._slots_at(position)
        if self.packed:
            self._vision_micro = self._vision_assignment(self._step_slots)
            self._step_routes = [self._packed_routes(micro) for micro in range(self.num_micro_batches)]
            self.step_tokens = sum(self.source.pack_tokens(pack) for pack in self._step_slots)
        else:
            self.step_tokens = self.positions_per_step * self.layout.seq_len
        indexes = self._indexes_at(position, self._step_slots, self._vision_micro)
        if self.prefetcher is None:
            self._step_samples = {}
            for i in indexes:  # each sample declared host data as it is built, not once the step's all exist
                self._step_samples[i] = sample = self.source.sample(i)
                self.on_host_data(sample.values())
        else:
            self._step_samples = self.prefetcher.take(position, indexes)
            following = position + self.positions_per_step
            self.prefetcher.submit(following, self._indexes_at(following, self._slots_at(following)))
            for sample in self._step_samples.values():
                self.on_host_data(sample.values())
        for micro in range(self.num_micro_batches):
            for name in self.held:
                self.samples(micro, name)
            if "llm" in self.held:
                self.llm_shard(micro)
        return time.perf_counter() - start

    def samples(self, micro: int, name: str) -> Sample:
        """This rank's samples of micro-batch ``micro`` for module ``name`` (its DP replica's slice), in host memory
        (pinned on a GPU): a stage moves only its own shard of a micro-batch to the device, when it runs, so the
        step's pixels are never all on the device (32 micro-batches of 16,384-patch fp32 images are 2.3 GiB). Modules
        that hold the same samples share them. A dataset plan's micro-batch is one packed row (``pack_rows``), its
        vision replica's the images and clips the step's assignment gave it (``vision_items_batch``)."""
        dims = self.dims[name]
        if self.packed and name == self.encoder:
            return self._vision_batch(micro)
        key = tuple(self._slot_samples(micro, dims, dims.coordinate(self.rank)["dp"]))
        if key not in self.batches:
            samples = [self._step_samples[i] for i in key]
            batch = pack_rows(samples) if self.packed else collate(samples)
            pin = self.device.type == "cuda"
            self.batches[key] = {k: v.pin_memory() if pin else v for k, v in batch.items()}
            self.on_host_data(self.batches[key].values())
        return self.batches[key]

    def _vision_batch(self, micro: int) -> Sample:
        """This rank's vision replica's images and clips of packed micro-batch ``micro`` (a filler with them where
        they have too few windows, ``filler_grid``), in host memory."""
        vision = self.dims[self.encoder]
        micro_batch = self._vision_micro[micro]
        mine = micro_batch.replica_items(vision.coordinate(self.rank)["dp"])
        key = ("vision", *mine)
        if key not in self.batches:
            batch = vision_items_batch([self._step_samples[i] for i, _ in mine], [k for _, k in mine],
                                       self.config.vision_config, vision.sequence_ranks)
            pin = self.device.type == "cuda"
            self.batches[key] = {k: v.pin_memory() if pin else v for k, v in batch.items()}
            self.on_host_data(self.batches[key].values())
        return self.batches[key]

    def assigned_work(self) -> dict[str, float]:
        """A dataset plan's prepared step: the work (``planner.cost.balance``) of this rank's replica of each module it
        holds, ``<module>_work_s``; nothing for a fixed-shape plan."""
        if not self.packed:
            return {}
        work, index = self.source.work, self.source.samples
        out = {}
        if self.encoder in self.held:
            replica = self.dims[self.encoder].coordinate(self.rank)["dp"]
            out[f"{self.encoder}_work_s"] = sum(work.vision(index[i].grids[k]) for micro in self._vision_micro
                                                for i, k in micro.replica_items(replica))
        if "llm" in self.held:
            llm = self.dims["llm"]
            replica = llm.coordinate(self.rank)["dp"]
            first = [m * llm.dp * llm.micro_batch + replica * llm.micro_batch for m in range(llm.grad_accum)]
            out["llm_work_s"] = sum(self.source.pack_work(self._step_slots[f + i]) for f in first
                                    for i in range(llm.micro_batch))
        return out

    def llm_shard(self, micro: int) -> LLMShard:
        """This rank's slice of micro-batch ``micro`` for the LLM (the whole sequences without SP)."""
        if micro not in self._llm_shards:
            dims, batch = self.dims["llm"], self.samples(micro, "llm")
            ids, labels, segments = batch["input_ids"], batch["labels"], None
            if self.packed:
                position_ids = packed_position_ids(batch, self.rope_index)
                segments = tuple(batch["sample_lens"].tolist())
                if self.pipeline_shapes is not None:
                    ids, position_ids, labels = pad_packed_row(ids, position_ids, labels, self.pipeline_shapes.seq_len)
            else:
                position_ids, _ = self.rope_index(ids, mm_token_type_ids=batch.get("mm_token_type_ids"),
                                                  image_grid_thw=batch.get("image_grid_thw"),
                                                  video_grid_thw=batch.get("video_grid_thw"))
            sp_group = dims.grid_mesh["sp"].get_group() if dims.sp_enabled else None
            coord = dims.coordinate(self.rank)
            self._llm_shards[micro] = to_device(shard_llm_batch(
                ids, position_ids, labels, sp_rank=coord["sp"], sp_group=sp_group, sp=dims.sp, segment_lens=segments,
                ring=dims.ring_group(), cp_rank=coord["cp"],
            ), self.device)
        return self._llm_shards[micro]

    def count_target_tokens(self) -> torch.Tensor:
        """Tokens the loss averages over in this step, across all LLM replicas and sequence slices."""
        count = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(self.num_micro_batches):
            count += (self.llm_shard(micro).targets_Bs != IGNORE_INDEX).sum()
        dims = self.dims["llm"]
        if dims.batch_enabled:
            dist.all_reduce(count, group=dims.mesh[BATCH_AXIS].get_group())
        return count

    def routes(self, micro: int) -> Routes:
        """The hand-off routes of micro-batch ``micro`` of the prepared step."""
        return self._fixed_routes if self._fixed_routes is not None else self._step_routes[micro]

    def micro_batch_shapes(self, config: PretrainedConfig, *, compute_dtype: torch.dtype,
                           handoff_dtype: torch.dtype) -> MicroBatchShapes:
        """What one micro-batch of the pipelined LLM looks like at this rank's chunk boundaries: a fixed-shape
        plan's samples (under SP, the rank's slice of every sequence), or a dataset plan's packed row padded to the
        micro-batch's budget, with room for the most image tokens its packs can hold (``pad_packed_row``)."""
        text, dims = config.get_text_config(), self.dims["llm"]
        if self.packed:
            samples, seq_len = 1, dims.micro_batch * self.source.budget
            image_tokens = self.source.most_image_tokens(dims.micro_batch, step_packs=self.positions_per_step)
        else:
            template = self.layout.template_ids()
            bounds = split_sequence(len(template), dims.sp)
            j = dims.coordinate(self.rank)["sp"]
            ids = template[bounds[j]:bounds[j + 1]]
            samples, seq_len = dims.micro_batch, len(ids)
            image_tokens = int(self.layout.handoff_mask(ids).sum())
        return MicroBatchShapes(samples=samples, seq_len=seq_len, image_tokens=image_tokens, hidden=text.hidden_size,
                                handoff_width=text.hidden_size * family_of(config).handoff_tensors(config),
                                vocab=text.vocab_size, compute_dtype=compute_dtype, handoff_dtype=handoff_dtype,
                                rows_require_grad=not self.dims[self.encoder].frozen)

    def close(self) -> None:
        """Stop the prefetch worker."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    # ---- where each sample goes ----------------------------------------------------------------------
    def _slots_at(self, position: int) -> list[list[int]] | None:
        """A dataset plan's packs of the step at data position ``position`` (``PackedConversations.step_slots``)."""
        llm = self.dims["llm"]
        return self.source.step_slots(position, llm.grad_accum, llm.dp, llm.micro_batch) if self.packed else None

    def _slot_samples(self, micro: int, dims: ParallelDims, replica: int) -> list[int]:
        """The prepared step's ``slot_samples``."""
        return slot_samples(micro, dims, replica, position=self.position, slots=self._step_slots)

    def _vision_assignment(self, slots: list[list[int]]) -> list[VisionMicroBatch]:
        """Each micro-batch of a dataset plan's step (its packs among ``slots``): its images and clips in the LLM's
        order and which of them each vision replica runs (``PackedConversations.assign_vision``)."""
        llm, vision = self.dims["llm"], self.dims[self.encoder]
        per_micro = llm.dp * llm.micro_batch
        micro_batches = []
        for micro in range(llm.grad_accum):
            packs = slots[micro * per_micro:(micro + 1) * per_micro]
            micro_batches.append(VisionMicroBatch(items=self.source.vision_items(packs),
                                                  replicas=self.source.assign_vision(packs, vision.dp)))
        return micro_batches

    def _indexes_at(self, position: int, slots: list[list[int]] | None,
                    vision_micro: list[VisionMicroBatch] | None = None) -> list[int]:
        """The samples this rank's modules run in the step at ``position``, each once (a dataset plan's vision
        replica: the samples of the images assigned to it, ``vision_micro`` or the step's assignment)."""
        if self.packed and self.encoder in self.held and not vision_micro:
            vision_micro = self._vision_assignment(slots)
        indexes = {}
        for micro in range(self.num_micro_batches):
            for name in self.held:
                dims = self.dims[name]
                replica = dims.coordinate(self.rank)["dp"]
                if self.packed and name == self.encoder:
                    found = [i for i, _ in vision_micro[micro].replica_items(replica)]
                else:
                    found = slot_samples(micro, dims, replica, position=position, slots=slots)
                indexes.update(dict.fromkeys(found))
        return list(indexes)

    def _layout_routes(self) -> Routes:
        """The hand-off routes of every micro-batch of a fixed-shape plan (all samples share the layout)."""
        encoder, llm = self.dims[self.encoder], self.receiving_llm
        positions = self.layout.output_positions_per_rank(encoder.micro_batch, self.config, encoder.sequence_ranks)
        template = self.layout.template_ids()
        row = (len(template), self.layout.handoff_mask(template).nonzero().flatten())
        slots = image_slots_per_rank([row] * llm.micro_batch, llm.sp, llm.cp)
        return Routes.build(encoder, llm, [positions] * encoder.dp, [slots] * llm.dp, self.device)

    def _packed_routes(self, micro: int) -> Routes:
        """The hand-off routes of packed micro-batch ``micro`` (``packed_routes``)."""
        llm = self.receiving_llm
        rows = [self._slot_samples(micro, llm, e) for e in range(llm.dp)]
        return packed_routes(self.source.samples, self._vision_micro[micro], rows, self.dims[self.encoder], llm,
                             self.config.vision_config, self.device)


def packed_routes(index: list[IndexedSample], micro_batch: VisionMicroBatch, llm_rows: list[list[int]],
                  vision: ParallelDims, llm: ParallelDims, config: Any, device: torch.device) -> Routes:
    """The hand-off routes of a packed micro-batch, from the index alone (no sample is built): each vision replica's
    images and clips (``micro_batch``), wherever the assignment put them, to the LLM replica whose row (the samples
    ``llm_rows[e]``) holds their text, and to the SP rank whose slice of it holds their tokens."""
    merge = config.spatial_merge_size**2
    tokens = [t * h * w // merge for t, h, w in (index[i].grids[k] for i, k in micro_batch.items)]
    starts = list(itertools.accumulate(tokens, initial=0))
    positions, orders = [], []
    for mine in micro_batch.replicas:
        grids = [index[i].grids[k] for i, k in (micro_batch.items[j] for j in mine)]
        order = [torch.arange(starts[j], starts[j] + tokens[j]) for j in mine]
        if needs_filler(grids, config, vision.sequence_ranks):
            grids.append(filler_grid(config, vision.sequence_ranks))
            order.append(torch.full((math.prod(grids[-1]) // merge,), -1))
        positions.append(merged_positions_per_rank(torch.tensor(grids), config, vision.sequence_ranks))
        orders.append(torch.cat(order))
    slots = []
    for row in llm_rows:
        samples = [index[i] for i in row]
        offsets = itertools.accumulate((s.length for s in samples), initial=0)
        image_positions = torch.cat([s.image_positions + a for s, a in zip(samples, offsets)])
        slots.append(image_slots_per_rank([(sum(s.length for s in samples), image_positions)], llm.sp, llm.cp))
    return Routes.build(vision, llm, positions, slots, device, vision_orders=orders)


@dataclass(kw_only=True, frozen=True)
class VisionMicroBatch:
    """A dataset plan's micro-batch as the vision replicas split it."""

    items: list[tuple[int, int]]
    """(sample index, entry of its grids) of each image and clip, in the order the LLM's rows place their tokens."""
    replicas: list[list[int]]
    """Which of ``items`` each vision replica runs (``PackedConversations.assign_vision``)."""

    def replica_items(self, replica: int) -> list[tuple[int, int]]:
        return [self.items[j] for j in self.replicas[replica]]


def needs_filler(grids: list[tuple[int, int, int]], config: Any, sp: int) -> bool:
    """Whether a vision replica's images have fewer attention windows than its ``sp`` ranks (none at all: no image),
    so it runs a filler beside them (``filler_grid``)."""
    return not grids or len(window_layout(torch.tensor(grids), config)[1]) - 1 < sp


def vision_items_batch(samples: list[Sample], entries: list[int], config: Any, sp: int) -> Sample:
    """A vision replica's micro-batch: entry ``entries[n]`` of ``samples[n]``'s images then clips, each
    ``pixel_values`` rows and ``image_grid_thw`` row (the tower takes a clip's temporal groups as its grid says), and a
    filler of zeros (``filler_grid``) where they have fewer windows than ``sp``."""
    pixels, grids = [], []
    for sample, entry in zip(samples, entries):
        parts = [(sample["pixel_values"], sample["image_grid_thw"])]
        if "video_grid_thw" in sample:
            parts.append((sample["pixel_values_videos"], sample["video_grid_thw"]))
        every = [(p, g) for values, grid in parts for p, g in zip(values.split(grid.prod(-1).tolist()), grid)]
        pixels.append(every[entry][0])
        grids.append(tuple(every[entry][1].tolist()))
    if needs_filler(grids, config, sp):
        grids.append(filler_grid(config, sp))
        width = config.in_channels * config.temporal_patch_size * config.patch_size**2
        pixels.append(torch.zeros(math.prod(grids[-1]), width))
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}


def slot_samples(micro: int, dims: ParallelDims, replica: int, *, position: int,
                 slots: list[list[int]] | None) -> list[int]:
    """Indexes of the samples of micro-batch ``micro`` for DP replica ``replica`` of a module, in the step at data
    position ``position``: its slice of the global micro-batch (consecutive samples of a fixed-shape plan; for a
    dataset plan, its packs among the step's ``slots``, flattened)."""
    first = micro * dims.dp * dims.micro_batch + replica * dims.micro_batch
    if slots is None:
        return list(range(position + first, position + first + dims.micro_batch))
    return [i for pack in slots[first:first + dims.micro_batch] for i in pack]


def to_device(shard, device: torch.device):
    """A shard dataclass with its tensors on ``device`` (itself on the CPU)."""
    if device.type == "cpu":
        return shard
    def moved(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        return {k: v.to(device) for k, v in value.items()} if isinstance(value, dict) else value

    return type(shard)(**{k: moved(v) for k, v in shard.__dict__.items()})

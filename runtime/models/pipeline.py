"""Pipeline parallelism of the language model with ``torch.distributed.pipelining``.

The plan splits the decoder layers into ``pp * virtual_stages`` model chunks (``pp_layers``, chunk c on stage
c % pp). Each chunk is a ``LanguageModelChunk`` holding transformers' own submodules of its layers (the embedding
on the first chunk, the final norm and lm_head on the last, the rotary embedding on all), under the same names as
in the whole model, so checkpoints and the random init address them by their Hugging Face names. A rank's chunks
sit in one ``PipelinedLanguageModel`` (what the optimizer and the checkpoint code see); each chunk is a
``PipelineStage``, and ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` or ``ScheduleInterleavedZeroBubble`` (input
gradients first, weight gradients deferred into the bubble) runs every micro-batch of the step.

Inputs of a step, all micro-batches at once (the schedule splits them on the batch dim): the first stage takes the
token ids and the hand-off's image rows ``[B, M, W]`` (every sample of a fixed-shape plan has M image tokens; a
dataset plan's micro-batch is one packed row padded to its budget, its image rows zero-padded to M, the most its
packs can hold: runtime.models.llm.pad_packed_row); every
stage takes the M-RoPE positions (a keyword, split on its batch dim 1) and recomputes its rotary embedding; the last
stage's output goes to the loss with the targets. The image rows are a leaf: their gradient is the hand-back.

Under Ulysses SP every rank of a stage holds its slice of each sequence (runtime.models.llm: ids, positions, targets and
the image rows of its slice), its chunks pass their ``UlyssesGroup`` to every decoder layer's attention, and what a
stage sends its successor is the slice's hidden states, between the ranks of the same SP (and DP, TP) position.

Every stage is built with the shapes and dtypes of what it receives, sends and gets back (``MicroBatchShapes``,
torch's static mode): the schedule's first step then exchanges no metadata and runs no trial forward and backward,
which also lets the dry-run (runtime.dry_run) run a pipelined plan on fake tensors.

Shape legend: B samples, L sequence, M image tokens per sample, D hidden, W hand-off width, V vocab.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.microbatch import TensorChunkSpec
from torch.distributed.tensor import DeviceMesh, DTensor, Shard
from runtime.models.model import LanguageModel, decoder_forward, embed_image_rows
from runtime.parallel.ulysses import UlyssesGroup
from runtime.parallel.parallel_dims import ParallelDims


class _Decoder(nn.Module):
    """The part of ``model.model.language_model`` one chunk holds (same attribute names)."""

    def __init__(self, language_model: nn.Module, layer_ids: range, *, first: bool, last: bool):
        super().__init__()
        self.config = language_model.config
        self.embed_tokens = language_model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): language_model.layers[i] for i in layer_ids})  # keys: HF layer index
        self.norm = language_model.norm if last else None
        self.rotary_emb = language_model.rotary_emb


class LanguageModelChunk(nn.Module):
    """One model chunk of the decoder: ``forward(input_ids_BL, image_rows_BMW)`` (first chunk; W the hand-off
    width, runtime.models.model ``embed_image_rows``: the first chunk holds every layer an injection reaches) or
    ``forward(hidden_BLD)``, with ``position_ids`` [3, B, L] (or 4 rows, packed) as a keyword; returns the hidden
    states, or on the last chunk the logits [B, L, V] (a DTensor sharded on V under tensor parallelism)."""

    def __init__(self, llm: LanguageModel, layer_ids: range, *, first: bool, last: bool):
        super().__init__()
        self.language_model = _Decoder(llm.language_model, layer_ids, first=first, last=last)
        self.lm_head = llm.lm_head if last else None
        self.visual_token_ids = llm.visual_token_ids
        self.first, self.last = first, last
        self.ulysses_group: UlyssesGroup | None = None
        """This rank's sequence slice and its SP group (runtime.models.llm.LLMShard), set by the trainer under SP."""
        self.forward_context: Callable[[], ContextManager] = contextlib.nullcontext
        """Entered around each forward (the trainer's autocast): the schedule runs forwards and backwards in one
        call, and autocast must wrap the forwards only."""

    def forward(self, *inputs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        with self.forward_context():
            return self._forward(*inputs, position_ids=position_ids)

    def _forward(self, *inputs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        decoder, injection = self.language_model, None
        if self.first:
            input_ids_BL, rows_BMW = inputs
            hidden_BLD, injection = embed_image_rows(decoder, input_ids_BL, rows_BMW, self.visual_token_ids)
        else:
            (hidden_BLD,) = inputs
        layers = ((int(index), layer) for index, layer in decoder.layers.items())
        hidden_BLD = decoder_forward(decoder, hidden_BLD, position_ids, layers, ulysses_group=self.ulysses_group,
                                     injection=injection)
        if self.last:
            return self.lm_head(decoder.norm(hidden_BLD))
        return hidden_BLD


class PipelinedLanguageModel(nn.Module):
    """The model chunks one pipeline rank holds (``chunks[i]`` is chunk ``ids[i]``)."""

    def __init__(self, chunks: list[LanguageModelChunk], ids: list[int]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.ids = ids

    @staticmethod
    def hf_name(name: str) -> str:
        """HF parameter name of a parameter name of this module (``chunks.<i>.`` dropped)."""
        return LanguageModel.hf_name(name.split(".", 2)[2])


def chunk_layer_ids(pp_layers: tuple[int, ...]) -> list[range]:
    """The decoder layer indices of every chunk."""
    starts = [sum(pp_layers[:c]) for c in range(len(pp_layers) + 1)]
    return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]


def split_language_model(llm: LanguageModel, dims: ParallelDims, rank: int) -> PipelinedLanguageModel:
    """The chunks of ``llm`` (on ``meta``) that global rank ``rank`` runs: stage s holds chunks s, s + pp, ..."""
    layers = chunk_layer_ids(dims.pp_layers)
    assert sum(dims.pp_layers) == len(llm.language_model.layers), (dims.pp_layers, len(llm.language_model.layers))
    ids = list(range(dims.stage_of(rank), len(layers), dims.pp))
    chunks = [LanguageModelChunk(llm, layers[c], first=c == 0, last=c == len(layers) - 1) for c in ids]
    return PipelinedLanguageModel(chunks, ids)


DECODER_LAYER = re.compile(r"\.layers\.(\d+)\.")
"""A decoder layer's parameter (HF name), with the layer's index."""


def stage_of_parameter(hf_name: str, dims: ParallelDims) -> int:
    """The pipeline stage holding a language-model parameter: its decoder layer's chunk's, the embedding's (first
    chunk) or the final norm's and lm_head's (last chunk)."""
    layers = chunk_layer_ids(dims.pp_layers)
    match = DECODER_LAYER.search(hf_name)
    if match:
        chunk = next(c for c, ids in enumerate(layers) if int(match.group(1)) in ids)
    else:
        chunk = 0 if "embed_tokens" in hf_name else len(layers) - 1
    return chunk % dims.pp


@dataclass(frozen=True, kw_only=True)
class MicroBatchShapes:
    """One micro-batch at the chunk boundaries (per rank: under TP the logits are a DTensor sharded on V)."""

    samples: int
    """B."""
    seq_len: int
    """L: the LLM's sequence, or under SP this rank's slice of it."""
    image_tokens: int
    """M, per sample (of the slice, under SP)."""
    hidden: int
    """D."""
    handoff_width: int
    """W: the width of an image token's hand-off row (D times the family's ``handoff_tensors``)."""
    vocab: int
    """V."""
    compute_dtype: torch.dtype
    """Of the hidden states and logits (runtime.parallel.precision ``Precision.compute_dtype``)."""
    handoff_dtype: torch.dtype
    """Of the image rows the first chunk receives."""
    rows_require_grad: bool
    """Whether the image rows' gradient goes back (the vision tower trains)."""


def stage_metadata(chunk: LanguageModelChunk, shapes: MicroBatchShapes, tp_mesh: DeviceMesh | None
                   ) -> dict[str, tuple[torch.Tensor | None, ...]]:
    """``PipelineStage``'s static-mode arguments of ``chunk`` (``input_args``, ``output_args``, ``input_grads``,
    ``output_grads``), as ``meta`` tensors."""
    B, L, D = shapes.samples, shapes.seq_len, shapes.hidden

    def hidden_BLD():
        return torch.empty(B, L, D, dtype=shapes.compute_dtype, device="meta", requires_grad=True)

    if chunk.first:
        rows = torch.empty(B, shapes.image_tokens, shapes.handoff_width, dtype=shapes.handoff_dtype, device="meta",
                           requires_grad=shapes.rows_require_grad)
        inputs = (torch.empty(B, L, dtype=torch.long, device="meta"), rows)
        input_grads = (None, rows if shapes.rows_require_grad else None)
    else:
        inputs = input_grads = (hidden_BLD(),)
    if not chunk.last:
        outputs = (hidden_BLD(),)
    elif tp_mesh is None:
        outputs = (torch.empty(B, L, shapes.vocab, dtype=shapes.compute_dtype, device="meta", requires_grad=True),)
    else:
        local = torch.empty(B, L, shapes.vocab // tp_mesh.size(), dtype=shapes.compute_dtype, device="meta")
        logits = DTensor.from_local(local, tp_mesh, [Shard(2)], run_check=False, shape=torch.Size((B, L, shapes.vocab)),
                                    stride=(L * shapes.vocab, shapes.vocab, 1))
        outputs = (logits.requires_grad_(),)
    return dict(input_args=inputs, output_args=outputs, input_grads=input_grads, output_grads=outputs)


def build_schedule(model: PipelinedLanguageModel, dims: ParallelDims, device: torch.device, shapes: MicroBatchShapes,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   compute_timer: Callable[[str], ContextManager]):
    """The plan's schedule over this rank's chunks, on the pipeline group of its grid position, each stage built
    with its micro-batch ``shapes``. Gradients are not rescaled (``scale_grads=False``): the loss is already
    divided by the step's target tokens. Every chunk's forward and backward runs inside ``compute_timer(action)``
    (what is left of the schedule's time is waiting)."""
    group = dims.mesh["pp"].get_group()
    num_chunks = len(dims.pp_layers)
    tp_mesh = dims.mesh["tp"] if dims.tp_enabled else None
    stages = [PipelineStage(chunk, c, num_chunks, device, group=group, **stage_metadata(chunk, shapes, tp_mesh))
              for chunk, c in zip(model.chunks, model.ids)]
    for stage in stages:
        _time_compute(stage, compute_timer)
    options = dict(n_microbatches=dims.grad_accum, loss_fn=loss_fn, scale_grads=False,
                   kwargs_chunk_spec={"position_ids": TensorChunkSpec(1)})
    interleaved = {"interleaved_1f1b": ScheduleInterleaved1F1B, "interleaved_zb": ScheduleInterleavedZeroBubble}
    if dims.pp_schedule in interleaved:
        return interleaved[dims.pp_schedule](stages, **options)
    (stage,) = stages
    return Schedule1F1B(stage, **options)


def _time_compute(stage: PipelineStage, timer: Callable[[str], ContextManager]) -> None:
    """Run the stage's per-micro-batch forward and backward (the schedule's compute actions: a zero-bubble schedule
    runs the weight gradients as actions of their own) inside ``timer(action)``, ``action`` the method's name."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        call = getattr(stage, name)

        def timed(*args, _call=call, _name=name, **kwargs):
            with timer(_name):
                return _call(*args, **kwargs)

        setattr(stage, name, timed)

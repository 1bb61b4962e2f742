"""Apply a module's planned parallelism, in torchtitan's order: TP -> EP -> recomputation -> FSDP (experts, blocks,
then root).

The module arrives on the ``meta`` device and stays there: runtime.checkpoints.hf_folder.materialize then gives this rank's
shards storage and values.

Ulysses SP needs no module change: the encoders' forwards (runtime.models.vision, the audio family) and the LLM's inputs (runtime.models.llm) are
split on the sequence, and the SP group reaches the attention kernel (runtime.parallel.attention) as a call
argument.
"""

from __future__ import annotations

from torch import nn

from runtime.models.families.family import RuntimeFamily
from runtime.models.model import LanguageModel
from runtime.models.pipeline import PipelinedLanguageModel, split_language_model
from runtime.parallel.experts import apply_expert_parallel, shard_experts
from runtime.parallel.fsdp import apply_fsdp
from runtime.parallel.precision import Precision, cast_norm_outputs
from runtime.parallel.recompute import apply_recompute
from runtime.parallel.tensor_parallel import parallelize_llm_tp
from runtime.parallel.parallel_dims import BATCH_AXIS, ParallelDims


def uses_fsdp(dims: ParallelDims) -> bool:
    """FSDP2 wraps the module: ZeRO >= 1 over more than one rank."""
    return dims.zero >= 1 and dims.batch_enabled


def parallelize_encoder(tower: nn.Module, dims: ParallelDims, precision: Precision, family: RuntimeFamily) -> None:
    """Encoder tower (vision or audio): TP over ``tp`` (the family's ``encoder.parallelize_tp``, runtime.models.families),
    recomputation, ZeRO over ``dp x sp``."""
    assert dims.mesh is not None, "build_mesh first"
    if dims.tp_enabled:
        family.encoder.parallelize_tp(tower, dims.mesh["tp"])
    cast_norm_outputs(tower, precision)
    apply_recompute(tower.pretrained, dims.recompute)
    if uses_fsdp(dims):
        apply_fsdp(tower, tower.blocks, dims.mesh[BATCH_AXIS], zero=dims.zero, mp_policy=precision.fsdp_policy)


def parallelize_llm(llm: LanguageModel, dims: ParallelDims, precision: Precision, family: RuntimeFamily) -> None:
    """Language model: TP (vocab-parallel embedding and loss), EP of its experts (runtime.parallel.experts),
    recomputation, ZeRO over ``dp x sp`` (the experts' over ``efsdp``)."""
    assert dims.mesh is not None, "build_mesh first"
    if dims.tp_enabled:
        parallelize_llm_tp(llm, dims.mesh["tp"], family)
    if dims.experts_split:
        apply_expert_parallel(llm, dims)
    cast_norm_outputs(llm, precision)
    apply_recompute(llm.language_model, dims.recompute)
    if uses_fsdp(dims):
        if dims.experts_split:
            shard_experts(llm, dims, zero=dims.zero, mp_policy=precision.fsdp_policy)
        apply_fsdp(llm, list(llm.language_model.layers), dims.mesh[BATCH_AXIS], zero=dims.zero,
                   mp_policy=precision.fsdp_policy)


def parallelize_pipelined_llm(llm: LanguageModel, dims: ParallelDims, precision: Precision, rank: int,
                              family: RuntimeFamily) -> PipelinedLanguageModel:
    """A pipelined language model: recomputation on every layer first (transformers sets it per layer), then this
    rank's chunks (runtime.models.pipeline), each with TP and ZeRO over its stage's ``dp x sp`` as one FSDP root."""
    assert dims.mesh is not None, "build_mesh first"
    cast_norm_outputs(llm, precision)
    apply_recompute(llm.language_model, dims.recompute)
    pipelined = split_language_model(llm, dims, rank)
    for chunk in pipelined.chunks:
        if dims.tp_enabled:
            parallelize_llm_tp(chunk, dims.mesh["tp"], family)
        if dims.experts_split:
            apply_expert_parallel(chunk, dims)
        if uses_fsdp(dims):
            if dims.experts_split:
                shard_experts(chunk, dims, zero=dims.zero, mp_policy=precision.fsdp_policy)
            apply_fsdp(chunk, list(chunk.language_model.layers.values()), dims.mesh[BATCH_AXIS], zero=dims.zero,
                       mp_policy=precision.fsdp_policy)
    return pipelined

"""Apply a module's planned parallelism, in torchtitan's order: TP -> recomputation -> FSDP (blocks, then root).

Ulysses SP needs no module change: the vision forward (runtime.vision) and the LLM's inputs (runtime.llm) are
split on the sequence, and the SP group reaches the attention kernel (runtime.parallel.attention) as a call
argument.
"""

from __future__ import annotations

from runtime.model import LanguageModel, VisionTower
from runtime.parallel.fsdp import apply_fsdp
from runtime.parallel.recompute import apply_recompute
from runtime.parallel.tensor_parallel import parallelize_llm_tp, parallelize_vision_tp
from runtime.parallel_dims import BATCH_AXIS, ParallelDims


def parallelize_vision(vision: VisionTower, dims: ParallelDims) -> None:
    """Vision tower: TP over ``tp``, recomputation, ZeRO over ``dp x sp``."""
    assert dims.mesh is not None, "build_mesh first"
    if dims.tp_enabled:
        parallelize_vision_tp(vision.visual, dims.mesh["tp"])
    apply_recompute(vision.visual, dims.recompute)
    if dims.zero >= 1 and dims.batch_enabled:
        apply_fsdp(vision, list(vision.visual.blocks), dims.mesh[BATCH_AXIS], zero=dims.zero)


def parallelize_llm(llm: LanguageModel, dims: ParallelDims) -> None:
    """Language model: TP (vocab-parallel embedding and loss), recomputation, ZeRO over ``dp x sp``."""
    assert dims.mesh is not None, "build_mesh first"
    if dims.tp_enabled:
        parallelize_llm_tp(llm, dims.mesh["tp"])
    apply_recompute(llm.language_model, dims.recompute)
    if dims.zero >= 1 and dims.batch_enabled:
        apply_fsdp(llm, list(llm.language_model.layers), dims.mesh[BATCH_AXIS], zero=dims.zero)

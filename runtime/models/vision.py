"""How one vision rank runs its part of a micro-batch: window split (Ulysses SP) and the block loop.

The forward (each family's ``VisionHooks.forward``, runtime.models.families) reuses the tower's own submodules
(patch_embed, rotary_pos_emb, blocks, merger) and transformers' own index helpers (``get_vision_window_index``
etc.), in the same order as the tower's own forward (``Qwen2_5_VisionTransformerPretrainedModel.forward``); it only
restricts every step to this rank's windows. Qwen2-VL and Qwen3-VL have no windows: their sequence is split on merge
units and every block is a full-attention block.

Shape legend: N patches of the replica, n this rank's patches, M merged tokens, P flattened patch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn
from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

from planner.contract.rules import attention_rules, width_rule
from runtime.data.samples import SyntheticData, layout_from_plan, visual_inputs
from runtime.parallel.ring import GatheredSequence, RingGroup
from runtime.parallel.tensor_parallel import parallelize_vision_tp, qkv_row_order
from runtime.parallel.ulysses import UlyssesGroup, split_windows
from runtime.parallel.windows import window_layout


Normalization = tuple[tuple[float, ...], tuple[float, ...]]
"""(image_mean, image_std) per channel."""


class VisionTower(nn.Module):
    """The vision encoder (patch embed, blocks, merger) of a Qwen-VL model: ``model.model.visual``, run by its
    family's ``VisionHooks.forward``."""

    hf_prefix = "model.visual."

    def __init__(self, visual: nn.Module, forward: Callable[[nn.Module, "VisionShard"], torch.Tensor]):
        super().__init__()
        self.visual = visual
        self._forward = forward

    @property
    def blocks(self) -> list[nn.Module]:
        """The repeated blocks (FSDP units)."""
        return list(self.visual.blocks)

    @property
    def pretrained(self) -> nn.Module:
        """The transformers model whose layers recomputation wraps."""
        return self.visual

    def forward(self, shard: VisionShard) -> torch.Tensor:
        """Hand-off rows of this rank's window shard, in window order: [M_local, W]."""
        return self._forward(self.visual, shard)

    @staticmethod
    def hf_name(name: str) -> str:
        """HF parameter name of a parameter name of this module."""
        return VisionTower.hf_prefix + name.removeprefix("visual.")


@dataclass(kw_only=True, frozen=True)
class VisionHooks:
    """What a vision family says of its tower; ``VisionEncoder`` does the rest."""

    tp_plans: Callable[[nn.Module], list[tuple[nn.Module, dict]]]
    """``tp_plans(visual)``: the DTensor ``parallelize_module`` plans of the tower's submodules (each block's fused
    ``attn.qkv`` rows are put in TP layout first, by runtime.parallel.tensor_parallel)."""
    patch_inputs: Callable[[torch.Tensor, Any], dict[str, torch.Tensor]]
    """``patch_inputs(grid_thw, vision_config)``: per-patch inputs besides pixels and positions, ``{name: [N,
    ...]}`` in patch order (the shard takes its patches' rows); may return none."""
    forward: Callable[[nn.Module, "VisionShard"], torch.Tensor]
    """``forward(visual, shard)``: this rank's hand-off rows ``[m, handoff_tensors * D]``, in window order."""
    image_normalization: Normalization
    """(image_mean, image_std) of the checkpoints' preprocessor_config.json: how the data readers normalise pixels."""

    def missing(self) -> list[str]:
        """The hooks that are not callable, and a normalization that is not a mean and a deviation per channel."""
        missing = [name for name in ("tp_plans", "patch_inputs", "forward") if not callable(getattr(self, name))]
        norm = self.image_normalization
        if not (isinstance(norm, tuple) and len(norm) == 2 and all(isinstance(v, tuple) and v for v in norm)
                and len(norm[0]) == len(norm[1])):
            missing.append("image_normalization")
        return missing


class VisionEncoder:
    """The runtime's encoder interface (runtime.models.families ``Encoder``) for the Qwen-VL vision towers, from a
    family's vision hooks."""

    name = "vision"

    def __init__(self, hooks: VisionHooks):
        self.hooks = hooks

    @property
    def image_normalization(self) -> Normalization:
        """(image_mean, image_std) the family's processor normalises pixels with."""
        return self.hooks.image_normalization

    def missing_hooks(self) -> list[str]:
        return [f"vision hooks.{name}" for name in self.hooks.missing()]

    @staticmethod
    def config(config: Any) -> Any:
        return config.vision_config

    def split_model(self, model: nn.Module, language_model: Any) -> tuple[VisionTower, nn.Module, Any]:
        """The vision tower, the language model (its hand-off lands on image and video tokens) and M-RoPE."""
        llm = language_model(model.model.language_model, model.lm_head,
                             (model.config.image_token_id, model.config.video_token_id))
        return VisionTower(model.model.visual, self.hooks.forward), llm, model.model.get_rope_index

    def parallelize_tp(self, tower: VisionTower, mesh: Any) -> None:
        parallelize_vision_tp(tower.visual, mesh, self.hooks.tp_plans(tower.visual))

    @staticmethod
    def row_order(local_name: str, tp: int, rows: int) -> torch.Tensor | None:
        """HF row of each stored row of a parameter the TP layout reorders (each block's fused qkv), else None."""
        return qkv_row_order(rows, tp) if tp > 1 and ".attn.qkv." in local_name else None

    @staticmethod
    def rules(tp: int, sp: int, config: Any) -> list[str]:
        """Why the tower cannot run at these degrees (planner.contract.rules, as the planner checks them)."""
        vc = config.vision_config
        width = getattr(vc, "embed_dim", None) or vc.hidden_size  # Qwen2-VL names it embed_dim
        reasons = attention_rules(tp, sp, vc.num_heads, vc.num_heads, "the vision tower")
        widths = [(getattr(vc, "intermediate_size", None) or int(width * vc.mlp_ratio),
                   "MLP hidden width of the vision blocks"),
                  (width * vc.spatial_merge_size**2, "input width of the patch merger")]
        return reasons + [problem for w, what in widths if (problem := width_rule(tp, w, what))]

    def layout_from_plan(self, workload: Any, config: Any) -> Any:
        """runtime.data.samples ``layout_from_plan``, with the family's image normalization."""
        return layout_from_plan(workload, config, normalization=self.hooks.image_normalization)

    @staticmethod
    def synthetic(layout: Any, seed: int) -> Any:
        """Random images and clips of the layout (runtime.data.samples ``SyntheticData``)."""
        return SyntheticData(layout, seed)

    def shard(self, batch: Mapping[str, torch.Tensor], config: Any, *, sp_rank: int, sp_group: Any,
              sp: int, cp_rank: int = 0, ring: RingGroup | None = None) -> VisionShard:
        """This (CP, SP) rank's part of a replica's images and clips (``shard_vision_batch``)."""
        pixels, grid = visual_inputs(batch)
        grid, vc = grid.cpu(), config.vision_config
        return shard_vision_batch(pixels, grid, vc, sp_rank=sp_rank, sp_group=sp_group, sp=sp, cp_rank=cp_rank,
                                  ring=ring, patch_inputs=self.hooks.patch_inputs(grid, vc))


@dataclass(kw_only=True, frozen=True)
class VisionShard:
    """This rank's inputs for one vision micro-batch."""

    pixel_values_nP: torch.Tensor
    """Its patches, in window order."""
    position_ids_n2: torch.Tensor
    """(row, col) rotary positions of those patches."""
    cu_windows: torch.Tensor
    """Rank-local window boundaries (int32) for window-attention blocks."""
    cu_full: torch.Tensor
    """Boundaries for full-attention blocks: per image when the rank holds the whole sequence, else [0, n]."""
    ulysses: UlyssesGroup | None
    """The SP group (with the CP group's ring) when the sequence is split, else None."""
    full_blocks: frozenset[int]
    """Indexes of the full-attention blocks."""
    merged_positions: torch.Tensor
    """Replica-order index of each merged token this rank emits (its output rows, in order)."""
    patch_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """The family's other per-patch inputs, this rank's rows (Qwen3-VL: position-table taps and weights)."""


def filler_grid(config: Any, sp: int) -> tuple[int, int, int]:
    """The smallest image grid with ``sp`` attention windows (merge units without windows): what a vision replica
    runs beside too few windows of its own (none: no image this micro-batch), so that every SP rank has a window and
    every collective of the replica (FSDP, TP, SP) runs as on its peers; its tokens go nowhere, its gradient is 0."""
    units = config.window_size // (config.patch_size * config.spatial_merge_size) if getattr(
        config, "window_size", None) else 1
    return 1, config.spatial_merge_size, config.spatial_merge_size * units * sp


def full_attention_blocks(config: Any) -> frozenset[int]:
    """Blocks attending over whole images (all of them in Qwen2-VL)."""
    full = getattr(config, "fullatt_block_indexes", None)
    return frozenset(range(config.depth)) if full is None else frozenset(full)


def shard_vision_batch(
    pixel_values_NP: torch.Tensor, grid_thw: torch.Tensor, config: Any, *, sp_rank: int, sp_group: Any, sp: int,
    cp_rank: int = 0, ring: RingGroup | None = None, patch_inputs: Mapping[str, torch.Tensor] | None = None,
) -> VisionShard:
    """The part of a replica's packed images that SP rank ``sp_rank`` of ``sp`` of CP rank ``cp_rank`` of the
    ``ring`` processes: the run of attention windows is split in whole windows over the cp x sp sequence ranks (CP
    outer, ``sequence_rank``); ``patch_inputs``: the family's other per-patch inputs of the replica
    (``VisionHooks.patch_inputs``), in patch order."""
    unit = config.spatial_merge_size**2
    cp = 1 if ring is None else ring.degree
    window_index, cu_windows = window_layout(grid_thw, config)
    patch_order = (window_index[:, None] * unit + torch.arange(unit)).flatten()
    bounds = split_windows(cu_windows, sp * cp)
    part = cp_rank * sp + sp_rank
    start, end = bounds[part], bounds[part + 1]
    local = patch_order[start:end]
    positions = get_vision_position_ids(grid_thw, config.spatial_merge_size)
    cu_image, _ = get_vision_attention_seqlens(grid_thw, config)
    local_windows = [c - start for c in cu_windows if start <= c <= end]
    segment_lens = tuple((cu_image[1:] - cu_image[:-1]).tolist())
    sp_lens = tuple(bounds[cp_rank * sp + j + 1] - bounds[cp_rank * sp + j] for j in range(sp))
    ulysses = None
    if cp > 1:  # the exchange gives the CP rank's whole part; its attention runs per segment over the gathered sequence
        gathered = GatheredSequence(part_lens=tuple(bounds[(c + 1) * sp] - bounds[c * sp] for c in range(cp)),
                                    segment_lens=segment_lens, rank=cp_rank)
        ulysses = UlyssesGroup(group=sp_group, rank=sp_rank, segment_lens=(sum(sp_lens),), seq_lens=sp_lens,
                               ring=ring, gathered=gathered)
    elif sp > 1:
        ulysses = UlyssesGroup(group=sp_group, rank=sp_rank, segment_lens=segment_lens, seq_lens=sp_lens)
    return VisionShard(
        pixel_values_nP=pixel_values_NP[local],
        position_ids_n2=positions[local],
        cu_windows=torch.tensor(local_windows, dtype=torch.int32),
        cu_full=cu_image if sp * cp == 1 else torch.tensor([0, end - start], dtype=torch.int32),
        ulysses=ulysses,
        full_blocks=full_attention_blocks(config),
        merged_positions=window_index[start // unit : end // unit],
        patch_inputs={name: value[local] for name, value in (patch_inputs or {}).items()},
    )


def blocks_forward(visual: nn.Module, shard: VisionShard, hidden: torch.Tensor,
                   after_block: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """The tower's blocks on this rank's patch embeddings ``hidden`` [n, D_vision], with their 2-D rotary positions;
    ``after_block(index, output)`` sees each block's output."""
    position_embeddings = visual.rotary_pos_emb(hidden, shard.position_ids_n2)
    for index, block in enumerate(visual.blocks):
        if index in shard.full_blocks:
            hidden = block(
                hidden, cu_seqlens=shard.cu_full, position_embeddings=position_embeddings, ulysses_group=shard.ulysses
            )
        else:
            hidden = block(hidden, cu_seqlens=shard.cu_windows, position_embeddings=position_embeddings)
        if after_block is not None:
            after_block(index, hidden)
    return hidden

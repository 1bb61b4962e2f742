"""Small hand-made specs with round numbers, so expected costs can be written out by hand."""

from __future__ import annotations

from dataclasses import replace

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS
from planner.contract.hardware import Cluster, DeviceSpec
from planner.contract.families.qwen_parts import QWEN2_VL_IMAGE_PIXELS, QWEN2_VL_VIDEO
from planner.contract.models import AttentionSpec, LayerSpec, MlpSpec, ModelSpec, ModuleSpec, VisionInputSpec
from planner.contract.strategy import ModuleStrategy, Strategy
from planner.contract.workload import Workload
from planner.contract.units import GIB


COMPUTE_ONLY = replace(DEFAULT_ASSUMPTIONS, host_seconds_per_op=0.0, dtensor_seconds_per_op=0.0)
"""Assumptions of the hand calculations of compute, memory and communication terms: no host dispatch cost (the toy
shapes are so small that it would bind; ``test_cost_host.py`` tests it)."""

TOY_DEVICE = DeviceSpec(
    name="toy",
    peak_bf16_flops=1e15,
    memory_bytes=80 * GIB,
    memory_bandwidth=2e12,
    intra_node_bandwidth=2e11,
    intra_node_latency=1e-5,
    inter_node_bandwidth=2.5e10,
    inter_node_latency=5e-5,
    devices_per_node=4,
    kernel_launch_latency=0.0,
    host_overlap=1.0,
    source="test",
)

VISION_HIDDEN, VISION_HEADS, VISION_HEAD_DIM, VISION_MLP = 64, 4, 16, 128
LLM_HIDDEN, LLM_HEADS, LLM_KV_HEADS, LLM_HEAD_DIM, LLM_MLP, VOCAB = 128, 8, 2, 16, 256, 1000


def vision_block(name: str, count: int, window: int | None) -> LayerSpec:
    h, f = VISION_HIDDEN, VISION_MLP
    return LayerSpec(
        kind="vision_block",
        name=name,
        count=count,
        params=3 * h * h + 3 * h + h * h + h + 3 * h * f + 2 * f + h + 2 * h,
        hidden_size=h,
        attention=AttentionSpec(
            num_heads=VISION_HEADS,
            num_kv_heads=VISION_HEADS,
            head_dim=VISION_HEAD_DIM,
            causal=False,
            window_patches=window,
        ),
        mlp=MlpSpec(intermediate_size=f, gated=True),
    )


def decoder_layer(count: int = 2) -> LayerSpec:
    h, d, f = LLM_HIDDEN, LLM_HEAD_DIM, LLM_MLP
    q, kv = LLM_HEADS * d, LLM_KV_HEADS * d
    return LayerSpec(
        kind="decoder_layer",
        name="decoder_layer",
        count=count,
        params=h * q + q + 2 * (h * kv + kv) + q * h + 3 * h * f + 2 * h,
        hidden_size=h,
        attention=AttentionSpec(num_heads=LLM_HEADS, num_kv_heads=LLM_KV_HEADS, head_dim=d, causal=True),
        mlp=MlpSpec(intermediate_size=f, gated=True),
    )


def toy_model(*, frozen: tuple[str, ...] = ()) -> ModelSpec:
    """A Qwen2.5-VL-shaped model: 2 window blocks + 1 full block + merger; 2 GQA decoder layers."""
    h, lh = VISION_HIDDEN, LLM_HIDDEN
    vision = ModuleSpec(
        name="vision",
        layers=(
            LayerSpec(
                kind="patch_embed", name="patch_embed", count=1, params=1176 * h, hidden_size=h, in_features=1176
            ),
            vision_block("window_block", 2, window=16),
            vision_block("full_block", 1, window=None),
            LayerSpec(
                kind="patch_merger",
                name="patch_merger",
                count=1,
                params=4 * h * 4 * h + 4 * h * lh + h,
                hidden_size=h,
                in_features=4 * h,
                out_features=lh,
                token_reduction=4,
            ),
        ),
    )
    llm = ModuleSpec(
        name="llm",
        layers=(
            LayerSpec(kind="embedding", name="embedding", count=1, params=VOCAB * lh, hidden_size=lh),
            decoder_layer(),
            LayerSpec(kind="final_norm", name="final_norm", count=1, params=lh, hidden_size=lh),
            LayerSpec(kind="lm_head", name="lm_head", count=1, params=VOCAB * lh, hidden_size=lh, out_features=VOCAB),
        ),
    )
    model = ModelSpec(
        name="toy-vl",
        family="qwen2_5_vl",
        hf_config={},
        modules=(vision, llm),
        vision_input=VisionInputSpec(patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                                     min_pixels=QWEN2_VL_IMAGE_PIXELS[0], max_pixels=QWEN2_VL_IMAGE_PIXELS[1],
                                     video=QWEN2_VL_VIDEO),
    )
    return model.with_frozen(frozen) if frozen else model


def toy_cluster(num_devices: int = 8) -> Cluster:
    """``num_devices`` toy GPUs, 4 per node."""
    return Cluster(device=TOY_DEVICE, num_devices=num_devices, devices_per_node=4)


def toy_workload(global_batch: int = 8) -> Workload:
    """One 112x112 image (64 patches, 4 windows of 16, 16 LLM tokens) + 48 text tokens = 64 LLM tokens."""
    return Workload(image_sizes=((112, 112),), text_tokens=48, global_batch=global_batch)


def colocated(vision: ModuleStrategy, llm: ModuleStrategy, precision: str = "bf16_mixed") -> Strategy:
    return Strategy(placement="colocated", modules={"vision": vision, "llm": llm}, precision=precision)

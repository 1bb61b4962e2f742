"""Build Plan objects for runtime tests directly (no solver): one small factory, explicit degrees."""

from __future__ import annotations

import copy
from typing import Any

from planner.cost.balance import SampleWork
from planner.contract.families import model_from_hf_config
from planner.contract.hardware import DeviceSpec, get_device
from planner.contract.schema import (
    SCHEMA_VERSION, ClusterInfo, DatasetInfo, MemoryBreakdown, ModelInfo, ModulePlan, ModulePrediction,
    ModuleTime, Plan, Prediction, SolverInfo, TokenPercentiles, TrainingInfo, WorkloadInfo,
)

IMAGE_SIZE = (112, 168)
"""8 x 12 patches: two windows of 64 and 32 patches (uneven SP split), 24 merged tokens."""
QWEN3_IMAGE_SIZE = (128, 192)
"""The same 8 x 12 patches at Qwen3-VL's patch side of 16."""
TEXT_TOKENS = 40


def tiny_hf_config() -> dict[str, Any]:
    """The catalog's tiny Qwen2.5-VL (4 vision blocks, 2 of them full attention; 4 decoder layers)."""
    from planner.catalog import get_model

    return dict(get_model("qwen2.5-vl-tiny").hf_config)


def tiny_qwen2_vl_config() -> dict[str, Any]:
    """The catalog's Qwen2-VL-2B config (flat text fields, tied embeddings, no vision windows, fc1/fc2 vision MLP)
    at the tiny model's width: 2 decoder layers, 2 vision blocks, special token ids inside a 1024-token vocabulary."""
    from planner.catalog import get_model

    config = copy.deepcopy(dict(get_model("qwen2-vl-2b").hf_config))
    config.update(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, max_window_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, vision_token_id=1000, image_token_id=1001, video_token_id=1002,
        vision_start_token_id=1003, vision_end_token_id=1004, bos_token_id=1005, eos_token_id=1006,
        rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},  # head_dim 32: 16 rotary frequencies
    )
    config["vision_config"] = {**config["vision_config"], "depth": 2, "embed_dim": 64, "mlp_ratio": 2, "num_heads": 4,
                               "hidden_size": 128}
    return config


def sample_layout(workload: Any, config: Any) -> Any:
    """The runtime's sample layout of ``workload`` for a transformers config, as its family's encoder builds it (with
    the family's image normalization)."""
    from runtime.models.families import family_of  # the runtime's half: imported only by the tests that run it

    return family_of(config).encoder.layout_from_plan(workload, config)


def sample_work(hf_config: dict[str, Any]) -> SampleWork:
    """What the runtime balances a dataset plan's replicas on (``planner.cost.balance``), for a model on a CPU."""
    return SampleWork(model_from_hf_config(hf_config, "tiny"), get_device("cpu"))


def dataset_info(pack_tokens: int) -> DatasetInfo:
    """What ``plan --dataset`` records, with made-up statistics: the runtime reads only the pack budget and the
    min / max pixels (the tiny model's 14-pixel patches, merged 2 x 2)."""
    return DatasetInfo(source="d.jsonl", samples=4, skipped={}, text_tokens="given", min_pixels=28 * 28,
                       max_pixels=28 * 28 * 64, tokens_per_sample={"llm": TokenPercentiles(p50=1.0, p95=1.0, max=1.0)},
                       pack_tokens=pack_tokens, packs_per_epoch=1, samples_per_pack=4.0, packing_efficiency=0.5,
                       heaviest_pack_tokens={"llm": 128.0})


def _memory() -> MemoryBreakdown:
    return MemoryBreakdown(weights=0.01, gradients=0.01, optimizer=0.02, activations=0.01, buffers=0.0, overhead=0.0)


def _prediction() -> ModulePrediction:
    time = ModuleTime(forward=0.01, backward=0.02, recompute=0.0, tp_comm=0.0, sp_comm=0.0, cp_comm=0.0,
                      dp_comm=0.0, optimizer=0.0, handoff=0.0, per_micro_batch=0.03)
    return ModulePrediction(time_s=time, memory_gib=_memory(), flops_per_step=1e9, sources={})


def module(name: str, ranks: list[int], *, dp=1, tp=1, sp=1, cp=1, zero=0, recompute="none", micro_batch=1,
           grad_accum=1, frozen=False, **pipeline) -> ModulePlan:
    """A plan's module; ``pipeline``: pp, pp_schedule, virtual_stages, pp_layers."""
    return ModulePlan(name=name, ranks=ranks, dp=dp, tp=tp, sp=sp, cp=cp, zero=zero, recompute=recompute,
                      micro_batch=micro_batch, grad_accum=grad_accum, frozen=frozen, num_params=1,
                      predicted=_prediction(), **pipeline)


def tiny_qwen2_audio_config() -> dict[str, Any]:
    """The catalog's tiny Qwen2-Audio (2 encoder blocks over 1 s clips of 50 positions, 4 decoder layers)."""
    from planner.catalog import get_model

    return copy.deepcopy(dict(get_model("qwen2-audio-tiny").hf_config))


def tiny_qwen3_vl_config() -> dict[str, Any]:
    """The catalog's tiny Qwen3-VL (4 full-attention vision blocks, DeepStack from blocks 1 and 2 into decoder
    layers 0 and 1 of 4, q/k norms, interleaved M-RoPE)."""
    from planner.catalog import get_model

    return copy.deepcopy(dict(get_model("qwen3-vl-tiny").hf_config))


def tiny_qwen3_5_config() -> dict[str, Any]:
    """The catalog's tiny Qwen3.5 (2 vision blocks without DeepStack; 3 Gated DeltaNet layers with 2 key and 4 value
    heads, then 1 gated full-attention layer)."""
    from planner.catalog import get_model

    return copy.deepcopy(dict(get_model("qwen3.5-tiny").hf_config))


def tiny_qwen3_5_moe_config() -> dict[str, Any]:
    """The catalog's tiny Qwen3.5-MoE (the tiny Qwen3.5 with 8 routed experts, top-2, and a shared expert in every
    decoder layer)."""
    from planner.catalog import get_model

    return copy.deepcopy(dict(get_model("qwen3.5-moe-tiny").hf_config))


def tiny_qwen3_vl_moe_config(*, balancing: bool = True) -> dict[str, Any]:
    """The catalog's tiny Qwen3-VL-MoE (the tiny Qwen3-VL with 8 experts, top-2, in every decoder layer);
    ``balancing``: with transformers' load-balancing loss (``output_router_logits``; off in the catalog) or without."""
    from planner.catalog import get_model

    config = copy.deepcopy(dict(get_model("qwen3-vl-moe-tiny").hf_config))
    config["text_config"]["output_router_logits"] = balancing
    return config


def make_plan(vision: dict, llm: dict, *, placement="colocated", image_size=IMAGE_SIZE, text_tokens=TEXT_TOKENS,
              learning_rate=1e-3, warmup_steps=2, grad_clip_norm=1.0, hf_config=None,
              pack_tokens: int | None = None, videos: tuple[tuple[int, int, int], ...] = (),
              audio_seconds: float = 0.0) -> Plan:
    """A CPU plan for the tiny model; ``vision``/``llm`` are module() keyword arguments (ranks defaulted; for an
    audio model ``vision`` is the audio encoder's). ``image_size``: one (height, width), or a tuple of them (several
    images per sample); ``videos``: (frames, height, width) clips per sample; ``audio_seconds``: an audio model's
    seconds per sample. With ``pack_tokens`` it is a dataset plan (packs of that many LLM tokens; the data is the
    run's ``--data``)."""
    hf_config = hf_config or tiny_hf_config()
    encoder = "audio" if audio_seconds else "vision"
    v_size, l_size = (d.get("pp", 1) * d.get("dp", 1) * d.get("tp", 1) * d.get("sp", 1) * d.get("cp", 1)
                      for d in (vision, llm))
    if placement == "colocated":
        v_ranks, l_ranks = list(range(v_size)), list(range(l_size))
    else:
        l_ranks, v_ranks = list(range(l_size)), list(range(l_size, l_size + v_size))
    modules = [
        module(encoder, vision.pop("ranks", v_ranks), **vision),
        module("llm", llm.pop("ranks", l_ranks), **llm),
    ]
    n = len({r for m in modules for r in m.ranks})
    samples = modules[1].dp * modules[1].micro_batch * modules[1].grad_accum
    patch = hf_config.get("vision_config", {}).get("patch_size", 14)
    sizes = [] if not image_size else list(image_size) if isinstance(image_size[0], tuple) else [image_size]
    patches = sum((h // patch) * (w // patch) for h, w in sizes)
    llm_tokens = text_tokens + patches // 4
    if audio_seconds:  # whole clips of max_source_positions encoder positions, pooled 2x
        sizes, positions = [], hf_config["audio_config"]["max_source_positions"]
        patches = round(audio_seconds * 50 / positions) * positions
        llm_tokens = text_tokens + patches // 2
    if videos:  # (frames, height, width) clips, as the planner counts them
        from planner.contract.families import model_from_hf_config
        from planner.contract.workload import Workload, module_tokens

        tokens = module_tokens(Workload(image_sizes=tuple(sizes), videos=videos, text_tokens=text_tokens,
                                        global_batch=1), model_from_hf_config(hf_config, "tiny"))
        patches, llm_tokens = int(tokens["vision"].tokens), int(tokens["llm"].tokens)
    device = DeviceSpec(name="cpu", peak_bf16_flops=1e11, memory_bytes=8 << 30, memory_bandwidth=2e10,
                        intra_node_bandwidth=5e9, intra_node_latency=1e-5, inter_node_bandwidth=1e9,
                        inter_node_latency=1e-4, devices_per_node=n, kernel_launch_latency=0.0,
                        host_overlap=0.0, source="test")
    return Plan(
        schema_version=SCHEMA_VERSION, planner_version="test",
        model=ModelInfo(name="tiny", family=hf_config["model_type"], hf_config=hf_config, num_params=1,
                        module_params={encoder: 1, "llm": 1}),
        cluster=ClusterInfo(device=device, num_devices=n, devices_per_node=n),
        workload=WorkloadInfo(image_sizes=sizes, vision_tokens=None,
                              text_tokens=text_tokens, audio_seconds=audio_seconds, global_batch=samples,
                              videos=list(videos), module_tokens={encoder: patches, "llm": llm_tokens},
                              llm_image_tokens=0 if audio_seconds else patches // 4,
                              dataset=None if pack_tokens is None else dataset_info(pack_tokens)),
        training=TrainingInfo(precision="bf16_mixed", learning_rate=learning_rate, warmup_steps=warmup_steps,
                              grad_clip_norm=grad_clip_norm),
        placement=placement, modules=modules,
        predicted=Prediction(step_time_s=0.1, tokens_per_s=1.0, samples_per_s=1.0, mfu=0.1, peak_memory_gib=0.1,
                             memory_breakdown_gib=_memory(), binding_constraint="test"),
        baselines={}, solver=SolverInfo(status="EVALUATED", num_candidates=1),
    )

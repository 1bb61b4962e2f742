"""Checks that a plan's parallelism was really applied on every rank, so a plan that silently ran replicated fails.

Two halves. Probes run inside the Ray actors (``Worker.__ray_call__``, which calls ``fn(actor, *args)`` there) and
return small picklable summaries: per parameter its DTensor layout, local and global shape and ``requires_grad``;
per transformer block the layout of its first registered parameter around every forward of a step. The
expectations are derived here from the plan's degrees alone (never from the runtime's sharding code):

- TP (Megatron-LM): column-parallel projections (q/k/v, fused vision qkv, gate/up, fc1 (the audio blocks' too),
  merger ``mlp.0``; Qwen3-VL's ``linear_fc1`` of the MLPs and of every merger) are
  ``Shard(0)`` on the module's TP group, weight and bias, except the LLM's k/v when TP does not divide its KV
  heads (a multiple of them: each KV head replicated over tp / kv ranks, so k/v are whole on every TP rank);
  row-parallel ones (attention output, down, fc2, merger ``mlp.2``, ``linear_fc2``) ``Shard(1)``, bias
  replicated; the embedding and ``lm_head`` are sharded on the vocabulary (dim 0);
  everything else (norms, patch embedding) is replicated.
- EP (a mixture-of-experts LLM with ep x tp > 1): each MoE layer's fused expert weights are ``S(0)`` over their EP
  group (``ep`` consecutive data ranks with all their TP ranks), and under ZeRO also over the ranks holding the same
  experts (efsdp), not over the batch group.
- ZeRO >= 1 with dp * cp * sp > 1: every parameter is also sharded on dim 0 over the module's batch group
  (its ranks with the same TP coordinate); ZeRO-0 adds nothing on that group (plain tensors or Replicate).
- Frozen modules have ``requires_grad=False`` everywhere, trained ones ``True``.
- After a step, every gradient is laid out and shaped as its parameter (a full-size replicated gradient of a
  sharded parameter, as DTensor's own embedding backward gives, wastes the memory the plan counts as sharded).
- FSDP resharding: a block's parameters are sharded before the step's first forward and after the step;
  between a forward and the next block use they stay gathered under ZeRO-1/2 (``reshard_after_forward=False``
  and no resharding until the last micro-batch's backward) and are resharded under ZeRO-3.

A layout is ``{ranks of a mesh axis: "S(dim)"}`` over the axes of size > 1 on which the tensor is sharded
(replicated axes and plain tensors contribute nothing), so equivalent spellings compare equal.
"""

from __future__ import annotations

import re
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from planner.contract.schema import ModulePlan, Plan

Layout = dict[tuple[int, ...], str]
"""Ranks of a mesh axis -> how the tensor is split over them ("S(0)", "S(1)"; anything else is unexpected)."""

COLWISE = re.compile(
    r"(^|\.)(attn\.qkv|self_attn\.[qkv]_proj|mlp\.(shared_expert\.)?(gate_proj|up_proj|fc1|linear_fc1)|merger\.mlp\.0"
    r"|(merger|deepstack_merger_list\.\d+)\.linear_fc1|layers\.\d+\.fc1"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|conv1d))\.(weight|bias)$"
    r"|(^|\.)linear_attn\.(A_log|dt_bias)$"
)
"""Column-parallel linears: output features (dim 0 of weight and bias) split over TP; a Gated DeltaNet's per-head
vectors and depthwise conv channels too."""
ROWWISE_WEIGHT = re.compile(r"(^|\.)(attn\.proj|self_attn\.(o_proj|out_proj)|linear_attn\.out_proj"
                            r"|mlp\.(shared_expert\.)?(down_proj|fc2|linear_fc2)"
                            r"|merger\.mlp\.2|(merger|deepstack_merger_list\.\d+)\.linear_fc2|layers\.\d+\.fc2)"
                            r"\.weight$")
"""Row-parallel linears: input features (dim 1 of the weight) split over TP; their bias is replicated."""
VOCAB_PARALLEL = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
"""Vocabulary-parallel embedding and output projection: vocabulary rows (dim 0) split over TP."""
KV_PROJECTION = re.compile(r"(^|\.)self_attn\.[kv]_proj\.(weight|bias)$")
"""The LLM's key/value projections (replicated over TP when it is a multiple of their heads)."""
EXPERTS = re.compile(r"(^|\.)mlp\.experts\.(gate_up_proj|down_proj)$")
"""A mixture-of-experts layer's fused expert weights [E, ...]: split on the expert dim over the EP group."""
BLOCK = re.compile(r"(^|\.)(blocks|layers)\.\d+$")
"""Transformer blocks: the vision tower's and the decoder's, each an FSDP unit under ZeRO."""


# ---- probes (run inside the actor) ------------------------------------------------------------------
def layout_of(tensor: torch.Tensor) -> Layout:
    """How ``tensor`` is split across ranks (empty for a plain tensor or a replicated DTensor)."""
    if not isinstance(tensor, DTensor):
        return {}
    mesh, layout = tensor.device_mesh, {}
    for axis, placement in enumerate(tensor.placements):
        if mesh.size(axis) == 1 or placement.is_replicate():
            continue
        ranks = tuple(dist.get_process_group_ranks(mesh.get_group(axis)))
        # FSDP marks its dim-0 shard of a parameter TP already splits on dim 0 as strided (interleaved chunks)
        sharded = placement.is_shard() or isinstance(placement, _StridedShard)
        layout[ranks] = f"S({placement.dim})" if sharded else str(placement)
    return layout


def _local_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple((tensor.to_local() if isinstance(tensor, DTensor) else tensor).shape)


def parameter_summary(worker) -> dict[str, Any]:
    """On one actor: its rank, and per module it holds, per parameter: layout, local/global shape, requires_grad,
    and its gradient's layout and local shape (None before a backward)."""
    modules = {}
    for module_name, module in worker.trainer.modules.items():
        modules[module_name] = {
            name: {
                "layout": layout_of(param),
                "local_shape": _local_shape(param),
                "shape": tuple(param.shape),
                "requires_grad": param.requires_grad,
                "grad": None if param.grad is None else (layout_of(param.grad), _local_shape(param.grad)),
            }
            for name, param in module.named_parameters()
        }
    return {"rank": worker.rank, "modules": modules}


def _first_parameter(block: torch.nn.Module) -> tuple[str, Layout]:
    """Name and current layout of the first parameter registered on ``block`` (FSDP swaps the registered
    parameters between the sharded and the gathered ones)."""
    name, param = next(iter(block.named_parameters()))
    return name, layout_of(param)


def _blocks(worker):
    for module_name, module in worker.trainer.modules.items():
        for block_name, block in module.named_modules():
            if BLOCK.search(block_name):
                yield module_name, block_name, block


def install_block_probes(worker) -> int:
    """Record each block's first parameter's layout before (ahead of FSDP's own pre-forward hook) and after (after
    FSDP's post-forward hook) each forward; forwards re-run by recomputation during backward are skipped.
    Returns the number of blocks probed."""
    events: list[tuple[str, str, str, Layout]] = []
    handles = []

    def record(module_name: str, block_name: str, moment: str, block: torch.nn.Module) -> None:
        if torch._C._current_graph_task_id() == -1:  # -1: not inside an autograd backward pass
            events.append((module_name, block_name, moment, _first_parameter(block)[1]))

    for module_name, block_name, block in _blocks(worker):
        where = (module_name, block_name)
        handles.append(block.register_forward_pre_hook(lambda b, _in, w=where: record(*w, "pre", b), prepend=True))
        handles.append(block.register_forward_hook(lambda b, _in, _out, w=where: record(*w, "post", b)))
    worker.block_probes = (events, handles)
    return len(handles) // 2


def collect_block_probes(worker) -> dict[str, Any]:
    """Remove the probes; return the recorded events and each block's first parameter's layout now (after the
    step)."""
    events, handles = worker.block_probes
    for handle in handles:
        handle.remove()
    del worker.block_probes
    after = {(module_name, block_name): _first_parameter(block) for module_name, block_name, block in _blocks(worker)}
    return {"rank": worker.rank, "events": events, "after_step": after}


def call_on_workers(job, fn) -> list[Any]:
    """``fn(actor)`` on every actor of ``job``, in rank order."""
    return ray.get([w.__ray_call__.remote(fn) for w in job.workers])


# ---- expectations (from the plan only) -----------------------------------------------------------------
def stage_ranks(module: ModulePlan, rank: int) -> list[int]:
    """The ranks of ``rank``'s pipeline stage: the module's ranks form a pp x (dp x cp x sp x tp) grid, pp
    outermost (all of them without PP)."""
    size = len(module.ranks) // module.pp
    first = module.ranks.index(rank) // size * size
    return list(module.ranks[first:first + size])


def axis_groups(module: ModulePlan, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(TP group, batch group) of ``rank`` in ``module``: the ranks of its pipeline stage form a dp x cp x sp x tp
    grid, tp innermost; the TP group varies only the TP coordinate, the batch group (gradient sum, ZeRO) only the
    others."""
    ranks = stage_ranks(module, rank)
    index = ranks.index(rank)
    first = index - index % module.tp
    tp_group = tuple(ranks[first : first + module.tp])
    batch_group = tuple(r for i, r in enumerate(ranks) if i % module.tp == index % module.tp)
    return tp_group, batch_group


def tp_split_dim(name: str) -> int | None:
    """Dimension of parameter ``name`` that tensor parallelism splits, or None when TP replicates it."""
    if COLWISE.search(name) or VOCAB_PARALLEL.search(name):
        return 0
    if ROWWISE_WEIGHT.search(name):
        return 1
    return None


def kv_heads(plan: Plan) -> int:
    """The LLM's key/value heads, from the plan's model config."""
    config = plan.model.hf_config
    return config.get("text_config", config)["num_key_value_heads"]


def num_experts(plan: Plan) -> int:
    """Routed experts of each of the LLM's MoE layers (0 for a dense LLM), from the plan's model config."""
    config = plan.model.hf_config
    return config.get("text_config", config).get("num_experts", 0)


def expert_groups(module: ModulePlan, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(EP group, efsdp group) of ``rank``: ``ep x tp`` consecutive ranks of its stage split the experts; the ranks
    at the same place in the other EP groups hold the same experts."""
    ranks, size = stage_ranks(module, rank), module.ep * module.tp
    index = ranks.index(rank)
    first = index - index % size
    return tuple(ranks[first:first + size]), tuple(r for i, r in enumerate(ranks) if i % size == index % size)


def expected_layout(module: ModulePlan, rank: int, name: str, *, kv_heads: int, gathered: bool = False,
                    experts: int = 0) -> Layout:
    """The layout the plan implies for parameter ``name`` of ``module`` on ``rank`` (of a model with ``kv_heads``
    LLM key/value heads and ``experts`` routed experts per MoE layer); ``gathered``: as FSDP holds it between its
    all-gather and its reshard (no batch-group shard). Split experts (``ep x tp > 1``) are ``S(0)`` over their EP
    group, and under ZeRO over their efsdp group."""
    tp_group, batch_group = axis_groups(module, rank)
    layout: Layout = {}
    if module.name == "llm" and experts and module.ep * module.tp > 1 and EXPERTS.search(name):
        ep_group, efsdp_group = expert_groups(module, rank)
        layout[ep_group] = "S(0)"
        if module.zero >= 1 and len(efsdp_group) > 1 and len(batch_group) > 1 and not gathered:
            layout[efsdp_group] = "S(0)"
        return layout
    replicated_kv = module.name == "llm" and kv_heads % module.tp != 0 and KV_PROJECTION.search(name)
    dim = None if replicated_kv else tp_split_dim(name)
    if module.tp > 1 and dim is not None:
        layout[tp_group] = f"S({dim})"
    if module.zero >= 1 and len(batch_group) > 1 and not gathered:
        layout[batch_group] = "S(0)"
    return layout


def local_shape(shape: tuple[int, ...], layout: Layout, rank: int) -> tuple[int, ...]:
    """Shape of ``rank``'s shard of a ``shape`` tensor split as ``layout``: ``torch.chunk``'s pieces, as DTensor and
    FSDP2 cut a dim that does not divide evenly (Qwen3.5-MoE's one-row shared-expert gate over 2 ranks: 1 and 0)."""
    local = list(shape)
    for ranks, split in layout.items():
        dim = int(split[2:-1])
        size = -(-local[dim] // len(ranks))
        local[dim] = max(0, min(size, local[dim] - ranks.index(rank) * size))
    return tuple(local)


def assert_parameters_sharded_as_planned(plan: Plan, summaries: list[dict[str, Any]]) -> None:
    """Every rank holds exactly its planned modules, each parameter laid out and shaped as the plan implies."""
    for summary in summaries:
        rank = summary["rank"]
        planned = {m.name for m in plan.modules if rank in m.ranks}
        assert set(summary["modules"]) == planned, f"rank {rank} holds {sorted(summary['modules'])}, not {planned}"
        for module_name, params in summary["modules"].items():
            module = plan.module(module_name)
            assert params, f"rank {rank}: {module_name} has no parameters"
            for name, p in params.items():
                where = f"rank {rank} {module_name} {name}"
                expected = expected_layout(module, rank, name, kv_heads=kv_heads(plan), experts=num_experts(plan))
                assert p["layout"] == expected, f"{where}: layout {p['layout']}, plan implies {expected}"
                assert p["local_shape"] == local_shape(p["shape"], expected, rank), (
                    f"{where}: local shard {p['local_shape']} of {p['shape']}, plan implies "
                    f"{local_shape(p['shape'], expected, rank)}"
                )
                assert p["requires_grad"] == (not module.frozen), f"{where}: requires_grad {p['requires_grad']}"
            if module.pp > 1:
                assert_holds_its_stage(module, rank, set(params))


DECODER_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
"""A decoder layer's parameter, with the layer's HF index."""


def assert_holds_its_stage(module: ModulePlan, rank: int, names: set[str]) -> None:
    """A pipeline rank holds exactly the decoder layers of its model chunks (stage s: chunks s, s + pp, ...; chunk
    c the ``pp_layers[c]`` layers after the previous chunks'), the embedding only on the first stage, the final
    norm and lm_head only on the last."""
    stage = module.ranks.index(rank) // (len(module.ranks) // module.pp)
    starts = [sum(module.pp_layers[:c]) for c in range(len(module.pp_layers) + 1)]
    chunks = range(stage, len(module.pp_layers), module.pp)
    planned = {i for c in chunks for i in range(starts[c], starts[c + 1])}
    held = {int(m.group(2)) for name in names if (m := DECODER_LAYER.search(name))}
    assert held == planned, f"rank {rank} (stage {stage}) holds decoder layers {sorted(held)}, plan: {sorted(planned)}"
    parts = {"embed_tokens": r"\.embed_tokens\.", "lm_head": r"(^|\.)lm_head\.", "final norm": r"language_model\.norm\."}
    has = {part: any(re.search(pattern, name) for name in names) for part, pattern in parts.items()}
    last = len(module.pp_layers) - 1 in chunks
    expected = {"embed_tokens": 0 in chunks, "lm_head": last, "final norm": last}
    assert has == expected, f"rank {rank} (stage {stage}) holds {has}, plan: {expected}"


def assert_gradients_sharded_as_parameters(summaries: list[dict[str, Any]]) -> None:
    """After a step, every trained parameter's gradient has its parameter's layout and local shape."""
    for summary in summaries:
        for module_name, params in summary["modules"].items():
            for name, p in params.items():
                if p["requires_grad"]:
                    where = f"rank {summary['rank']} {module_name} {name}"
                    assert p["grad"] is not None, f"{where}: no gradient after a step"
                    assert p["grad"] == (p["layout"], p["local_shape"]), (
                        f"{where}: gradient {p['grad']}, parameter {(p['layout'], p['local_shape'])}"
                    )


def expected_block_events(module: ModulePlan, rank: int, name: str, kv_heads: int) -> list[tuple[str, Layout]]:
    """(moment, layout) of a block's first parameter ``name`` around each forward of one step: sharded before the
    first forward; after a forward (and so before the next one) resharded under ZeRO-3, gathered under ZeRO-1/2."""
    sharded = expected_layout(module, rank, name, kv_heads=kv_heads)
    between = sharded if module.zero == 3 else expected_layout(module, rank, name, kv_heads=kv_heads, gathered=True)
    events = []
    for micro in range(module.grad_accum):
        events += [("pre", sharded if micro == 0 else between), ("post", between)]
    return events


def assert_reshard_as_planned(plan: Plan, summaries: list[dict[str, Any]]) -> None:
    """FSDP's reshard behaviour per ZeRO stage, from the block probes of one step (``collect_block_probes``)."""
    for summary in summaries:
        rank = summary["rank"]
        assert summary["after_step"], f"rank {rank}: no transformer block found"
        seen: dict[tuple[str, str], list[tuple[str, Layout]]] = {block: [] for block in summary["after_step"]}
        for module_name, block_name, moment, layout in summary["events"]:
            seen[module_name, block_name].append((moment, layout))
        for (module_name, block_name), events in seen.items():
            module = plan.module(module_name)
            if module.pp > 1:  # the schedule runs a shape-inference forward and manages FSDP's sync itself
                continue
            name, after = summary["after_step"][module_name, block_name]
            expected = expected_block_events(module, rank, name, kv_heads(plan))
            where = f"rank {rank} {module_name} {block_name} (ZeRO-{module.zero}, {module.grad_accum} micro-batches)"
            assert events == expected, f"{where}: {name} around its forwards {events}, plan implies {expected}"
            assert after == expected[0][1], f"{where}: {name} after the step {after}, plan implies {expected[0][1]}"

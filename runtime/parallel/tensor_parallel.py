"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with DTensor ``parallelize_module``.

Per block: q/k/v (or the fused vision ``qkv``) and the MLP's gate/up projections are column-parallel, the output
projections row-parallel, so each block needs one all-reduce forward and one backward. When the TP degree is a
multiple of the LLM's key/value heads (Qwen2.5-VL-3B has 2, TP up to 8), k/v are not split but replicated
(``ReplicatedHeadsColwise``), as Megatron-LM and vLLM do for grouped-query attention. The LLM's embedding is
vocab-parallel (row-parallel over the vocabulary) and ``lm_head`` column-parallel with its logits left sharded
on the vocabulary, for ``loss_parallel``. Norms stay replicated.

The vision ``qkv`` projection is fused as [3, heads, head_dim] rows; before sharding its rows are reordered to
[tp, 3, heads/tp, head_dim] so that each rank's column slice holds its own q, k and v heads
(``qkv_to_tp_layout``; its row order, ``qkv_row_order``, is undone when parameters are gathered to HF layout).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from planner.contract.rules import heads_rule

LLM_BLOCK_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}
"""A decoder layer whose key/value heads the TP degree divides."""


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (Megatron-LM's "f" operator)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReplicatedHeadsColwise(ParallelStyle):
    """A k/v projection of ``num_heads`` heads over a TP degree that is a multiple of them: weight and bias stay
    whole (``Replicate``) on every rank, each rank projects its query heads' own KV head, rank r's being head
    ``r // (tp / num_heads)`` (the head its contiguous block of query heads reads). In backward the gradients of
    the weight and bias (each rank's holds only its head's rows) and of the replicated input (each rank's is its
    heads' share) are summed over the TP ranks, an all-reduce each per micro-batch (priced by the planner's
    ``replicated_kv_backward_time``). Input replicated, output the rank's head, local."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.data, device_mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        module.num_heads = self.num_heads
        module.head_of_rank = device_mesh.get_local_rank() // (device_mesh.size() // self.num_heads)
        module.forward = types.MethodType(_own_head_projection, module)
        return module


def _own_head_projection(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear`` (``ReplicatedHeadsColwise``) applied to ``x`` for this rank's KV head only."""
    group = linear.weight.device_mesh.get_group()
    rows = linear.weight.shape[0] // linear.num_heads
    own = slice(linear.head_of_rank * rows, (linear.head_of_rank + 1) * rows)
    weight = _SumGradients.apply(linear.weight.to_local(), group)[own]
    bias = None if linear.bias is None else _SumGradients.apply(linear.bias.to_local(), group)[own]
    x = _SumGradients.apply(x.to_local() if isinstance(x, DTensor) else x, group)  # each rank's share of dL/dx
    return F.linear(x, weight, bias)


class ReplicatedWeightSummedGradients(ParallelStyle):
    """A module whose weights stay whole on every TP rank but see only the rank's share of the input (a q/k norm
    over each head's width, applied to the rank's own heads): every forward runs the module's own ``forward`` with
    each parameter passed through ``_SumGradients``, so its gradient, each rank's share, is summed over the TP
    ranks (one all-reduce per parameter per micro-batch; transformers' Qwen3 plan calls it
    ``replicated_with_grad_allreduce``). The parameters stay plain tensors, as the other norms', so FSDP shards
    them alike."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        forward = type(module).forward

        def summed_forward(self_, *args, **kwargs):
            params = {name: _SumGradients.apply(p, group) for name, p in self_.named_parameters(recurse=False)}
            return forward(_WithParameters(self_, params), *args, **kwargs)

        module.forward = types.MethodType(summed_forward, module)
        return module


class _WithParameters:
    """``module`` seen with some of its parameters replaced (the ``self`` its class's forward reads)."""

    def __init__(self, module: nn.Module, params: dict[str, torch.Tensor]):
        self._module, self._params = module, params

    def __getattr__(self, name: str):
        return self._params[name] if name in self._params else getattr(self._module, name)


def qkv_to_tp_layout(t: torch.Tensor, tp: int) -> torch.Tensor:
    """Rows [3, tp, h, Dh] -> [tp, 3, h, Dh] (h = heads / tp) of a fused qkv weight or bias."""
    return t.reshape(3, tp, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def qkv_row_order(rows: int, tp: int) -> torch.Tensor:
    """HF row of each row of a qkv weight or bias stored in TP layout (``qkv_to_tp_layout`` of the row indexes)."""
    return qkv_to_tp_layout(torch.arange(rows), tp)


def _check_divisible(what: str, count: int, tp: int) -> None:
    if count % tp:
        raise ValueError(f"tensor-parallel degree {tp} does not divide the {count} {what}")


@torch.no_grad()
def _reorder_qkv(attn: nn.Module, tp: int) -> None:
    attn.qkv.weight.copy_(qkv_to_tp_layout(attn.qkv.weight, tp))
    attn.qkv.bias.copy_(qkv_to_tp_layout(attn.qkv.bias, tp))
    attn.num_heads //= tp


def parallelize_vision_tp(visual: nn.Module, mesh: DeviceMesh, plans: list[tuple[nn.Module, dict]]) -> None:
    """Shard every vision block and the mergers' MLPs over the ``tp`` mesh by ``plans`` (the family's
    ``vision_tp_plans``: (submodule, plan) pairs), each block's fused qkv rows put in TP layout first."""
    tp = mesh.size()
    _check_divisible("vision attention heads", visual.config.num_heads, tp)
    for block in visual.blocks:
        _reorder_qkv(block.attn, tp)
    for module, plan in plans:
        parallelize_module(module, mesh, plan)


class VocabParallelEmbedding(RowwiseParallel):
    """``RowwiseParallel`` for ``nn.Embedding`` (weight ``Shard(0)`` over the vocabulary) whose lookup runs on each
    rank's own rows, as Megatron-LM's VocabParallelEmbedding: ids outside the rank's range give zero rows, the
    ``Partial`` sum over ranks is the full lookup. DTensor's own embedding backward gives the weight a
    ``Replicate`` gradient of the full table on every rank (torch 2.13; 2.9 GiB fp32 at Qwen2.5-VL-32B's
    152,064 x 5,120 under TP8); here the gradient is the rank's ``Shard(0)`` rows only."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.forward = types.MethodType(_local_rows_lookup, module)
        return module


def _local_rows_lookup(embedding: nn.Embedding, ids: DTensor) -> DTensor:
    """The embedding of replicated ``ids`` from this rank's vocabulary rows, as a ``Partial`` DTensor."""
    weight = embedding.weight.to_local()
    mesh = embedding.weight.device_mesh
    first = mesh.get_local_rank() * weight.shape[0]
    local_ids = ids.to_local() - first
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])
    padding = embedding.padding_idx
    padding = padding - first if padding is not None and 0 <= padding - first < weight.shape[0] else None
    rows = F.embedding(local_ids.masked_fill(outside, 0), weight, padding_idx=padding)
    rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(rows, mesh, [Partial()], run_check=False)


def parallelize_llm_tp(llm: nn.Module, mesh: DeviceMesh, family: Any) -> None:
    """Shard the decoder blocks (the common plan and the family's ``llm_layer_tp_plan``), the embedding
    (vocab-parallel) and lm_head (logits sharded on vocab); a pipeline chunk (runtime.models.pipeline) has the embedding
    only on the first stage and lm_head only on the last."""
    tp = mesh.size()
    config = llm.language_model.config
    problem = heads_rule(tp, "tensor-parallel degree", config.num_attention_heads, config.num_key_value_heads, "the LLM")
    if problem:
        raise ValueError(problem)
    _check_divisible("vocabulary entries", config.vocab_size, tp)
    embedding, lm_head = getattr(llm.language_model, "embed_tokens", None), getattr(llm, "lm_head", None)
    tied = embedding is not None and lm_head is not None and lm_head.weight is embedding.weight
    plan = {}
    if embedding is not None:
        plan["language_model.embed_tokens"] = VocabParallelEmbedding(input_layouts=Replicate())
    if lm_head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(llm, mesh, plan)
    if tied:  # both are sharded on the vocabulary dim, so the shards can stay shared
        llm.lm_head.weight = llm.language_model.embed_tokens.weight
    layers = llm.language_model.layers
    block_plan = {**LLM_BLOCK_PLAN, **family.llm_layer_tp_plan}
    kv_heads = config.num_key_value_heads
    if kv_heads % tp:
        replicated = ReplicatedHeadsColwise(kv_heads)
        block_plan = {**block_plan, "self_attn.k_proj": replicated, "self_attn.v_proj": replicated}
    dense_mlp = {k: v for k, v in block_plan.items() if k not in LLM_BLOCK_PLAN or not k.startswith("mlp.")}
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        # a mixture-of-experts MLP is not TP-split as a dense one: its router stays whole, its experts go to
        # runtime.parallel.experts (a shared expert beside them takes the family's plan)
        plan = block_plan if hasattr(block.mlp, "gate_proj") else dense_mlp
        # a hybrid decoder's layer has one kind of token mixer (Qwen3.5: self_attn or linear_attn)
        parallelize_module(block, mesh, {k: v for k, v in plan.items() if hasattr(block, k.split(".")[0])})
        if kv_heads % tp:  # one KV head for the rank's config.num_attention_heads / tp query heads
            block.self_attn.num_key_value_groups = config.num_attention_heads // tp

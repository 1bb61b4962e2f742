"""Expert parallelism (EP) of a mixture-of-experts decoder, with transformers' own implementation.

``transformers.distributed.expert_parallel`` does the work: ``apply_expert_parallelism`` shards each MoE layer's
fused expert weights on the expert dim over an EP group (``grouped_gemm``: ``Shard(0)``, the module's
``num_experts`` becomes its local count) and routes its tokens (``ep_dispatch_experts`` with ``AllToAllEP``): the
(token, expert) pairs sorted by expert, one ``all_to_all_single`` with variable splits to the experts' ranks, the
local experts as grouped GEMMs (``torch._grouped_mm``, the model's ``grouped_mm`` experts implementation), a second
all-to-all back, the routing weights applied on the sender. The TP ranks of a batch share its tokens, so each sends
only its slice of them and the outputs are all-gathered over TP: an EP group is ``ep`` data ranks with all their TP
ranks, ``ep x tp`` ranks holding ``1 / (ep * tp)`` of the experts each (torchtitan's ``etp = 1``).

This module adds what a trainer needs around it: FSDP2 of the experts over the ranks holding the same ones
(``efsdp``), their gradient sum without ZeRO, and ``RouterStats``: the routers' token counts (metrics: tokens per
expert, the busiest EP rank's load over the mean) and transformers' load-balancing loss (Switch Transformer,
``load_balancing_loss_func``) over the micro-batch's tokens on all the module's data ranks.

Shape legend: T tokens, E experts, L MoE layers.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers.distributed.expert_parallel import apply_expert_parallelism

from runtime.parallel.parallel_dims import ParallelDims

EP_IMPLEMENTATION = "all_to_all"
"""transformers' ``EPImplementationInterface`` entry: token all-to-alls (the one that trains)."""


def experts_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed-experts module under ``module``: fused 3-D ``gate_up_proj`` and
    ``down_proj`` (transformers' ``@use_experts_implementation`` classes)."""
    return [(name, m) for name, m in module.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and hasattr(m, "num_experts")]


MOE_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.mlp$")
"""A decoder layer's MLP (module name), with the layer's HF index (a pipeline chunk keeps it)."""


def moe_blocks(module: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, sparse MoE block) under ``module``: a ``gate`` router beside the ``experts``."""
    return [(int(match.group(2)), m) for name, m in module.named_modules()
            if (match := MOE_LAYER.search(name)) and isinstance(getattr(m, "experts", None), nn.Module)
            and hasattr(getattr(m, "gate", None), "top_k")]


def apply_expert_parallel(module: nn.Module, dims: ParallelDims) -> None:
    """Split the experts of every MoE layer under ``module`` over the EP group (``dims.expert_mesh["ep"]``) and
    route their tokens there."""
    assert dims.expert_mesh is not None and dims.mesh is not None, "build_mesh first"
    plan = {}
    for name, _ in experts_modules(module):
        plan |= {f"{name}.gate_up_proj": "grouped_gemm", f"{name}.down_proj": "grouped_gemm",
                 name: "ep_dispatch_experts"}
    apply_expert_parallelism(module, dims.expert_mesh["ep"], dims.mesh["tp"], plan,
                             ep_implementation=EP_IMPLEMENTATION)


def shard_experts(module: nn.Module, dims: ParallelDims, *, zero: int, mp_policy: MixedPrecisionPolicy | None
                  ) -> None:
    """ZeRO of the split experts: each experts module its own FSDP unit over ``efsdp`` (the enclosing blocks' FSDP
    then leaves their weights alone; runtime.parallel.fsdp ``apply_fsdp`` sets every unit's gradient sum), as
    torchtitan shards experts over its ``edp`` mesh."""
    for _, experts in experts_modules(module):
        fully_shard(experts, mesh=dims.expert_mesh["efsdp"], reshard_after_forward=zero == 3,
                    mp_policy=mp_policy or MixedPrecisionPolicy())


def expert_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The routed experts' weights under ``module``."""
    return {p for _, experts in experts_modules(module) for p in experts.parameters()}


class RouterStats:
    """What the routers of the MoE layers under a module chose, per micro-batch: forward hooks on each router
    (``(logits [T, E], weights, indices [T, k])``) keep the expert counts (no gradient) and the summed routing
    probabilities (with gradient, for the balancing loss) while ``recording``."""

    def __init__(self, module: nn.Module, num_experts: int, *, probabilities: bool):
        """``probabilities``: also sum the routing probabilities (for ``balancing_loss``)."""
        self.num_experts, self.probabilities = num_experts, probabilities
        self.recording = False
        self.counts: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.rows = 0
        self.layer_counts: dict[int, torch.Tensor] = {}
        """Tokens per expert of each decoder layer (HF index) summed over the step so far."""
        for layer, block in moe_blocks(module):
            block.gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def record(_router, _inputs, output):
            logits, _, indices = output
            # summed whenever asked for, so that recomputing a layer saves the tensors its forward saved
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).sum(0) if self.probabilities else None
            if not self.recording or torch._C._current_graph_task_id() != -1:
                return  # not asked, or recomputed inside a backward (counted at its forward)
            flat = indices.reshape(-1)  # counted by a scatter: a fixed output shape (the dry-run's fake tensors)
            counts = torch.zeros(self.num_experts, device=flat.device).scatter_add_(
                0, flat, torch.ones_like(flat, dtype=torch.float32))
            self.counts.append(counts)
            if probs is not None:
                self.probs.append(probs)
            self.rows += logits.shape[0]
            done = self.layer_counts.get(layer)
            self.layer_counts[layer] = counts if done is None else done + counts
        return record

    def start(self) -> None:
        """Record the routers of the forwards that follow (a micro-batch's, or a pipeline schedule's)."""
        self.counts, self.probs, self.rows, self.recording = [], [], 0, True

    def stop(self) -> None:
        """Stop recording; the routing probabilities (and the graph they hold) are dropped."""
        self.recording, self.probs = False, []

    def balancing_loss(self, group: dist.ProcessGroup | None, targets: torch.Tensor, num_tokens: torch.Tensor
                       ) -> torch.Tensor:
        """This rank's share of transformers' load-balancing loss of the micro-batch just recorded:
        ``E * sum_e f_e P_e`` with ``f_e`` the share of routed slots expert ``e`` got and ``P_e`` its mean routing
        probability, both over every MoE layer and every token of the micro-batch on the module's data ranks
        (``group``; Fedus et al. 2022, Switch Transformer, eqs. 4-6). ``f`` is summed over the group first; the
        rank's own ``P`` share makes the shares sum to the whole. Weighted by the micro-batch's share of the
        step's ``num_tokens`` targets (``targets``: this rank's), as the step's cross-entropy is."""
        counts = torch.stack(self.counts).sum(0)  # on the routers' device, as are the targets: no host sync
        totals = torch.cat([counts, counts.new_tensor([self.rows]), targets.reshape(1).to(counts)])
        if group is not None:
            dist.all_reduce(totals, group=group)
        counts, rows, micro_targets = totals[:-2], totals[-2], totals[-1]
        probs = torch.stack(self.probs).sum(0)
        share = self.num_experts * (counts / rows * probs.to(counts.device) / rows).sum()
        return share * micro_targets / num_tokens

    def step_counts(self, layers: list[int], groups: list[dist.ProcessGroup]) -> torch.Tensor:
        """Tokens per expert of each of the model's MoE ``layers`` (decoder layer indices, ``moe_layers``) [L, E]
        over the step, summed over ``groups`` (the data ranks, then the pipeline stages, which hold the other
        layers); starts the next step's count."""
        device = next(iter(self.layer_counts.values())).device if self.layer_counts else torch.device("cpu")
        counts = torch.zeros(len(layers), self.num_experts, device=device)
        for layer, value in self.layer_counts.items():
            counts[layers.index(layer)] = value
        for group in groups:
            dist.all_reduce(counts, group=group)
        self.layer_counts = {}
        return counts


def moe_layers(text_config) -> list[int]:
    """Indices of the decoder layers with routed experts (transformers' ``Qwen3VLMoeTextDecoderLayer`` rule: not in
    ``mlp_only_layers``, and every ``decoder_sparse_step``-th)."""
    step = getattr(text_config, "decoder_sparse_step", 1)  # Qwen3.5-MoE has neither: every layer is sparse
    dense = set(getattr(text_config, "mlp_only_layers", ()))
    return [i for i in range(text_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def busiest_rank_load(counts_LE: torch.Tensor, ranks: int) -> float:
    """The busiest of ``ranks`` EP ranks' routed tokens over the mean, averaged over the MoE layers: each rank
    holds ``E / ranks`` consecutive experts (transformers' ``Shard(0)``). What the planner's ``moe_load_imbalance``
    assumes."""
    loads = counts_LE.reshape(counts_LE.shape[0], ranks, -1).sum(-1)
    return float((loads.max(-1).values / loads.mean(-1)).mean())

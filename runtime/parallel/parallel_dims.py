"""Per-module parallel degrees read from the Plan, and the device mesh each module runs on.

A module's ranks form a ``pp x dp x cp x sp x tp`` grid (tp innermost, pp outermost: each pipeline stage is a
block of consecutive ranks), as the planner lays them out. Two meshes are built over it: ``mesh`` with axes
(``dp_cp_sp``, ``tp``), and ``pp`` in front when the module is pipelined — the root that FSDP (on ``dp_cp_sp``, the
module's data-parallel / gradient-sum group within a stage), TP (on ``tp``) and the pipeline (on ``pp``) share, as
torchtitan composes them — and ``grid_mesh`` with the named axes, for the SP and DP groups. A mixture-of-experts
LLM adds ``expert_mesh`` ([pp,] ``efsdp``, ``ep``): each MoE layer's experts are split over ``ep x tp`` ranks (an EP
group: ``ep`` consecutive data ranks of a stage with all their TP ranks, torchtitan's ``etp = 1``), and each expert's
weights are sharded by FSDP over the ``efsdp = dp * sp / ep`` groups holding the same experts. (All are built
directly rather than by flattening a slice:
flattening creates process groups that every rank of the world, including ranks outside a disjoint module,
would have to join.) The runtime never re-decides any of these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo

from planner.contract.schema import ModulePlan, Plan
from runtime.parallel.ring import RingGroup
from runtime.run.preflight import context_parallel_refusal

AXES = ("pp", "dp", "cp", "sp", "tp")
"""Grid axis names, outermost first (``pp`` is a mesh axis only when the module is pipelined)."""

BATCH_AXIS = "dp_cp_sp"
"""Flattened axis over which a module's gradients are summed and ZeRO shards."""


@dataclass(kw_only=True)
class ParallelDims:
    """Degrees of one module and, once built, its mesh."""

    name: str
    """Module name in the plan (``vision``, ``llm``)."""
    ranks: tuple[int, ...]
    """Global ranks of the module, in grid order."""
    dp: int
    """Data-parallel degree."""
    cp: int
    """Context-parallel degree."""
    sp: int
    """Ulysses sequence-parallel degree."""
    tp: int
    """Tensor-parallel degree."""
    zero: int
    """ZeRO stage over dp (x sp), see runtime.parallel.fsdp."""
    recompute: str
    """none / selective / full."""
    micro_batch: int
    """Samples per micro-batch per DP replica."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    pp: int = 1
    """Pipeline stages."""
    pp_schedule: str = "1f1b"
    """1f1b or interleaved_1f1b (runtime.models.pipeline)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank."""
    pp_layers: tuple[int, ...] = ()
    """Decoder layers of each model chunk, in pipeline order (chunk c on stage c % pp)."""
    frozen: bool = False
    """Weights are not trained: no gradients, no optimizer (the module still passes gradients through)."""
    ep: int = 1
    """Expert-parallel degree over the stage's data ranks (dp * sp)."""
    experts: int = 0
    """Routed experts of each of the module's MoE layers (0: none)."""
    mesh: DeviceMesh | None = field(default=None, repr=False)
    """([pp,] dp_cp_sp, tp) mesh, the root of FSDP, TP and the pipeline (``build_mesh``)."""
    grid_mesh: DeviceMesh | None = field(default=None, repr=False)
    """([pp,] dp, cp, sp, tp) mesh (``build_mesh``)."""
    expert_mesh: DeviceMesh | None = field(default=None, repr=False)
    """([pp,] efsdp, ep) mesh of a module whose experts are split (``experts_split``; ``build_mesh``): ``ep`` the
    ``ep x tp`` ranks of an EP group, ``efsdp`` the groups holding the same experts."""

    def __post_init__(self) -> None:
        if len(self.ranks) != self.num_devices:
            raise ValueError(f"{self.name}: {len(self.ranks)} ranks for pp*dp*cp*sp*tp = {self.num_devices}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"{self.name}: a rank appears twice in {self.ranks}")
        if self.cp > 1 and (problem := context_parallel_refusal(self.name, self.cp, pp=self.pp)):
            raise NotImplementedError(problem)

    @classmethod
    def from_plan(cls, module: ModulePlan, experts: int = 0) -> "ParallelDims":
        """The degrees a plan gives one module; ``experts``: routed experts of its MoE layers (``plan_experts``)."""
        return cls(
            name=module.name, ranks=tuple(module.ranks), dp=module.dp, cp=module.cp, sp=module.sp, tp=module.tp,
            zero=module.zero, recompute=module.recompute, micro_batch=module.micro_batch,
            grad_accum=module.grad_accum, frozen=module.frozen, pp=module.pp, pp_schedule=module.pp_schedule,
            virtual_stages=module.virtual_stages, pp_layers=tuple(module.pp_layers or ()), ep=module.ep,
            experts=experts,
        )

    @property
    def experts_split(self) -> bool:
        """The module's experts are split over ``ep x tp > 1`` ranks (expert parallelism, runtime.parallel.experts)."""
        return self.experts > 0 and self.ep * self.tp > 1

    @property
    def expert_fsdp_degree(self) -> int:
        """Ranks holding the same experts (``efsdp``): their gradients are summed, ZeRO shards over them."""
        return self.batch_degree // self.ep

    @property
    def num_devices(self) -> int:
        return self.pp * self.stage_devices

    @property
    def stage_devices(self) -> int:
        """Ranks of one pipeline stage (all of them without PP): dp * cp * sp * tp."""
        return self.dp * self.cp * self.sp * self.tp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def stage_of(self, rank: int) -> int:
        """The pipeline stage a global rank of this module runs."""
        return self.ranks.index(rank) // self.stage_devices

    def stage_view(self, stage: int) -> "ParallelDims":
        """The degrees of one pipeline stage's ranks alone (pp = 1, no mesh): what the hand-off routes to (stage
        0)."""
        ranks = self.ranks[stage * self.stage_devices:(stage + 1) * self.stage_devices]
        return replace(self, ranks=ranks, pp=1, pp_schedule="1f1b", virtual_stages=1, pp_layers=(), mesh=None,
                       grid_mesh=None, expert_mesh=None)

    @property
    def batch_degree(self) -> int:
        """Ranks that share weights and sum gradients: dp * cp * sp."""
        return self.dp * self.cp * self.sp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def sequence_ranks(self) -> int:
        """Ranks one sequence is split over: cp * sp (CP outer: ``sequence_rank``)."""
        return self.cp * self.sp

    def sequence_rank(self, rank: int) -> int:
        """Which of the ``sequence_ranks`` parts of a sequence a global rank of this module holds."""
        coord = self.coordinate(rank)
        return coord["cp"] * self.sp + coord["sp"]

    def ring_group(self) -> RingGroup | None:
        """The CP group this module's ring attention runs over (runtime.parallel.ring); None without CP."""
        if self.cp == 1:
            return None
        return RingGroup(self.grid_mesh["cp"])

    @property
    def batch_enabled(self) -> bool:
        return self.batch_degree > 1

    def coordinate(self, rank: int) -> dict[str, int]:
        """Grid position of a global rank of this module, e.g. ``{"pp": 0, "dp": 1, "cp": 0, "sp": 0, "tp": 1}``."""
        index = self.ranks.index(rank)
        coord = {}
        for axis, size in zip(reversed(AXES), reversed([self.pp, self.dp, self.cp, self.sp, self.tp])):
            coord[axis] = index % size
            index //= size
        return {axis: coord[axis] for axis in AXES}

    def ranks_where(self, **fixed: int) -> list[int]:
        """Global ranks whose grid coordinates match ``fixed`` (e.g. ``dp=0, tp=0``)."""
        return [r for r in self.ranks if all(self.coordinate(r)[k] == v for k, v in fixed.items())]

    def build_mesh(self, device_type: str) -> None:
        """Create the module's meshes; every rank of the world must call this, for every module, in the same
        order (creating a process group is collective), and only the module's ranks may slice them."""
        grid = torch.tensor(self.ranks).view(self.pp, self.dp, self.cp, self.sp, self.tp)
        if self.experts_split:
            experts = grid.view(self.pp, self.expert_fsdp_degree, self.ep * self.tp)
            if self.pp_enabled:
                self.expert_mesh = DeviceMesh(device_type, experts, mesh_dim_names=("pp", "efsdp", "ep"))
            else:
                self.expert_mesh = DeviceMesh(device_type, experts[0], mesh_dim_names=("efsdp", "ep"))
        if self.pp_enabled:
            self.mesh = DeviceMesh(device_type, grid.view(self.pp, self.batch_degree, self.tp),
                                   mesh_dim_names=("pp", BATCH_AXIS, "tp"))
            self.grid_mesh = DeviceMesh(device_type, grid, mesh_dim_names=AXES)
            return
        self.mesh = DeviceMesh(device_type, grid.view(self.batch_degree, self.tp), mesh_dim_names=(BATCH_AXIS, "tp"))
        self.grid_mesh = DeviceMesh(device_type, grid[0], mesh_dim_names=AXES[1:])

    def __str__(self) -> str:
        pipeline = f"PP{self.pp}-" if self.pp_enabled else ""
        experts = f"-EP{self.ep}" if self.ep > 1 else ""
        return (
            f"{self.name}: {pipeline}DP{self.dp}-CP{self.cp}-SP{self.sp}-TP{self.tp}{experts} ZeRO{self.zero} "
            f"rc={self.recompute} mb={self.micro_batch} ga={self.grad_accum} ranks={list(self.ranks)}"
        )


def plan_experts(plan: Plan, name: str) -> int:
    """Routed experts of each MoE layer of module ``name`` (the LLM's ``num_experts``; 0 for a dense module)."""
    text = plan.model.hf_config.get("text_config", plan.model.hf_config)
    return int(text.get("num_experts", 0) or 0) if name == "llm" else 0


def plan_dims(plan: Plan, name: str) -> ParallelDims:
    """The degrees a plan gives module ``name``, its experts included."""
    return ParallelDims.from_plan(plan.module(name), experts=plan_experts(plan, name))


def forget_earlier_worlds() -> None:
    """Empty DTensor's caches that hold an earlier world's meshes, before a process builds the meshes of another
    world (a dry-run role, a reused worker's next job):
    - sharding propagation (C++ and Python) keys on a DeviceMesh's description (rank map, layout, names), not its
      process groups, so an earlier world's output specs would hand this world's tensors that world's meshes:
      their groups are gone (role 2 then role 0 of a PP2 x TP2 plan fails to resolve one);
    - redistribution plans and mesh topologies hold the meshes themselves, and through them every gloo process
      group of every earlier job with its threads (a pooled worker held 111 gloo loop threads by the end of the test suite)."""
    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()

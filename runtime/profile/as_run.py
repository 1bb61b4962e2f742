"""Layer shards timed AS THE RUNTIME RUNS THEM: ``tp * sp`` processes, the runtime's own sharding.

A single-process shard (runtime.profile.shards) times one rank's arithmetic; the cost model then adds the
collectives from its link model. What a sharded layer really costs also holds DTensor's per-op dispatch, the
collectives as actually issued (gloo between local processes on CPU, NCCL on GPUs) and, on a CPU, the ranks
contending for the host's cores. Here each degree spawns ``tp * sp`` ranks (torch.multiprocessing, like the
collectives benchmark); every rank builds each layer type at FULL size from transformers' own classes with the
runtime's attention kernel, shards it with the runtime's own functions -- ``parallelize_vision_tp`` /
``parallelize_llm_tp`` (DTensor ``parallelize_module``) for TP, the runtime's sequence split and the Ulysses
all-to-all (``ulysses_group``) for SP, ``loss_parallel`` for the TP lm_head loss -- and times forward, backward, the
extra backward of full recomputation and the optimizer step over the rank's (DTensor) parameters. An iteration's
time is the slowest rank's; the point records the median (and spread) over the repeats after warm-up, flagged
``includes_comm``.

Covered: TP over every layer type, Ulysses SP over the vision tower (``shard_vision_batch``) and the LLM
(``shard_llm_batch``); TP x SP at once is still timed single-process. FLOPs and memory are per rank and come from the single-process shard on fake
tensors (runtime.profile.measure.analyze_fake). Rank 0 appends each point to the profile file as soon as it is
measured, so an interrupted sweep resumes where it stopped.

Legend: B micro-batch, S tokens per sample, n this rank's packed vision tokens, D hidden width, P patch size.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from transformers import AutoModel
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionPatchEmbed,
    Qwen2_5_VLPatchMerger,
    Qwen2_5_VLVisionBlock,
)

from planner.catalog import get_model
from planner.contract.models import LayerSpec
from planner.profiles import RECOMPUTED_KINDS, LayerPoint, Spread, load_profile, save_profile
from planner.contract.rules import heads_rule, linear_attention_rules
from runtime.parallel import attention
from runtime.models.families import FAMILIES, qwen2_5_vl
from runtime.parallel.tensor_parallel import parallelize_llm_tp, parallelize_vision_tp
from runtime.profile.device import free_port
from runtime.profile.layers import GridPoint
from runtime.profile.measure import TimingConfig, analyze_fake, default_dtype, one_step, time_optimizer_step
from runtime.profile.shards import ShardInputs, build_shard, hf_config
from runtime.profile.ops import OpCount, OpCounter
from runtime.models.llm import shard_llm_batch
from runtime.parallel.ring import RingGroup
from runtime.parallel.ulysses import split_windows
from runtime.models.vision import shard_vision_batch
from runtime.parallel.windows import window_layout

VISION_KINDS = frozenset({"patch_embed", "vision_block", "patch_merger"})
LLM_KINDS = frozenset({"embedding", "decoder_layer", "final_norm", "lm_head"})


def available_ranks(device: torch.device) -> int:
    """Processes this machine runs at once: its GPUs, or its CPU cores (one single-threaded rank per core)."""
    return torch.cuda.device_count() if device.type == "cuda" else (os.cpu_count() or 1)


def can_run_as_run(config, point: GridPoint, max_ranks: int) -> bool:
    """Whether ``point`` is one this module times as run: a sharded degree (tp * sp > 1) the machine has ranks
    for, TP or SP (not both), a split the runtime accepts (heads, KV heads, linear-attention heads, vocabulary, whole
    windows), and a layer it builds (``builds_vision``)."""
    tp, sp, kind = point.tp, point.sp, point.layer.kind
    if tp * sp == 1 or tp * sp > max_ranks or (tp > 1 and sp > 1):
        return False
    text, la = config.text_config, point.layer.linear_attention
    if la is not None and linear_attention_rules(tp, sp, 1, la.num_key_heads, la.num_value_heads, point.layer.name):
        return False
    if sp > 1 and kind in LLM_KINDS:
        return text.num_attention_heads % sp == 0 and point.seq_len >= sp
    if kind in VISION_KINDS and not builds_vision(config):
        return False
    if sp > 1:
        return kind in VISION_KINDS and _vision_splits(config.vision_config, point.seq_len, point.micro_batch, sp)
    if kind in LLM_KINDS:
        return not (heads_rule(tp, "tp", text.num_attention_heads, text.num_key_value_heads, "the LLM")
                    or text.vocab_size % tp)
    return kind in VISION_KINDS and config.vision_config.num_heads % tp == 0


class _Visual(nn.Module):
    """What ``parallelize_vision_tp`` shards of a vision tower: ``config``, ``blocks`` and ``merger``."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = Qwen2_5_VisionPatchEmbed(
            patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
            in_channels=config.in_channels, embed_dim=config.hidden_size,
        )
        self.blocks = nn.ModuleList([Qwen2_5_VLVisionBlock(config)])
        self.merger = Qwen2_5_VLPatchMerger(
            dim=config.out_hidden_size, context_dim=config.hidden_size, spatial_merge_size=config.spatial_merge_size
        )


LINEAR_ATTENTION_KERNEL = "torch"
"""The kernel a hybrid decoder's linear-attention layers run on here (``runtime.models.linear_attention.KERNELS``):
transformers' torch fallback, the one a CPU runs (fla's is CUDA-only)."""


def _layer_mixer(layer: LayerSpec) -> str:
    """The ``layer_types`` entry of a decoder layer: its token mixer."""
    return "linear_attention" if layer.linear_attention is not None else "full_attention"


class _LLM(nn.Module):
    """What ``parallelize_llm_tp`` shards of the LLM: ``language_model``, the model's own text model (transformers'
    ``AutoModel`` of its text config) with one decoder layer of each token mixer, and ``lm_head``. A hybrid decoder's
    layers are prepared as the runtime prepares them (its family's ``prepare_llm``: linear attention by segments, on
    ``LINEAR_ATTENTION_KERNEL``)."""

    def __init__(self, config) -> None:
        super().__init__()
        mixers = list(dict.fromkeys(getattr(config, "layer_types", None) or ["full_attention"]))
        config = copy.copy(config)
        config.layer_types, config.num_hidden_layers = mixers, len(mixers)
        self.language_model = AutoModel.from_config(config, dtype=torch.get_default_dtype())
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mixers = mixers
        """Each built layer's token mixer, in order."""

    def layer(self, layer: LayerSpec) -> nn.Module:
        """The built decoder layer of ``layer``'s token mixer."""
        return self.language_model.layers[self.mixers.index(_layer_mixer(layer))]


class _Call(nn.Module):
    """``layer(x, **kwargs)``; for lm_head, the runtime's loss on its logits (sum over tokens / token count)."""

    def __init__(self, layer: nn.Module, *, loss: bool = False) -> None:
        super().__init__()
        self.layer, self.loss = layer, loss

    def forward(self, x, **kwargs):
        if not self.loss:
            return self.layer(x, **kwargs)
        labels = kwargs["labels"]
        logits = self.layer(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels, reduction="sum") / labels.numel()


def _vision_splits(config, seq_len: int, micro_batch: int, sp: int) -> bool:
    """Whether the runtime can split B images of ``seq_len`` patches over ``sp`` ranks (whole windows each)."""
    try:
        _, cu_windows = window_layout(_grid_thw(config, seq_len, micro_batch), config)
        split_windows(cu_windows, sp)
    except (ValueError, NotImplementedError):
        return False
    return True


def _grid_thw(config, seq_len: int, micro_batch: int) -> torch.Tensor:
    """(t, rows, cols) of B near-square images of ``seq_len`` patches."""
    rows, cols = _image_grid(seq_len, config.spatial_merge_size)
    return torch.tensor([[1, rows, cols]] * micro_batch)


def _image_grid(seq_len: int, merge: int) -> tuple[int, int]:
    """(rows, cols) of patches of a near-square image of ``seq_len`` patches, both multiples of ``merge``."""
    for rows in range(math.isqrt(seq_len), 0, -1):
        if seq_len % rows == 0 and rows % merge == 0 and (seq_len // rows) % merge == 0:
            return rows, seq_len // rows
    raise NotImplementedError(f"{seq_len} patches do not form an image of whole {merge}x{merge} merge units")


@dataclass(kw_only=True)
class _Rank:
    """One rank's models, sharded as the runtime shards them at this degree."""

    tp: int
    sp: int
    rank: int
    vision: _Visual | None
    """None: a tower this module does not build (``builds_vision``)."""
    llm: _LLM
    dtype: torch.dtype
    device: torch.device
    ring: RingGroup | None = None
    """The CP group (ring context parallelism over every rank; ``sp`` is then 1), if any."""

    def vision_inputs(self, seq_len: int, micro_batch: int):
        """This rank's part of B images of ``seq_len`` patches, as ``shard_vision_batch`` splits them."""
        config = self.vision.config
        grid_thw = _grid_thw(config, seq_len, micro_batch)
        in_features = config.in_channels * config.temporal_patch_size * config.patch_size**2
        pixels_NP = torch.randn(seq_len * micro_batch, in_features, dtype=self.dtype)
        group = dist.group.WORLD if self.sp > 1 else None
        return shard_vision_batch(pixels_NP, grid_thw, config, sp_rank=self.rank if self.sp > 1 else 0,
                                  sp_group=group, sp=self.sp, cp_rank=self._cp_rank, ring=self.ring)

    @property
    def _cp_rank(self) -> int:
        return self.rank if self.ring is not None else 0

    def runner(self, layer: LayerSpec, seq_len: int, micro_batch: int,
               packed: bool = False) -> tuple[nn.Module, ShardInputs]:
        """The sharded layer of ``layer.kind`` and its inputs at (seq_len, micro_batch): B images or rows, or
        (``packed``, a linear-attention layer) one row of B samples."""
        if layer.kind in VISION_KINDS:
            if self.vision is None:
                raise NotImplementedError(f"{layer.name}: this module builds Qwen2.5-VL's vision tower only")
            return self._vision_runner(layer, seq_len, micro_batch)
        return self._llm_runner(layer, seq_len, micro_batch, packed)

    def _vision_runner(self, layer: LayerSpec, seq_len: int, micro_batch: int) -> tuple[nn.Module, ShardInputs]:
        shard = self.vision_inputs(seq_len, micro_batch)
        pixels_nP = shard.pixel_values_nP.to(self.device)
        n, width = pixels_nP.shape[0], self.vision.config.hidden_size
        if layer.kind == "patch_embed":
            return _Call(self.vision.patch_embed), ShardInputs(x=pixels_nP, kwargs={})
        x_nD = torch.randn(n, width, dtype=self.dtype, device=self.device, requires_grad=True)
        if layer.kind == "patch_merger":
            return _Call(self.vision.merger), ShardInputs(x=x_nD, kwargs={})
        head_dim = width // self.vision.config.num_heads
        rope = torch.randn(n, head_dim, dtype=self.dtype, device=self.device)
        kwargs = {"position_embeddings": (rope.cos(), rope.sin())}
        full = layer.attention is None or layer.attention.window_patches is None
        if full:
            kwargs.update(cu_seqlens=shard.cu_full.to(self.device), ulysses_group=shard.ulysses)
        else:
            kwargs.update(cu_seqlens=shard.cu_windows.to(self.device))
        return _Call(self.vision.blocks[0]), ShardInputs(x=x_nD, kwargs=kwargs)

    def llm_inputs(self, seq_len: int, micro_batch: int, packed: bool = False):
        """This rank's slice of B sequences of ``seq_len`` tokens, as ``shard_llm_batch`` cuts them: B rows, or
        (``packed``) one row of B samples."""
        vocab = self.llm.language_model.config.vocab_size
        rows, length, segments = (1, seq_len * micro_batch, (seq_len,) * micro_batch) if packed else (
            micro_batch, seq_len, None)
        ids_BL = torch.randint(0, vocab, (rows, length))
        positions_3BL = torch.arange(seq_len).repeat(length // seq_len).expand(3, rows, length)
        group = dist.group.WORLD if self.sp > 1 else None
        return shard_llm_batch(ids_BL, positions_3BL, ids_BL, sp_rank=self.rank if self.sp > 1 else 0,
                               sp_group=group, sp=self.sp, segment_lens=segments, ring=self.ring,
                               cp_rank=self._cp_rank)

    def _llm_runner(self, layer: LayerSpec, seq_len: int, micro_batch: int,
                    packed: bool) -> tuple[nn.Module, ShardInputs]:
        lm = self.llm.language_model
        if packed and layer.linear_attention is None and self.ring is None:
            raise NotImplementedError(f"{layer.name}: packed rows are fed to linear-attention layers, or under CP "
                                      "(a full-attention layer's packed mask is not built here)")
        shard = self.llm_inputs(seq_len, micro_batch, packed)
        ids_Bs = shard.input_ids_Bs.to(self.device)
        if layer.kind == "embedding":
            return _Call(lm.embed_tokens), ShardInputs(x=ids_Bs, kwargs={})
        x_BsD = torch.randn(*ids_Bs.shape, lm.config.hidden_size, dtype=self.dtype, device=self.device,
                            requires_grad=True)
        if layer.kind == "final_norm":
            return _Call(lm.norm), ShardInputs(x=x_BsD, kwargs={})
        if layer.kind == "lm_head":
            labels = shard.targets_Bs.flatten().clamp(min=0).to(self.device)  # the last position's label too
            return _Call(self.llm.lm_head, loss=True), ShardInputs(x=x_BsD, kwargs={"labels": labels})
        cos, sin = lm.rotary_emb(x_BsD, shard.position_ids_3Bs.to(self.device))
        kwargs = {"position_embeddings": (cos.to(self.dtype), sin.to(self.dtype))}
        if shard.ulysses is not None:
            kwargs["ulysses_group"] = shard.ulysses
        elif packed:  # what ``decoder_forward`` hands a linear-attention layer of a packed row
            kwargs["cu_seq_lens_q"] = torch.arange(micro_batch + 1, device=self.device) * seq_len
        return _Call(self.llm.layer(layer)), ShardInputs(x=x_BsD, kwargs=kwargs)


def _with_runtime_attention(config):
    config = copy.copy(config)
    config._attn_implementation = attention.register()
    return config


def builds_vision(config) -> bool:
    """Whether ``_Visual`` builds this model's vision tower (its classes are Qwen2.5-VL's)."""
    return isinstance(config, Qwen2_5_VLConfig)


def build_rank(model_arg: str, *, tp: int, sp: int, rank: int, dtype: torch.dtype, device: torch.device,
               cp: int = 1) -> _Rank:
    """Full-size layers of every type on this rank (the vision tower's where ``builds_vision``), prepared and
    TP-sharded by the runtime's functions (the model family's ``prepare_llm`` and TP plan); ``cp > 1``: ring context
    parallelism over all the world's ranks (alone: ``tp = sp = 1``), its inputs split as the runtime splits them."""
    if cp > 1 and tp * sp > 1:
        raise NotImplementedError("CP is built alone here (tp = sp = 1)")
    config = hf_config(get_model(model_arg).hf_config)
    family = FAMILIES[config.model_type]
    torch.manual_seed(0)
    vision = None
    with default_dtype(dtype), device:
        if builds_vision(config):
            vision = _Visual(_with_runtime_attention(config.vision_config)).train()
        llm = _LLM(_with_runtime_attention(config.text_config)).train()
    if family.prepare_llm is not None:
        family.prepare_llm(llm, SimpleNamespace(linear_attention=LINEAR_ATTENTION_KERNEL))
    if tp > 1:
        mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
        if vision is not None:
            parallelize_vision_tp(vision, mesh["tp"], qwen2_5_vl.vision_tp_plans(vision))
        parallelize_llm_tp(llm, mesh["tp"], family)
    ring = RingGroup(init_device_mesh(device.type, (cp,), mesh_dim_names=("cp",))) if cp > 1 else None
    return _Rank(tp=tp, sp=sp, rank=rank, vision=vision, llm=llm, dtype=dtype, device=device, ring=ring)


def _spread(samples: list[float]) -> Spread:
    return Spread(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples), repeats=len(samples))


def time_as_run(module: nn.Module, inputs: ShardInputs, cfg: TimingConfig, *, recompute: bool,
                loss_parallel_: bool) -> tuple[Spread, Spread, Spread]:
    """(forward, backward, recompute) of the slowest rank per iteration; every rank must call it.

    Ranks start each iteration together (a barrier). recompute is the checkpointed backward minus the plain one of
    the same iteration, clipped at 0; it is only timed when ``recompute`` (zero otherwise: the planner recomputes
    transformer blocks only).
    """
    device = torch.device(cfg.device)
    samples = []
    for i in range(cfg.warmup + cfg.repeats):
        with loss_parallel() if loss_parallel_ else contextlib.nullcontext():
            dist.barrier()
            f, b = one_step(module, inputs, recompute=False, device=device)
            rb = b
            if recompute:
                dist.barrier()
                _, rb = one_step(module, inputs, recompute=True, device=device)
        if i >= cfg.warmup:
            samples.append((f, b, rb))
    slowest = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    fwd, bwd, rbwd = (slowest[:, j].tolist() for j in range(3))
    return _spread(fwd), _spread(bwd), _spread([max(r - b, 0.0) for r, b in zip(rbwd, bwd)])


def _point(model_arg: str, point: GridPoint, cfg: TimingConfig, times: tuple[Spread, Spread, Spread],
           optimizer: tuple[Spread, Spread]) -> LayerPoint:
    """The profile entry: as-run times (and optimizer steps over one and two instances), FLOPs and memory of the
    single-process shard on fake tensors."""
    config = hf_config(get_model(model_arg).hf_config)
    fake = analyze_fake(lambda: build_shard(config, point.layer, tp=point.tp, sp=point.sp), point.seq_len,
                        point.micro_batch, dtype=cfg.dtype)
    forward, backward, recompute = times
    return LayerPoint(
        module=point.module, layer=point.layer.name, tp=point.tp, sp=point.sp, seq_len=point.seq_len,
        micro_batch=point.micro_batch, forward=forward, backward=backward, recompute=recompute, optimizer=optimizer[0],
        optimizer_pair=optimizer[1], forward_flops=fake.forward_flops, backward_flops=fake.backward_flops,
        saved_activation_bytes=fake.saved_activation_bytes, peak_bytes=fake.peak_bytes, includes_comm=True,
    )


def _keep_going(deadline: float | None, device: torch.device) -> bool:
    """Rank 0's decision (is there time left?) shared with every rank."""
    go = torch.tensor([1.0 if deadline is None or time.time() < deadline else 0.0], device=device)
    dist.broadcast(go, src=0)
    return bool(go.item())


def _worker(rank: int, world: int, port: int, model_arg: str, tp: int, sp: int, points: list[GridPoint],
            cfg: TimingConfig, threads: int, profile_path: str, deadline: float | None) -> None:
    device = torch.device(cfg.device, rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ranked = build_rank(model_arg, tp=tp, sp=sp, rank=rank, dtype=cfg.dtype, device=device)
        for point in points:
            if not _keep_going(deadline, device):
                break
            module, inputs = ranked.runner(point.layer, point.seq_len, point.micro_batch)
            times = time_as_run(module, inputs, cfg, recompute=point.layer.kind in RECOMPUTED_KINDS,
                                loss_parallel_=tp > 1 and point.layer.kind == "lm_head")
            optimizer = tuple(time_optimizer_step(module, cfg, instances=n, slowest_rank=True) for n in (1, 2))
            if rank == 0:
                profile = load_profile(profile_path)
                profile.layers.append(_point(model_arg, point, cfg, times, optimizer))
                save_profile(profile, profile_path)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def sweep_as_run(model_arg: str, points: list[GridPoint], *, profile_path: str, cfg: TimingConfig, threads: int,
                 time_budget_s: float | None, on_degree: Callable[[int, int, int], None] = lambda tp, sp, n: None
                 ) -> tuple[int, int]:
    """Time every point (already filtered by ``can_run_as_run``, missing from the profile at ``profile_path``),
    one spawn of tp*sp ranks per degree; returns (measured, left for lack of time)."""
    deadline = None if time_budget_s is None else time.time() + time_budget_s
    by_degree: dict[tuple[int, int], list[GridPoint]] = {}
    for p in points:
        by_degree.setdefault((p.tp, p.sp), []).append(p)
    before = len(load_profile(profile_path).layers)
    for (tp, sp), todo in sorted(by_degree.items()):
        if deadline is not None and time.time() >= deadline:
            break
        on_degree(tp, sp, len(todo))
        world = tp * sp
        mp.spawn(_worker, args=(world, free_port(), model_arg, tp, sp, todo, cfg, threads, profile_path, deadline),
                 nprocs=world, join=True)
    measured = len(load_profile(profile_path).layers) - before
    return measured, len(points) - measured


def _segments_run(layer: LayerSpec, kwargs: dict) -> int:
    """Segments a layer's attention loops over: a vision block's ``cu_seqlens``; a linear-attention layer's
    conv and rule calls (``gated_delta_net_forward``: one per sample of a packed row, of the Ulysses group's under
    SP, else one over all the rows); 0 for other layers."""
    ulysses = kwargs.get("ulysses_group")
    if ulysses is not None and ulysses.gathered is not None:
        return len(ulysses.gathered.query_segments())
    if layer.linear_attention is not None:
        ulysses, cu_seq_lens = kwargs.get("ulysses_group"), kwargs.get("cu_seq_lens_q")
        if ulysses is not None:
            return len(ulysses.segment_lens)
        return 1 if cu_seq_lens is None else len(cu_seq_lens) - 1
    cu_seqlens = kwargs.get("cu_seqlens")
    return 0 if cu_seqlens is None else len(cu_seqlens) - 1


def count_layer_ops(ranked: _Rank, layer: LayerSpec, seq_len: int, micro_batch: int,
                    packed: bool = False) -> tuple[OpCount, OpCount, int]:
    """(forward, backward) operator calls of one instance of ``layer`` as this rank runs it (``packed``: one row
    of ``micro_batch`` samples, a linear-attention layer), and the attention segments it looped over
    (``_segments_run``); every rank of the group must call it."""
    module, inputs = ranked.runner(layer, seq_len, micro_batch, packed)
    segments = _segments_run(layer, inputs.kwargs)
    with loss_parallel() if ranked.tp > 1 and layer.kind == "lm_head" else contextlib.nullcontext():
        with OpCounter() as forward:
            out = module(inputs.x, **inputs.kwargs)
        with OpCounter() as backward:
            out.backward(None if out.dim() == 0 else torch.ones_like(out))
    return forward.count, backward.count, segments

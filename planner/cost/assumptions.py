"""Every assumption of the cost model, as named, documented, overridable fields.

Nothing in the formulas is a bare literal that a user might want to change: it lives here. Override with
``dataclasses.replace(DEFAULT_ASSUMPTIONS, max_matmul_efficiency=0.6)``. The object is hashable, so it can
key caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner.contract.schema import AttentionCalls, LinearAttentionKernel
from planner.contract.units import GIB

AttentionImplementation = Literal["flash", "sdpa_mem_efficient", "eager"]
ATTENTION_IMPLEMENTATIONS: tuple[AttentionImplementation, ...] = ("flash", "sdpa_mem_efficient", "eager")

MiB = 1024**2


@dataclass(kw_only=True, frozen=True)
class BytesPerParam:
    """Resident bytes per parameter of one precision recipe, before any ZeRO sharding."""

    weights: float
    """Bytes of the weights used in forward/backward."""
    gradients: float
    """Bytes of the gradient (also the dtype it is reduced in)."""
    optimizer: float
    """Bytes of optimizer state, including an fp32 master copy when the recipe keeps one."""

    @property
    def total(self) -> float:
        """All three together (16 for bf16 mixed precision with Adam)."""
        return self.weights + self.gradients + self.optimizer


FP32_STATES = BytesPerParam(weights=4, gradients=4, optimizer=8)
"""fp32 training, as the runtime trains on CPU: fp32 weights and gradients, Adam m + v in fp32, no master copy:
16 B/param."""


@dataclass(kw_only=True, frozen=True)
class CostAssumptions:
    """Knobs of the analytical cost model. ``DEFAULT_ASSUMPTIONS`` holds the defaults."""

    # --- precision recipes (Rajbhandari et al. 2020, ZeRO, Sec. 3.1: 2 + 2 + 12 bytes per parameter) ---
    bf16_mixed: BytesPerParam = BytesPerParam(weights=2, gradients=2, optimizer=12)
    """bf16 weights and gradients, fp32 master weights + Adam m + v (4 + 4 + 4): 16 B/param."""
    bf16_pure: BytesPerParam = BytesPerParam(weights=2, gradients=2, optimizer=4)
    """bf16 weights, gradients and Adam m + v (2 + 2), no master copy: 8 B/param."""
    activation_bytes: int = 2
    """Bytes per stored activation element (bf16)."""

    # --- compute roofline ---
    max_matmul_efficiency: float = 0.70
    """Fraction of peak bf16 FLOP/s a large, well-shaped GEMM reaches."""
    matmul_half_saturation_dim: float = 128.0
    """Smallest GEMM dimension at which a GEMM reaches half of max_matmul_efficiency (one tensor-core tile)."""
    memory_bandwidth_efficiency: float = 0.80
    """Fraction of the HBM bandwidth a streaming kernel reaches."""
    elementwise_traffic_factor: float = 3.0
    """HBM traffic of unfused eager elementwise ops (norms, rotary, activation, residual) relative to one read
    of every input and one write of every output (HF eager RMSNorm upcasts to fp32 in several kernels)."""
    expert_gemm_half_efficiency_tokens: float = 128.0
    """Tokens per expert at which a grouped expert GEMM reaches half the efficiency of the same GEMM with many
    tokens: an expert with fewer rows than a tensor-core tile leaves it partly idle (MegaBlocks, Gale et al. 2023,
    Sec. 5: block-sparse / grouped kernels tiled in 128-row blocks). Calibratable."""
    moe_load_imbalance: float = 1.25
    """Routed tokens of the busiest expert-parallel rank over the mean: it multiplies that rank's expert compute and
    its dispatch bytes. Default: the Switch Transformer's training capacity factor 1.25 (Fedus et al. 2022, Sec.
    2.2), the headroom a trained router needs; 1 models perfect balance."""
    backward_to_forward_flops: float = 2.0
    """Backward FLOPs of a GEMM relative to its forward: input gradient + weight gradient (Narayanan et al.
    2021, Sec. 5.1, eq. 3 accounting)."""

    # --- host overhead per operator call (planner/cost/host.py) ---
    host_seconds_per_op: float = 5e-6
    """Host seconds of one eager operator call with autograd recording, CUDA launch call included. He 2022 ("Making
    Deep Learning Go Brrrr", Sec. "Overhead") puts eager PyTorch's per-op overhead at microseconds; measured 2.2 us
    without CUDA on this project's CPU (``runtime.profile.ops.host_seconds_per_op``), to which a GPU host adds the
    launch call (a few us, NVIDIA's "Getting Started with CUDA Graphs", 2019). A profile's measurement replaces it."""
    dtensor_seconds_per_op: float = 10e-6
    """Extra host seconds of an operator call on DTensors (sharding propagation, local-tensor unwrap and rewrap):
    measured 12.4 us vs 2.2 us plain (torch 2.13, CPU, cached sharding propagation)."""

    # --- refitted from measured runs (python -m planner.calibrate) ---
    step_overhead_s: float = 0.0
    """Seconds per step outside the modules' passes (the training loop's own Python, metrics, synchronisation): 0
    until calibration fits it to measured runs."""
    measured_time_scale: float = 1.0
    """Factor on a profile's measured layer times: a layer timed alone (warm caches, nothing else running) may run
    slower inside a training step. 1 until calibration fits it."""

    vision_compute_scale: float = 1.0
    """Factor on the vision tower's compute as modelled (its layers' forward, backward and recomputation, host dispatch
    included; not their collectives): 1 until an adaptive run (``planner.adapt``) fits it to the tower's own measured
    passes."""
    audio_compute_scale: float = 1.0
    """The same for the audio encoder."""
    llm_compute_scale: float = 1.0
    """The same for the LLM."""
    optimizer_time_scale: float = 1.0
    """Factor on the optimizer step as modelled: 1 until an adaptive run fits it to the measured step."""

    vision_activation_memory_scale: float = 1.0
    """Factor on the vision tower's step memory as modelled (its layers' saved activations and the transient
    buffers of their passes and of the loss; not parameters, gradients, optimizer states, ZeRO-3 gathers or gradient
    buckets, which are sizes, not estimates): 1 until an adaptive run fits it to a measured peak
    (``planner.adapt``)."""
    audio_activation_memory_scale: float = 1.0
    """The same for the audio encoder."""
    llm_activation_memory_scale: float = 1.0
    """The same for the LLM."""

    def compute_scale(self, module: str) -> float:
        """``<module>_compute_scale``."""
        return getattr(self, f"{module}_compute_scale")

    def activation_memory_scale(self, module: str) -> float:
        """``<module>_activation_memory_scale``."""
        return getattr(self, f"{module}_activation_memory_scale")

    optimizer_foreach: bool = True
    """Whether the optimizer step is torch's multi-tensor AdamW (its default on CUDA: a fixed number of calls per
    step) or its per-parameter loop (the default on CPU: 11 calls per parameter tensor, ``OPTIMIZER_OPS``)."""

    # --- attention ---
    attention_calls: AttentionCalls = "varlen"
    """How attention is called over segments (``AttentionCalls``); ``planner.problem`` sets ``sdpa`` on a CPU."""
    attention_implementation: AttentionImplementation = "flash"
    """flash / sdpa_mem_efficient keep only logsumexp per head and token; eager stores the s x s scores."""
    flash_attention_efficiency: float = 0.55
    """Fraction of peak FLOP/s a FlashAttention kernel reaches on long segments."""
    mem_efficient_attention_efficiency: float = 0.40
    """Fraction of peak FLOP/s the SDPA memory-efficient kernel reaches on long segments."""
    eager_attention_efficiency: float = 0.60
    """Fraction of peak FLOP/s the two batched GEMMs of eager attention reach (their score traffic is costed
    separately as memory-bound)."""
    attention_half_saturation_tokens: float = 128.0
    """Key length per segment (window) at which attention reaches half its efficiency (short windows idle
    tensor cores: a 64-patch window is one partial tile)."""
    flash_backward_to_forward_flops: float = 2.5
    """Backward/forward FLOPs of flash-style attention: 5 GEMMs (S recomputed) vs 2 (Dao 2023,
    FlashAttention-2, Sec. 3.1.2). Eager backward uses 4 GEMMs vs 2, i.e. backward_to_forward_flops."""
    causal_attention_flops_fraction: float = 0.5
    """Fraction of the full s x s attention FLOPs a causal kernel executes (it skips masked blocks)."""
    softmax_stat_bytes: int = 4
    """Bytes per head and token of the fp32 logsumexp flash-style kernels save for backward."""
    linear_attention_kernel: LinearAttentionKernel = "fla"
    """Which kernel runs the Gated DeltaNet layers (``LinearAttentionKernel``), whose saved tensors and transients
    differ (``planner.cost.linear_attention``); ``planner.problem`` sets ``torch`` on a CPU."""
    linear_attention_chunk: int = 64
    """Tokens per chunk of the chunked gated delta rule (flash-linear-attention's ``chunk_gated_delta_rule`` and
    transformers' ``torch_chunk_gated_delta_rule`` both use 64)."""
    mlp_backward_transient_tensors: float = 2.2
    """``[tokens, intermediate / tp]`` activation-dtype tensors a gated MLP's backward holds beside what the layer
    saved (the gradients of its gate and up projections' outputs and of their product, less the saved inputs it
    frees as it goes): measured with FakeTensorMode + MemTracker on a Qwen2.5-VL-32B decoder layer (bf16) at 4,096,
    8,192 and 22,855 tokens, 2.18 each time. Korthikanti et al. 2022 count what is saved, not these."""
    ungated_mlp_backward_transient_tensors: float = 1.3
    """The same for an ungated MLP (fc1, activation, fc2: Qwen2-VL's and Qwen3-VL's vision blocks): the gradients of
    its hidden activation and of fc1's output; measured likewise on a Qwen3-VL-32B vision block (bf16) at 4,096 and
    16,384 patches, 1.27 per token plus one weight-sized temporary."""
    norm_upcast_bytes: float = 4.0
    """Extra bytes per element each norm keeps for backward: transformers' RMSNorm (Qwen2RMSNorm) casts its
    input to fp32 before the variance and its backward reads that fp32 copy (measured with FakeTensorMode:
    6 B/element in all, not 2). 0 models a fused norm kernel."""
    vision_rotary_upcast_bytes: float = 4.0
    """Extra bytes per q and k element a vision block keeps: Qwen-VL's ``apply_rotary_pos_emb_vision`` rotates
    fp32 copies of q and k, which its backward reads. 0 when rotary runs in the activation dtype."""
    token_id_bytes: int = 8
    """Bytes per token of the int64 token ids the embedding keeps for its weight gradient."""
    eager_score_bytes_per_element: float = 6.0
    """Bytes stored per score element by eager attention: fp32 softmax output (kept for its backward) plus
    its bf16 cast (kept for the P @ V GEMM), as in HF ``eager_attention_forward``."""
    eager_score_traffic_bytes_per_element: float = 16.0
    """HBM bytes moved per score element in the eager forward: write/read bf16 scores, write/read fp32
    probabilities, write/read the bf16 cast."""

    # --- memory beyond states and activations ---
    megatron_sequence_parallel: bool = False
    """Megatron sequence parallelism with TP (Korthikanti et al. 2022, Sec. 4.2.2): when False (the
    runtime's DTensor TP plan), norm inputs and block inputs are replicated on every TP rank."""
    zero_shards_over_sequence_ranks: bool = True
    """ZeRO/FSDP shards (and gradients are reduced) over dp x cp x sp ranks, as torchtitan's ``dp_shard_cp``
    mesh does; False shards over dp only (gradients still reduced over dp x cp x sp)."""
    zero1_accumulated_gradient_bytes: float = 4.0
    """Bytes per parameter of the unsharded gradients a bf16_mixed ZeRO-1 module accumulates over a step's
    micro-batches: FSDP2 keeps them in its reduce dtype, fp32 (``FSDPParam.to_accumulated_grad_if_needed``);
    bf16_pure reduces in its bf16 parameter dtype, so it accumulates its recipe's gradient bytes
    (``accumulated_gradient_bytes``). With one micro-batch per
    step the runtime reduce-scatters during the backward and ZeRO-1 holds gradients as ZeRO-2 does. Seen in the
    SP8 + TP8 dry-run (2.5 GiB of fp32 temporaries for the 0.67B vision tower at the peak)."""
    zero3_prefetch_layers: int = 1
    """Layers whose parameters ZeRO-3 gathers ahead of use (FSDP2 default: 1), on top of the current one."""
    communication_bucket_bytes: int = 25 * MiB
    """Gradient bucket size of DDP / ZeRO-1/2 reduction (PyTorch DDP ``bucket_cap_mb`` default 25)."""
    communication_buckets_in_flight: int = 2
    """Buckets held at once: one being filled, one being reduced."""
    loss_logits_saved_bytes: float = 4.0
    """Bytes per (token, vocab/TP) logit kept for the cross-entropy backward (fp32 log-softmax)."""
    loss_logits_transient_bytes: float = 6.0
    """Bytes per (token, vocab/TP) logit alive only while the loss is formed (bf16 logits + fp32 upcast)."""
    loss_logits_backward_bytes: float = 8.0
    """Bytes per (token, vocab/TP) logit alive beside the saved log-softmax while the loss backward runs: the fp32
    gradients of the nll loss and of the log-softmax (4 + 4)."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the chunked lm_head + cross-entropy (an unpipelined LLM): each chunk's logits exist only
    while its loss is formed and again while its backward recomputes them, so the logits' memory is that of one
    chunk; 1,024 tokens of a 152K vocabulary are 1.9 GB at 12 B per logit, and a GEMM of 1,024 rows still runs
    near its peak."""
    loss_parallel_extra_bytes: float = 4.0
    """Transient bytes per logit that the vocab-parallel loss adds under TP, forward and backward alike: torch's
    ``loss_parallel`` (torch/distributed/tensor/parallel/loss.py) materialises ``exp`` of the fp32 logits beside the
    shifted logits (``_log_softmax``) and beside the zeros it scatters the targets into
    (``_nll_loss_and_log_softmax_backward``), one fp32 copy more than the fused single-device kernels. Seen in the
    dry-run of the SP8 + TP8 32B plan (benchmarks/results/dry_run.md, 2026-12-02): at the peak, the loss backward,
    three fp32 logit-sized temporaries beside the saved log-softmax."""
    framework_overhead_bytes: int = 3 * GIB
    """Per-GPU allowance for the CUDA context, cuBLAS/NCCL workspaces and communicator buffers."""
    usable_memory_fraction: float = 0.92
    """Fraction of HBM the allocator can hand out before fragmentation makes allocations fail."""
    max_seq_memory_margin: float = 0.02
    """Fraction of the usable memory ``--max-seq`` leaves free at the longest sequence it answers: the cost model's
    error where a plan is planned to its last GiB (dry-run vs planner peak within 2 % on README's long-sequence and
    edge plans), so that the answer is one the runtime fits rather than one the error turns."""

    # --- communication (alpha-beta, Hockney 1994; ring algorithms, Thakur et al. 2005) ---
    intra_node_bus_efficiency: float = 0.80
    """Fraction of the NVLink unidirectional bandwidth a collective achieves (NCCL bus bandwidth)."""
    inter_node_bus_efficiency: float = 0.80
    """Fraction of the NIC unidirectional bandwidth a collective achieves."""
    dp_comm_overlap: float = 0.90
    """Fraction of the backward (ZeRO-3 all-gathers: forward+backward) compute that can hide ZeRO-1/2/3 (FSDP)
    communication; the last bucket is always exposed."""
    zero0_grad_sync_overlap: float = 0.0
    """Fraction of the backward that hides ZeRO-0's gradient all-reduce. 0: the runtime sums a module's gradients in
    one flat all-reduce after the last micro-batch's backward (runtime/parallel/fsdp.py ``all_reduce_gradients``),
    so it is all exposed; a DDP-style bucketed all-reduce during the backward (Li et al. 2020) would allow ~0.9."""
    zero0_bucket_copies: int = 2
    """Passes over the gradients the ZeRO-0 all-reduce adds: the runtime copies them into its flat buffer and back
    (2); DDP with ``gradient_as_bucket_view`` makes none (0)."""
    tp_comm_overlap: float = 0.0
    """Fraction of TP all-reduce time hidden behind compute (0: Megatron-style TP comm is on the critical path)."""
    sp_comm_overlap: float = 0.0
    """Fraction of Ulysses all-to-all time hidden behind compute."""
    cp_comm_overlap: float = 0.90
    """Fraction of the attention compute that can hide ring-attention KV passing (Liu et al. 2023, Sec. 3)."""
    pp_p2p_overlap: float = 0.0
    """Fraction of a pipeline stage's point-to-point activation / gradient sends hidden behind its compute. 0:
    torch.distributed.pipelining's 1F1B waits for each receive before the compute that needs it (Megatron-LM's
    ``--overlap-p2p-communication`` of the interleaved schedule would hide most of it)."""

    def __post_init__(self) -> None:
        if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention_implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
                f"got {self.attention_implementation!r}"
            )
        for name in (
            "max_matmul_efficiency",
            "memory_bandwidth_efficiency",
            "flash_attention_efficiency",
            "mem_efficient_attention_efficiency",
            "eager_attention_efficiency",
            "causal_attention_flops_fraction",
            "usable_memory_fraction",
            "intra_node_bus_efficiency",
            "inter_node_bus_efficiency",
        ):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.moe_load_imbalance < 1 or self.expert_gemm_half_efficiency_tokens < 0:
            raise ValueError(f"moe_load_imbalance must be >= 1 and expert_gemm_half_efficiency_tokens >= 0, got "
                             f"{self.moe_load_imbalance} and {self.expert_gemm_half_efficiency_tokens}")
        if not 0 <= self.step_overhead_s < 3600 or not 0 < self.measured_time_scale <= 100:
            raise ValueError(f"step_overhead_s must be in [0, 3600) s and measured_time_scale in (0, 100], got "
                             f"{self.step_overhead_s} and {self.measured_time_scale}")
        for name in ("vision_compute_scale", "audio_compute_scale", "llm_compute_scale", "optimizer_time_scale",
                     "vision_activation_memory_scale", "audio_activation_memory_scale",
                     "llm_activation_memory_scale"):
            if not 0 < getattr(self, name) <= 100:
                raise ValueError(f"{name} must be in (0, 100], got {getattr(self, name)}")
        if not 0 <= self.max_seq_memory_margin < 1:
            raise ValueError(f"max_seq_memory_margin must be in [0, 1), got {self.max_seq_memory_margin}")
        for name in ("host_seconds_per_op", "dtensor_seconds_per_op"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1) seconds, got {getattr(self, name)}")
        for name in ("dp_comm_overlap", "zero0_grad_sync_overlap", "tp_comm_overlap", "sp_comm_overlap",
                     "cp_comm_overlap", "pp_p2p_overlap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def bytes_per_param(self, precision: str) -> BytesPerParam:
        """The recipe called ``precision`` (``bf16_mixed`` or ``bf16_pure``)."""
        if precision == "bf16_mixed":
            return self.bf16_mixed
        if precision == "bf16_pure":
            return self.bf16_pure
        raise ValueError(f"unknown precision {precision!r}; use bf16_mixed or bf16_pure")

    def accumulated_gradient_bytes(self, precision: str) -> float:
        """Bytes per parameter of the unsharded gradients FSDP2 accumulates over micro-batches under
        ``precision``: its reduce dtype's."""
        if precision == "bf16_mixed":
            return self.zero1_accumulated_gradient_bytes
        return self.bytes_per_param(precision).gradients

    def attention_efficiency(self) -> float:
        """Peak fraction of the configured attention kernel on long segments."""
        return {
            "flash": self.flash_attention_efficiency,
            "sdpa_mem_efficient": self.mem_efficient_attention_efficiency,
            "eager": self.eager_attention_efficiency,
        }[self.attention_implementation]

    def attention_backward_ratio(self) -> float:
        """Backward/forward FLOPs of the attention core for the configured kernel."""
        if self.attention_implementation == "eager":
            return self.backward_to_forward_flops
        return self.flash_backward_to_forward_flops


DEFAULT_ASSUMPTIONS = CostAssumptions()

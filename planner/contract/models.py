"""Model description the planner works on: a VLM is a tuple of modules, each a tuple of layer types.

This file holds only the types; ``planner.catalog`` builds them from Hugging Face ``config.json`` dicts.
Parameter counts are stored per layer (exact, from the architecture's own formulas) so that the cost
model never re-derives them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping

LayerKind = Literal[
    "patch_embed",  # Conv3d patchifier of the vision tower
    "vision_block",  # ViT block (window or full attention)
    "patch_merger",  # spatial merge + MLP projector into the LLM width (also Qwen3-VL's DeepStack mergers)
    "audio_conv",  # Whisper conv1+conv2 front end (+ positional embedding)
    "audio_block",  # Whisper encoder layer
    "audio_projector",  # final norm + pooling + linear into the LLM width
    "embedding",  # token embedding
    "decoder_layer",  # GQA + SwiGLU (or routed-experts, ``LayerSpec.moe``; or linear attention, ``LayerSpec.linear_attention``) decoder layer
    "final_norm",  # last RMSNorm of the decoder
    "lm_head",  # vocabulary projection (+ loss)
]
ModuleName = Literal["vision", "audio", "llm"]
ENCODER_MODULES: tuple[str, ...] = ("vision", "audio")


@dataclass(kw_only=True, frozen=True)
class AttentionSpec:
    """Self-attention dimensions of one layer."""

    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (== num_heads without GQA)."""
    head_dim: int
    """Width of one head."""
    causal: bool
    """Causal (decoder) or bidirectional (encoder) attention."""
    window_patches: int | None = None
    """Patches per attention window for window-attention blocks; None attends each whole segment."""
    output_gate: bool = False
    """Gated attention (Qwen3.5's ``Qwen3_5Attention``): q_proj also produces a per-head gate of the query's width,
    and the attention output is multiplied by its sigmoid before o_proj."""
    qk_norm: bool = False
    """An RMSNorm of one head's width on every query and key head before the rotary embedding (Qwen3's, Qwen3-VL's
    and Qwen3.5's ``q_norm`` / ``k_norm``)."""


@dataclass(kw_only=True, frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet token mixer of one decoder layer, in place of softmax attention (transformers
    ``Qwen3_5GatedDeltaNet``: in_proj_qkv, in_proj_z, in_proj_a / in_proj_b, a depthwise causal conv over q, k, v,
    the chunked gated delta rule, a gated RMSNorm, out_proj)."""

    num_key_heads: int
    """Query / key heads (``linear_num_key_heads``)."""
    num_value_heads: int
    """Value heads (``linear_num_value_heads``), a multiple of the key heads; each carries its own state."""
    key_head_dim: int
    """Width of one query / key head (``linear_key_head_dim``)."""
    value_head_dim: int
    """Width of one value head (``linear_value_head_dim``)."""
    conv_kernel: int
    """Taps of the causal depthwise conv over q, k, v (``linear_conv_kernel_dim``)."""


@dataclass(kw_only=True, frozen=True)
class MlpSpec:
    """Feed-forward dimensions of one layer."""

    intermediate_size: int
    """Hidden width of the MLP."""
    gated: bool
    """SwiGLU-style gate (three matrices) or plain two-matrix MLP."""


@dataclass(kw_only=True, frozen=True)
class MoeSpec:
    """Routed-experts feed-forward of one decoder layer, in place of its dense MLP (transformers
    ``Qwen3VLMoeTextSparseMoeBlock``: a linear router, softmax, top-k, SwiGLU experts without bias)."""

    num_experts: int
    """Routed experts of the layer."""
    experts_per_token: int
    """Experts each token is sent to (top-k)."""
    expert_intermediate_size: int
    """Hidden width of one expert's SwiGLU MLP."""
    expert_params: int
    """Exact parameters of all routed experts of ONE layer instance (the router excluded): what EP shards."""
    shared_expert_intermediate_size: int = 0
    """Hidden width of an always-on shared expert (0: none, as in Qwen3-VL-MoE)."""
    norm_topk_prob: bool = True
    """Whether the top-k routing weights are renormalised to sum to 1."""
    balancing_loss: bool = False
    """Trained with transformers' load-balancing loss (``output_router_logits``): not pipelined
    (``planner.contract.rules.balancing_loss_rule``)."""


@dataclass(kw_only=True, frozen=True)
class LayerSpec:
    """One layer type, repeated ``count`` times inside a module."""

    kind: LayerKind
    """What the layer is; the cost model dispatches on this."""
    name: str
    """Unique name inside the module, e.g. ``window_block`` or ``full_block``; profiles are keyed by it."""
    count: int
    """How many consecutive-or-interleaved instances the module has."""
    params: int
    """Exact trainable parameters of ONE instance."""
    hidden_size: int
    """Width of the token stream through the layer (input width for projecting layers)."""
    out_features: int | None = None
    """Output width where it differs from hidden_size (merger/projector: LLM width; lm_head: vocab)."""
    in_features: int | None = None
    """Input width per output token where it differs (patch_embed: C*T*P*P; merger: hidden*merge^2)."""
    token_reduction: int = 1
    """Input tokens per output token (spatial merge 2 -> 4; audio pooling)."""
    attention: AttentionSpec | None = None
    """Self-attention of block layers."""
    mlp: MlpSpec | None = None
    """Dense feed-forward of block layers (None on a mixture-of-experts layer)."""
    moe: MoeSpec | None = None
    """Routed experts of a mixture-of-experts decoder layer (None on a dense layer)."""
    linear_attention: LinearAttentionSpec | None = None
    """Linear-attention token mixer of a hybrid decoder layer (then ``attention`` is None)."""


@dataclass(kw_only=True, frozen=True)
class ModuleSpec:
    """A module (vision encoder, audio encoder or LLM decoder) as its layer types."""

    name: ModuleName
    """vision, audio or llm."""
    layers: tuple[LayerSpec, ...]
    """Layer types in forward order."""
    frozen: bool = False
    """Frozen: no gradients, no optimizer state, no weight-gradient FLOPs."""
    layer_order: tuple[str, ...] = ()
    """Names of the decoder layer types in forward order, one per instance, where a module interleaves several
    (Qwen3.5: three ``linear_decoder_layer`` per ``decoder_layer``); pipeline chunks cut this order. Empty: one
    decoder layer type, its instances alike."""

    @property
    def num_params(self) -> int:
        """Exact parameter count of the whole module."""
        return sum(layer.params * layer.count for layer in self.layers)

    @property
    def has_experts(self) -> bool:
        """Whether any layer routes tokens to experts (expert parallelism applies)."""
        return any(layer.moe is not None for layer in self.layers)

    @property
    def num_layers(self) -> int:
        """Number of layer instances."""
        return sum(layer.count for layer in self.layers)

    def layer(self, name: str) -> LayerSpec:
        """The layer type called ``name``."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"module {self.name} has no layer {name!r}")


@dataclass(kw_only=True, frozen=True)
class VisionInputSpec:
    """How images become vision-tower tokens."""

    patch_size: int
    """Pixels per patch side (14 for Qwen-VL)."""
    temporal_patch_size: int
    """Frames per temporal patch (2; an image is repeated to fill it)."""
    spatial_merge_size: int
    """Patches merged per side into one LLM token (2 -> 4 patches per token)."""
    window_size: int | None
    """Window-attention window side in pixels (112 for Qwen2.5-VL), None without window attention."""
    min_pixels: int
    """Fewest pixels the image processor resizes an image to (its preprocessor_config.json)."""
    max_pixels: int
    """Most pixels the image processor resizes an image to."""
    video: VideoInputSpec
    """How the model's video processor turns sampled frames into patches."""


@dataclass(kw_only=True, frozen=True)
class VideoInputSpec:
    """How a clip of sampled frames becomes vision-tower tokens (the model's video processor)."""

    min_pixels: int
    """Fewest pixels the resize keeps (per frame or per clip, as ``pixels_per_clip`` says)."""
    max_pixels: int
    """Most pixels the resize keeps."""
    pixels_per_clip: bool
    """Whether the pixel bounds hold for the whole clip (frames x height x width: Qwen3-VL) or for each frame
    (Qwen2-VL, Qwen2.5-VL)."""
    group_text_tokens: int
    """Text tokens the prompt adds per temporal patch group (Qwen3-VL's ``<t seconds>`` timestamp and the
    vision start/end markers around each group), 0 where the clip has one marker pair only."""
    clip_text_tokens: int
    """Text tokens the prompt adds once per clip (the start/end markers of a clip without per-group text)."""
    min_frames: int
    """Fewest frames the video processor samples from a video file (``min_frames``)."""
    max_frames: int
    """Most frames it samples from a video file (``max_frames``)."""
    samples_whole_temporal_patches: bool
    """How it samples a file at an fps (``sample_frames``): whole temporal patches of frames, every (total / n)-th
    (Qwen2-VL, Qwen2.5-VL), or n evenly spaced frames rounded to the nearest, padded to whole patches later
    (Qwen3-VL)."""


@dataclass(kw_only=True, frozen=True)
class AudioInputSpec:
    """How audio seconds become audio-encoder tokens."""

    encoder_tokens_per_second: int
    """Encoder positions per second of audio (Whisper: 100 mel frames/s, conv stride 2 -> 50)."""
    pool_stride: int
    """Encoder tokens per LLM token after pooling (Qwen2-Audio: 2)."""
    max_seconds: int
    """Longest clip one encoder pass accepts (Whisper: 30 s)."""
    conv_stride: int = 2
    """Mel frames per encoder position (Whisper's second convolution)."""


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A multimodal model: modules plus how raw inputs become tokens."""

    name: str
    """Catalog name, e.g. ``qwen2.5-vl-32b``."""
    family: str
    """Architecture family: the Hugging Face ``model_type`` its adapter reads (``planner.contract.families``)."""
    hf_config: Mapping[str, Any]
    """The Hugging Face config dict the spec was built from; the runtime builds the model from it."""
    modules: tuple[ModuleSpec, ...]
    """Modules in data-flow order: encoders first, the LLM last."""
    vision_input: VisionInputSpec | None = None
    """Present for vision-language models."""
    audio_input: AudioInputSpec | None = None
    """Present for audio-language models."""
    tie_word_embeddings: bool = False
    """Whether lm_head shares the embedding matrix (its params are then counted once, in the embedding)."""
    unbuilt_params: int = 0
    """Parameters the checkpoint holds beyond the built model, neither loaded, trained nor priced (Qwen3.5's
    multi-token-prediction layers ``mtp.*``, which transformers skips on load); ``num_params`` excludes them."""
    injection_layers: tuple[int, ...] = ()
    """Decoder layers whose output receives one more encoder tensor at the image positions (Qwen3-VL's DeepStack:
    layers 0, 1, 2 receive features taken inside the vision tower); each crosses the hand-off like the encoder's
    output. Empty: the encoder hands over one tensor."""

    @property
    def handoff_tensors(self) -> int:
        """Tensors of one encoder token's width the LLM receives per encoder output token."""
        return 1 + len(self.injection_layers)

    @property
    def num_params(self) -> int:
        """Exact parameter count of the whole model."""
        return sum(m.num_params for m in self.modules)

    @property
    def module_names(self) -> tuple[str, ...]:
        """Module names in data-flow order."""
        return tuple(m.name for m in self.modules)

    def module(self, name: str) -> ModuleSpec:
        """The module called ``name``."""
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"model {self.name} has no module {name!r}; it has {', '.join(self.module_names)}")

    def with_frozen(self, names: tuple[str, ...] | list[str]) -> "ModelSpec":
        """A copy with the named modules frozen."""
        for name in names:
            self.module(name)
        return replace(
            self, modules=tuple(replace(m, frozen=m.frozen or m.name in names) for m in self.modules)
        )

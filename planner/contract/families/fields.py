"""Reading a Hugging Face ``config.json``: typed fields, transformers' defaults, one-line errors.

Every family adapter (``planner.contract.families``) reads its config through these, so that a bad field gets the same
one-line error whatever the architecture.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

MAX_CONFIG_INTEGER = 2**24
"""Largest width, depth, head count or vocabulary a config.json may give (16,777,216: far beyond any model, small
enough that parameter counts and costs stay exact)."""
TOKEN_ID_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "vision_token_id", "bos_token_id", "eos_token_id", "pad_token_id")
"""Special token ids a vision-language config may give: each must index the decoder's vocabulary (the runtime
embeds them)."""


_NUMBER = (int, float)
CONFIG_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("model_type", "hidden_act", "activation_function", "transformers_version", "torch_dtype",
                     "dtype"), (str,)),
    **dict.fromkeys(("rms_norm_eps", "initializer_range", "attention_dropout", "rope_theta", "mlp_ratio",
                     "dropout", "activation_dropout", "layerdrop", "init_std"), _NUMBER),
    **dict.fromkeys(("tie_word_embeddings", "use_cache", "use_sliding_window", "scale_embedding", "attention_bias"),
                   (bool,)),
    **dict.fromkeys(("max_position_embeddings", "sliding_window", "max_window_layers", "tokens_per_second",
                     "in_chans", "spatial_patch_size", "audio_token_index"), (int,)),
    **dict.fromkeys(("architectures", "fullatt_block_indexes", "layer_types", "deepstack_visual_indexes"), (list,)),
    **dict.fromkeys(("rope_parameters", "rope_scaling"), (dict,)),
}
"""JSON types of the config keys transformers' strict config classes type-check, besides the widths, depths and
token ids the modules are built from (``positive_int``): a config whose value has another type (null counts as
one where the key is present) plans nothing, since the runtime could not build it. A number key takes an int or a
float; an int key no bool."""
ACTIVATIONS = ("gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
               "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu",
               "relu", "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu")
"""``hidden_act`` names transformers knows (``transformers.activations.ACT2CLS``, 5.x); another fails the build."""
NULLABLE_KEYS = ("sliding_window", "max_window_layers", "use_sliding_window", "rope_scaling", "rope_parameters",
                 "layer_types", "architectures", "torch_dtype", "dtype", "transformers_version")
"""Keys transformers also accepts as null."""


def check_field_types(section: Mapping[str, Any], where: str) -> None:
    """Raise a one-line ValueError naming the first key of ``section`` whose value has a type other than its
    ``CONFIG_FIELD_TYPES``, a non-finite number, or an unknown ``hidden_act``."""
    for key, value in section.items():
        allowed = CONFIG_FIELD_TYPES.get(key)
        if allowed is None or (value is None and key in NULLABLE_KEYS):
            continue
        wrong = not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
        if not wrong and isinstance(value, float) and not math.isfinite(value):
            wrong = True
        if wrong:
            expected = {(str,): "a string", _NUMBER: "a finite number", (bool,): "true or false",
                        (int,): "an integer", (list,): "a list", (dict,): "an object"}[allowed]
            raise ValueError(f"{where}.{key} must be {expected}, got {json.dumps(value)}")
        if key == "hidden_act" and value not in ACTIVATIONS:
            raise ValueError(f"{where}.hidden_act {value!r} is not an activation transformers knows "
                             f"({', '.join(ACTIVATIONS)})")


# --- Config sections --------------------------------------------------------------------------------------------


def with_defaults(section: Any, defaults: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``section`` with the transformers defaults for the keys it omits, its own keys type-checked."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(section).__name__}")
    check_field_types(section, where)
    return {**defaults, **section}


def sub_config(config: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The nested sub-config ``config[key]``, defaults filled in."""
    return with_defaults(config.get(key) or {}, defaults, key)


def encoder_section(config: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """An encoder's sub-config, which every hub config of the family has: a file without it is most likely not the
    model's own config.json, so it is refused rather than read as the transformers defaults."""
    if key not in config:
        raise ValueError(f"no {key}: a {config.get('model_type')} config.json describes its encoder there (copy the "
                         f"model's config.json from its hub repository)")
    return sub_config(config, key, defaults)


def text_section(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's settings: nested ``text_config`` (transformers 5) or the flat top level (hub files)."""
    return with_defaults(config.get("text_config") or config, defaults, "text_config")


def positive_int(section: Mapping[str, Any], key: str, where: str) -> int:
    """``section[key]`` as a positive int, or a one-line error naming the field."""
    value = section.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}.{key} must be a positive integer, got {value!r}")
    if value > MAX_CONFIG_INTEGER:
        raise ValueError(f"{where}.{key} = {value:,} is above {MAX_CONFIG_INTEGER:,}, the most any model has")
    return value


def ints(section: Mapping[str, Any], keys: str, where: str) -> list[int]:
    """Several positive ints from a whitespace-separated key list."""
    return [positive_int(section, key, where) for key in keys.split()]


def heads_divide(width: int, heads: int, where: str) -> int:
    """Head width ``width // heads``; transformers rejects widths that heads do not divide."""
    if width % heads:
        raise ValueError(f"{where}: hidden size {width} is not divisible by {heads} attention heads")
    return width // heads

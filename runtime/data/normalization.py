"""How each family's processor normalises pixels: (image_mean, image_std) of the checkpoints'
preprocessor_config.json, by ``model_type``. The data readers normalise with it; each vision family's adapter
names its own as ``IMAGE_NORMALIZATION``."""

from __future__ import annotations

from typing import Any

from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

CLIP = (tuple(OPENAI_CLIP_MEAN), tuple(OPENAI_CLIP_STD))
"""CLIP's (Qwen2-VL, Qwen2.5-VL)."""
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
"""Mean and deviation 0.5 per channel (Qwen3-VL)."""
IMAGE_NORMALIZATIONS = {"qwen2_vl": CLIP, "qwen2_5_vl": CLIP, "qwen3_vl": HALF, "qwen3_vl_moe": HALF}


def image_normalization(config: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(image_mean, image_std) of an HF config's family."""
    return IMAGE_NORMALIZATIONS[config.model_type]

"""Activation recomputation (Chen et al. 2016; selective: Korthikanti et al. 2022) with torch.utils.checkpoint.

- "full": every block (vision block / decoder layer) keeps only its input; transformers' own
  ``GradientCheckpointingLayer`` checkpoints the block's ``forward`` (not ``__call__``, so FSDP2's hooks stay
  outside the recomputed region), non-reentrant.
- "selective": only the attention core (SDPA) is recomputed: the runtime's attention kernel runs it under
  ``checkpoint`` on modules flagged here (runtime.parallel.attention); in a Gated DeltaNet layer, its chunked delta
  rule (runtime.models.linear_attention).
"""

from __future__ import annotations

from torch import nn

from runtime.parallel.attention import RECOMPUTE_FLAG


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Turn on ``mode`` ("none", "selective", "full") for a transformers PreTrainedModel (tower or decoder)."""
    if mode == "full":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif mode == "selective":
        for module in model.modules():
            if type(module).__name__.endswith(("Attention", "GatedDeltaNet")):
                setattr(module, RECOMPUTE_FLAG, True)
    else:
        assert mode == "none", mode

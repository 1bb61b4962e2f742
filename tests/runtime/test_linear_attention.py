"""The runtime's Gated DeltaNet layer (runtime.models.linear_attention) on CPU: each sample of a packed row runs as if
alone, the layer keeps for backward what the planner prices on the torch kernel (no and selective recomputation),
transformers' torch code runs under its kernel dispatch, and an fla plan without fla-core is refused in one line
before any training."""

from __future__ import annotations

import sys
from dataclasses import replace
from unittest import mock

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from planner.catalog import get_model
from planner.contract.hardware import get_device
from planner.cost.assumptions import DEFAULT_ASSUMPTIONS
from planner.cost.comm import Link
from planner.cost.layers import Shard, layer_terms
from runtime.models import linear_attention
from runtime.models.linear_attention import FLA_MISSING, run_by_segments, torch_fallback
from runtime.observability.memory import TensorMemory, device_snapshot
from runtime.parallel.attention import RECOMPUTE_FLAG

MODEL = get_model("qwen3.5-tiny")
TEXT = hf.Qwen3_5Config(**MODEL.hf_config).text_config
LINEAR = MODEL.module("llm").layer("linear_decoder_layer")
SEGMENTS = (256, 256)
"""A packed row of two samples of whole chunks (the fallback's padding of a segment to 64 tokens is not priced)."""
SAVED_TOLERANCE = 0.01
"""Measured vs priced: what is not priced is the norms' fp32 rms per token, the conv's 3 extra outputs per segment
and the rule's 64 x 64 mask per call, 36 bytes a token beside 25.5 KB."""


def _layer(kernel: str = "torch") -> torch.nn.Module:
    """The tiny model's first decoder layer (a Gated DeltaNet one), fp32, running as the runtime runs it."""
    torch.manual_seed(0)
    layer = hf.Qwen3_5DecoderLayer(TEXT, layer_idx=TEXT.layer_types.index("linear_attention"))
    run_by_segments(layer.linear_attn, kernel)
    return layer


def _row(segments=SEGMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    cu = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(1, sum(segments), TEXT.hidden_size, requires_grad=True), cu


def test_each_sample_of_a_packed_row_runs_as_if_alone():
    layer = _layer()
    x, cu = _row((96, 160))
    packed = layer(x, position_embeddings=None, cu_seq_lens_q=cu)
    alone = torch.cat([layer(part, position_embeddings=None) for part in x.split([96, 160], dim=1)], dim=1)
    torch.testing.assert_close(packed, alone)


def _kept_bytes(layer: torch.nn.Module, segments=SEGMENTS) -> int:
    """Tensor bytes one forward over a packed row leaves alive beside its output, the row included (the planner
    counts the layer's input, which its first norm keeps; MemTracker also counts a checkpoint's inputs, which
    saved-tensor hooks do not see)."""
    tracker = TensorMemory()
    tracker.track_external(layer)
    with tracker:
        before = device_snapshot(tracker.get_tracker_snapshot())["Total"]
        x, cu = _row(segments)
        out = layer(x, position_embeddings=None, cu_seq_lens_q=cu)
        after = device_snapshot(tracker.get_tracker_snapshot())["Total"]
    return after - before - out.numel() * out.element_size()


def _priced(recompute: str) -> float:
    """The planner's saved bytes of the same layer: fp32 activations, the torch kernel, tp = sp = 1."""
    link = Link(bandwidth=1e10, latency=1e-5)
    assumptions = replace(DEFAULT_ASSUMPTIONS, activation_bytes=4, linear_attention_kernel="torch")
    shard = Shard(tp=1, sp=1, cp=1, micro_batch=1, tokens=sum(SEGMENTS), segment_tokens=SEGMENTS[0],
                  segments=len(SEGMENTS), window_tokens=0.0, windows=0, recompute=recompute, backward="full",
                  tp_link=link, sp_link=link, cp_link=link, device=get_device("cpu"), assumptions=assumptions)
    return layer_terms(LINEAR, shard).saved_bytes


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_the_layer_keeps_what_the_planner_prices_on_the_torch_kernel(recompute):
    """Without recomputation the torch rule's fp32 intermediates (1.64x fla's saved set on this layer); with
    selective recomputation the rule runs under a checkpoint, which keeps its inputs (the conv's output, the
    decay) instead."""
    layer = _layer()
    setattr(layer.linear_attn, RECOMPUTE_FLAG, recompute == "selective")
    assert _kept_bytes(layer) == pytest.approx(_priced(recompute), rel=SAVED_TOLERANCE)


def test_the_torch_kernel_is_transformers_torch_code_under_its_dispatch():
    """What a ``torch`` plan runs whether or not fla / causal-conv1d are installed: the functions the dispatching
    modules wrap, giving the same numbers as the dispatch where (as on a CPU) it falls back to them."""
    rule = torch_fallback(hf.torch_chunk_gated_delta_rule)
    assert not isinstance(rule, torch.nn.Module) and rule.__name__ == "torch_chunk_gated_delta_rule"
    assert not hasattr(rule, "__wrapped__")
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 70, 2, 8), torch.randn(1, 70, 2, 8), torch.randn(1, 70, 4, 8)
    g, beta = -torch.rand(1, 70, 4), torch.rand(1, 70, 4)
    torch.testing.assert_close(rule(q, k, v, g=g, beta=beta)[0], hf.torch_chunk_gated_delta_rule(q, k, v, g, beta)[0])


def test_an_fla_plan_without_fla_core_is_refused_in_one_line():
    layer = hf.Qwen3_5GatedDeltaNet(TEXT, layer_idx=0)
    with mock.patch.dict(sys.modules, {"fla": None, "fla.modules.causal_conv1d": None,
                                       "fla.ops.gated_delta_rule": None}):
        with pytest.raises(ValueError, match=r"^the plan runs its linear-attention layers on flash-linear-attention's "
                                             r"kernel \(linear_attention fla\), which is not installed here: pip "
                                             r"install 'dhplan\[gpu\]' \(fla-core\), or re-plan with "
                                             r"--linear-attention torch$"):
            run_by_segments(layer, "fla")
    assert "\n" not in FLA_MISSING and linear_attention.KERNELS.keys() == {"fla", "torch"}

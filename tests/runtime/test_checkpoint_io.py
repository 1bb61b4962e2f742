"""Pieces of sharded start-up that need no process group (or a fake one of one rank): Hub names, slices in a parallel
layout, file plans, precision recipes, the attention kernel choice, ``--save`` into a folder that holds a model."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from runtime.checkpoints.hf_folder import HFFolder, legacy_names, plan_files, read_region
from runtime.models.model import build_model
from runtime.parallel import attention
from runtime.parallel.precision import module_precision
from runtime.parallel.tensor_parallel import qkv_row_order, qkv_to_tp_layout
from runtime.parallel.parallel_dims import forget_earlier_worlds
from runtime.training.trainer import RunOptions, Trainer
from tests.runtime.plans import make_plan, tiny_hf_config, tiny_qwen2_audio_config


def test_legacy_hub_names_are_those_transformers_renames():
    assert legacy_names("model.visual.blocks.0.attn.qkv.weight") == ["visual.blocks.0.attn.qkv.weight"]
    assert legacy_names("model.language_model.layers.1.mlp.up_proj.weight") == [
        "model.layers.1.mlp.up_proj.weight", "language_model.model.layers.1.mlp.up_proj.weight"]
    assert legacy_names("lm_head.weight") == ["language_model.lm_head.weight"]
    assert legacy_names("model.audio_tower.conv1.weight") == ["audio_tower.conv1.weight"]


@pytest.mark.parametrize("config", [tiny_hf_config(), tiny_qwen2_audio_config()], ids=["qwen2_5_vl", "qwen2_audio"])
def test_build_model_loads_a_single_file_checkpoint_with_hub_names(config, tmp_path):
    """The Hub's Qwen uploads predate transformers 5 (one file here, bf16): Qwen-VL's ``visual.*`` / ``model.*``
    names, Qwen2-Audio's ``audio_tower.*`` / ``language_model.model.*`` / ``language_model.lm_head.*``, as
    transformers 5 itself still writes them (``save_pretrained``)."""
    saved = build_model(config, seed=7)
    saved.to(torch.bfloat16).save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    hub = "visual." if "vision_config" in config else "language_model.lm_head."
    assert any(name.startswith(hub) for name in tensors)
    loaded = build_model(config, seed=0, checkpoint=str(tmp_path))
    for name, param in loaded.named_parameters():
        stored = next(n for n in (name, *legacy_names(name)) if n in tensors)
        assert param.dtype == torch.float32
        assert torch.equal(param, tensors[stored].float()), name


def test_hf_folder_refuses_what_is_not_this_model(tmp_path):
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors"):
        HFFolder(str(tmp_path))
    save_file({"lm_head.weight": torch.zeros(4, 2)}, tmp_path / "model.safetensors")
    folder = HFFolder(str(tmp_path))
    with pytest.raises(ValueError, match=r"holds lm_head.weight with shape \[4, 2\], the plan's model has \[8, 2\]"):
        folder.read("lm_head.weight", (slice(0, 4), slice(0, 2)), torch.Size([8, 2]))
    with pytest.raises(ValueError, match="has no tensor model.visual.merger.mlp.0.weight"):
        folder.read("model.visual.merger.mlp.0.weight", (slice(0, 1),), torch.Size([1]))


def test_hf_folder_says_which_file_is_corrupt_in_one_line(tmp_path):
    save_file({"lm_head.weight": torch.zeros(8, 2)}, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": ')
    index = tmp_path / "model.safetensors.index.json"
    with pytest.raises(ValueError) as refused:
        HFFolder(str(tmp_path))
    assert str(refused.value) == f"weight index {index} is not JSON: Expecting value at line 1"  # named once
    index.write_text('{"weight_map": ["lm_head.weight"]}')
    with pytest.raises(ValueError) as refused:
        HFFolder(str(tmp_path))
    assert str(refused.value).startswith(f"weight index {index} holds no \"weight_map\"")
    assert str(refused.value).count(str(index)) == 1 and "\n" not in str(refused.value)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}}')
    data = (tmp_path / "model-00001-of-00001.safetensors").read_bytes()
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(data[: len(data) // 2])  # a cut-off download
    with pytest.raises(ValueError, match=r"cannot read lm_head.weight from .*model-00001-of-00001.safetensors: .*\(a "
                                         r"corrupt or incomplete download\? fetch the file again\)$"):
        HFFolder(str(tmp_path)).read("lm_head.weight", (slice(0, 8), slice(0, 2)), torch.Size([8, 2]))


class _Full:
    """A source holding one full tensor, counting reads."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.reads = tensor, 0

    def read(self, hf_name, index, shape):
        assert shape == self.tensor.shape
        self.reads += 1
        return self.tensor[index]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tp_rank_reads_its_qkv_rows_from_the_hf_layout(tp):
    heads, head_dim, width = 8, 2, 3
    full = torch.randn(3 * heads * head_dim, width)
    source, rows = _Full(full), qkv_row_order(len(full), tp)
    stored = qkv_to_tp_layout(full, tp)
    shard = len(full) // tp
    for rank in range(tp):
        region = (slice(rank * shard, (rank + 1) * shard), slice(1, 3))
        assert torch.equal(read_region(source, "qkv", full.shape, region, rows), stored[region])
    assert source.reads == 3 * tp  # one contiguous run of HF rows per q, k, v block of each rank


def test_files_split_at_the_size_cap_and_modules_and_rotate_over_the_module_ranks():
    tensors = {"vision": [("a", 6), ("b", 6), ("c", 20)], "llm": [("d", 3), ("e", 3)]}
    files = plan_files(tensors, {"vision": (2, 3), "llm": (0, 1)}, max_file_bytes=12)
    assert [(f.name, f.owner, f.tensors) for f in files] == [
        ("model-00001-of-00003.safetensors", 2, ("a", "b")),
        ("model-00002-of-00003.safetensors", 3, ("c",)),  # larger than the cap: a file of its own
        ("model-00003-of-00003.safetensors", 0, ("d", "e")),
    ]


def test_precision_cpu_fp32_gpu_fsdp_mixed_precision_or_autocast_or_pure_bf16():
    for precision in ("bf16_mixed", "bf16_pure"):
        cpu = module_precision(precision, "cpu", fsdp=True)
        assert (cpu.param_dtype, cpu.fsdp_policy, cpu.autocast_dtype) == (torch.float32, None, None)
    fsdp = module_precision("bf16_mixed", "cuda", fsdp=True)
    assert fsdp.param_dtype == torch.float32 and fsdp.autocast_dtype is None
    assert (fsdp.fsdp_policy.param_dtype, fsdp.fsdp_policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    plain = module_precision("bf16_mixed", "cuda", fsdp=False)
    assert (plain.param_dtype, plain.fsdp_policy, plain.autocast_dtype) == (torch.float32, None, torch.bfloat16)
    pure = module_precision("bf16_pure", "cuda", fsdp=True)
    assert (pure.param_dtype, pure.fsdp_policy, pure.autocast_dtype) == (torch.bfloat16, None, None)


def test_attention_kernel_is_sdpa_on_cpu_and_with_an_explicit_mask():
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert attention.attention_core(q, None) is attention.sdpa_attention_forward  # CPU: SDPA, even in bf16
    assert attention.attention_core(q, torch.ones(1, 1, 4, 4, dtype=torch.bool)) is attention.sdpa_attention_forward


def test_save_into_the_folder_the_run_started_from_leaves_the_new_model_alone(tmp_path):
    """``--checkpoint hf --save hf`` on a folder holding one ``model.safetensors``: the saved folder holds the
    trained weights alone (the stale file removed), so ``from_pretrained`` and ``--checkpoint`` read the same ones;
    the files beside them (tokenizer, generation config) stay."""
    from transformers import AutoModelForImageTextToText

    folder = str(tmp_path / "hf")
    build_model(tiny_hf_config(), seed=7).save_pretrained(folder)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert "model.safetensors" in os.listdir(folder)
    forget_earlier_worlds()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(make_plan({}, {}), rank=0, options=RunOptions(checkpoint=folder))
        trainer.train_step()
        trainer.save_hf_folder(folder)
        trained = trainer.full_tensors("param")
    finally:
        dist.destroy_process_group()
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                                          "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                          "tokenizer.json"]
    loaded = dict(AutoModelForImageTextToText.from_pretrained(folder).named_parameters())
    assert loaded.keys() == trained.keys()
    runtime_view = HFFolder(folder)
    for name, tensor in trained.items():
        assert torch.equal(loaded[name].detach(), tensor), name
        assert torch.equal(runtime_view.read(name, (), tensor.shape), tensor), name

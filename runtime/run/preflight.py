"""Checks that need neither torch, Ray nor transformers, run before any of them is imported: the plan's
structure, the input paths (``--data``, ``--checkpoint``), the output paths (``--metrics``, ``--save``) and
torchrun's environment. A mistake there costs a fraction of a second, not the 5-12 s of importing torch and
starting Ray. Also the other end of the run: saving the trained weights with a fallback folder, so that a
path that became unwritable during training never loses them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from planner.contract.rules import CONTEXT_PARALLEL_MODULES, balancing_loss_rule
from planner.contract.schema import Plan
from runtime.run.checkpoint_dir import Problem, read_run_state, resolve_resume, run_state_problem
from planner.contract.file_io import check_output, read_json

ENCODERS = ("vision", "audio")
"""Encoder modules the runtime places, one per plan, before the ``llm``."""
DATA_ENCODERS = ("vision",)
"""Encoders whose data files the runtime reads (images, video frames); the others train on synthetic samples."""

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
"""Either marks a folder written by ``save_pretrained`` (one file, or shards with their index)."""

SHAPE_KEYS = {
    "": ("model_type",),
    "text_config": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads"),
    "vision_config": ("depth", "embed_dim", "hidden_size", "intermediate_size", "mlp_ratio", "num_heads",
                      "out_hidden_size", "in_channels", "patch_size", "spatial_merge_size", "temporal_patch_size"),
}
"""Config fields, per section, that fix the shapes of the weights: a checkpoint must agree with the plan on
every one both of them state."""

FALLBACK_PREFIX = "dhplan-weights-"
"""Name prefix of the timestamped folder the weights go to when ``--save`` cannot be written."""

BALANCE_POLICIES = ("modules", "tokens")
"""How a dataset plan's step is split over the replicas (``--balance``): ``modules``, each module's replicas on its
own work (``planner.cost.balance``, what the plan priced); ``tokens``, the earlier split, kept to compare with: the packs
dealt to the LLM replicas by LLM tokens, vision replica ``d`` running the images of the micro-batch's ``d``-th share
of packs (LLM replica ``d``'s when the degrees match)."""

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Environment variables torchrun sets in each process it starts; all of them present means "under torchrun"."""


class SavedElsewhere(Exception):
    """The trained weights could not be written where asked and were written to a fallback folder."""


def is_cpu_plan(plan: Plan) -> bool:
    """A plan made for ``--gpu cpu`` runs on CPU workers."""
    return plan.cluster.device.name.lower() == "cpu"


def num_devices(plan: Plan) -> int:
    """Distinct global ranks the plan uses."""
    return len({r for m in plan.modules for r in m.ranks})


def context_parallel_refusal(module: str, cp: int, *, pp: int = 1, attention: str = "sdpa") -> str | None:
    """Why the runtime does not run a module with ring context parallelism (runtime.parallel.ring), if it does not."""
    name = f"{module}: context parallelism (cp={cp})"
    if module not in CONTEXT_PARALLEL_MODULES:
        return f"{name} is run for the LLM and the vision tower only: plan it with cp=1"
    if pp > 1:
        return f"{name} with pipeline parallelism (pp={pp}) is not run yet: plan one of them"
    if attention == "varlen":
        return f"{name} runs the SDPA ring kernels, not variable-length attention: plan it with --attention sdpa"
    return None


def check_pipeline(plan: Plan, module: Any) -> None:
    """What the runtime's pipeline (runtime.models.pipeline) does not run yet, in one line each."""
    name = f"{module.name}: pipeline parallelism (pp={module.pp})"
    if module.name != "llm":
        raise NotImplementedError(f"{name} is run for the LLM only")
    dataset = plan.workload.dataset
    if dataset is not None and dataset.pack_tokens is None:
        raise NotImplementedError(f"{name} on a dataset without packing is not run (its micro-batches are padded to "
                                  "the pack budget, and this plan has none): plan with packs")
    if dataset is not None and module.sp > 1:
        raise NotImplementedError(f"{name} with sp={module.sp} on a dataset plan is not run (each micro-batch's "
                                  "samples split the sequence differently): plan without one of the two")
    config = plan.model.hf_config
    if config.get("tie_word_embeddings") or config.get("text_config", {}).get("tie_word_embeddings"):
        raise NotImplementedError(f"{name} with lm_head tied to the embedding (first and last stage) is not run yet")


def no_data_reader(encoder: str, data: str) -> str:
    """Why ``--data`` is refused for a plan whose encoder reads no data files."""
    return (f"--data {data}: the runtime reads no {encoder} data yet; an {encoder} plan trains on synthetic samples "
            "(leave out --data)")


def module_names(plan: Plan) -> tuple[str, str]:
    """(the encoder, ``llm``): the modules of a plan the runtime runs.

    Raises:
        NotImplementedError: the plan has other modules (one line).
    """
    names = sorted(m.name for m in plan.modules)
    encoders = [name for name in names if name in ENCODERS]
    if len(encoders) != 1 or sorted([encoders[0], "llm"]) != names:
        raise NotImplementedError(f"the runtime runs plans with one encoder ({' or '.join(ENCODERS)}) and an llm, "
                                  f"this one has {names}")
    return encoders[0], "llm"


def check_plan(plan: Plan) -> None:
    """The plan's structure: its modules, their ranks and how the two modules' batches line up.

    Raises:
        ValueError, NotImplementedError: in one line.
    """
    encoder, _ = module_names(plan)
    tower, llm = plan.module(encoder), plan.module("llm")
    for module in (tower, llm):
        if module.cp > 1 and (problem := context_parallel_refusal(
                module.name, module.cp, pp=module.pp, attention=module.attention)):
            raise NotImplementedError(problem)
        if module.pp > 1:
            check_pipeline(plan, module)
        if module.attention == "varlen" and is_cpu_plan(plan):
            raise ValueError(f"module {module.name}: attention varlen is torch's variable-length flash kernel, which "
                             "needs CUDA; plan for a CPU with --attention sdpa")
        if module.linear_attention == "fla" and is_cpu_plan(plan):
            raise ValueError(f"module {module.name}: linear_attention fla is flash-linear-attention's CUDA kernel; "
                             "plan for a CPU with --linear-attention torch")
        if module.loss_chunk_tokens and module.pp > 1:
            raise NotImplementedError(f"module {module.name}: a pipelined LLM's loss takes the last stage's whole "
                                      "logits; plan it with loss_chunk_tokens 0")
    text = plan.model.hf_config.get("text_config", plan.model.hf_config)
    if problem := balancing_loss_rule(llm.pp, text.get("output_router_logits") is True):
        raise NotImplementedError(problem)
    if tower.frozen and llm.frozen:
        raise ValueError("every module of the plan is frozen: nothing to train")
    packed = plan.workload.dataset is not None  # its vision replicas take each micro-batch's images by work
    if tower.grad_accum != llm.grad_accum or (not packed and tower.dp * tower.micro_batch != llm.dp * llm.micro_batch):
        raise ValueError(f"{encoder} and llm must agree on grad_accum and on samples per micro-batch "
                         "(dp * micro_batch)")
    if plan.placement == "colocated" and set(tower.ranks) != set(llm.ranks):
        raise ValueError(f"a colocated plan must place {encoder} and llm on the same ranks")
    if plan.placement == "disjoint" and set(tower.ranks) & set(llm.ranks):
        raise ValueError(f"a disjoint plan must place {encoder} and llm on different ranks")
    if sorted(set(tower.ranks) | set(llm.ranks)) != list(range(num_devices(plan))):
        raise ValueError("the plan's ranks must be 0..N-1")


def check_balance(plan: Plan, balance: str) -> None:
    """``--balance`` names a policy of ``BALANCE_POLICIES``, and another than the default only for a dataset plan
    (a fixed-shape plan's replicas hold equal samples); raises ValueError (one line)."""
    if balance not in BALANCE_POLICIES:
        raise ValueError(f"--balance must be {' or '.join(BALANCE_POLICIES)}, got {balance!r}")
    if balance != BALANCE_POLICIES[0] and plan.workload.dataset is None:
        raise ValueError(f"--balance {balance} splits a dataset plan's packs; this plan's samples are of one fixed "
                         "shape (plan with --dataset, or drop --balance)")


def check_inputs(plan: Plan, *, data: str | None, checkpoint: str | None, tokenizer: str | None) -> None:
    """``--data`` is a readable file or folder; ``--tokenizer`` a folder with a tokenizer; ``--checkpoint`` a
    ``save_pretrained`` folder of the plan's model; a plan whose encoder reads no data files (audio) has no
    ``--data``."""
    encoder = module_names(plan)[0]
    if data is not None and encoder not in DATA_ENCODERS:
        raise ValueError(no_data_reader(encoder, data))
    if data is not None:
        check_data(data)
    if tokenizer is not None and not os.path.isfile(os.path.join(tokenizer, "tokenizer_config.json")):
        raise ValueError(f"--tokenizer {tokenizer} is not a folder with a tokenizer (no tokenizer_config.json)")
    check_conversations(plan, data, tokenizer)
    if checkpoint is not None:
        check_checkpoint(checkpoint, plan.model.hf_config)


def is_conversation_file(path: Path) -> bool:
    """Whether a data file holds conversations (its first row has ``conversations`` or ``messages``)."""
    if not path.is_file():
        return False
    with path.open() as f:
        head = f.read(1 << 16).lstrip()
    if head.startswith("["):
        return '"conversations"' in head or '"messages"' in head
    first = head.splitlines()[0] if head else ""
    try:
        row = json.loads(first)
    except (json.JSONDecodeError, RecursionError):
        return False
    return isinstance(row, dict) and ("conversations" in row or "messages" in row)


def check_conversations(plan: Plan, data: str | None, tokenizer: str | None) -> None:
    """Conversation data comes with ``--tokenizer`` (and only it does); a plan made for a dataset runs on
    conversation data (the packed, native-resolution path); a fixed-shape plan takes conversations only without
    LLM sequence parallelism: its hand-off routes each SP rank the image tokens of the layout's template (images
    first), and a conversation's image tokens sit after its system prompt."""
    conversations = data is not None and is_conversation_file(Path(data))
    dataset = plan.workload.dataset
    if dataset is not None and not conversations:
        raise ValueError(f"this plan was made for the dataset {dataset.source}: give --data FILE of conversation or "
                         "messages rows (that file, or another like it) and --tokenizer DIR")
    if conversations and tokenizer is None:
        raise ValueError(f"{data} holds conversations: give --tokenizer DIR, the model folder whose tokenizer and "
                         "chat template they go through")
    if tokenizer is not None and not conversations:
        raise ValueError("--tokenizer applies to conversation data (--data FILE of conversations or messages rows)")
    if conversations and dataset is None and plan.module("llm").sp > 1:
        raise NotImplementedError(f"conversation data under LLM sequence parallelism (sp={plan.module('llm').sp}) "
                                  "runs with plans made for a dataset (plan --dataset), not fixed-shape ones: plan "
                                  "with llm.sp=1 or --dataset")


def check_data(path: str) -> None:
    """A JSONL file that reads as UTF-8 text, or a folder that can be listed."""
    if not os.path.exists(path):
        raise ValueError(f"data path {path} does not exist")
    try:
        if os.path.isdir(path):
            os.listdir(path)
        elif os.path.isfile(path):
            with open(path, "rb") as file:
                for number, line in enumerate(file, 1):
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ValueError(f"data file {path} line {number} is not UTF-8 text: expected JSONL") from None
        else:
            raise ValueError(f"data path {path} is neither a JSONL file nor a folder of images")
    except OSError as e:
        raise ValueError(f"cannot read data path {path}: {e.strerror}") from None


def read_checkpoint_config(path: str) -> dict[str, Any]:
    """The ``config.json`` of a ``save_pretrained`` folder, after checking the folder holds weights too."""
    if not os.path.exists(path):
        raise ValueError(f"checkpoint {path} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint {path} is not a folder written by save_pretrained")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"checkpoint {path} has no config.json: not a folder written by save_pretrained")
    config = read_json(config_path, kind="checkpoint config")
    if not isinstance(config, dict):
        raise ValueError(f"checkpoint {path}: config.json holds a {type(config).__name__}, not a JSON object")
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        raise ValueError(f"checkpoint {path} has no weights ({' or '.join(WEIGHT_FILES)})")
    return config


def check_checkpoint(path: str, hf_config: dict[str, Any]) -> None:
    """A ``save_pretrained`` folder whose config gives the plan's model the same weight shapes."""
    check_same_model(path, read_checkpoint_config(path), hf_config)


def check_same_model(path: str, config: dict[str, Any], hf_config: dict[str, Any]) -> None:
    """The config of the checkpoint at ``path`` gives the plan's model the same weight shapes."""
    for section, keys in SHAPE_KEYS.items():
        theirs, ours = _config_section(config, section), _config_section(hf_config, section)
        for key in keys:
            if key in theirs and key in ours and theirs[key] != ours[key]:
                where = f"{section}.{key}" if section else key
                raise ValueError(
                    f"checkpoint {path} is for another model than the plan's {hf_config.get('model_type')}: "
                    f"{where} is {theirs[key]!r} there, {ours[key]!r} in the plan"
                )


def _config_section(config: dict[str, Any], section: str) -> dict[str, Any]:
    """One section of an HF config; text fields may sit at the top level (older Hub configs) or nested."""
    if section == "":
        return config
    nested = config.get(section)
    nested = nested if isinstance(nested, dict) else {}
    return {**config, **nested} if section == "text_config" else nested


def check_resume(resume: str, checkpoint_dir: str | None, hf_config: dict[str, Any], *, steps: int,
                 problem: Problem = run_state_problem, warn: Callable[[str], None] = lambda line: None) -> str:
    """The complete training checkpoint ``--resume`` names (runtime.run.checkpoint_dir.resolve_resume: from the
    latest, the newest in which ``problem`` finds nothing wrong), checked to be of the plan's model and to have
    done fewer than ``steps`` steps; returns its path."""
    path = resolve_resume(resume, checkpoint_dir, problem, warn)
    done = read_run_state(path)["step"]
    if done >= steps:
        raise ValueError(f"--resume {path} has done {done} steps already; --steps {steps} counts them: ask for more")
    config_path = os.path.join(path, "config.json")
    config = read_json(config_path, kind="--resume checkpoint config")
    if not isinstance(config, dict):
        raise ValueError(f"--resume {path}: its config.json holds a {type(config).__name__}, not a JSON object")
    check_same_model(path, config, hf_config)
    return path


def prepare_folder(path: str, flag: str) -> None:
    """Create an output folder (and its parents) and check a file can be written into it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path} cannot be written: {e.strerror or e}") from None


def check_outputs(*, metrics: str | None, save: str | None) -> None:
    """Every output path can be written, before the first step: the metrics file is created (and removed if it
    was not there), the save folder is created and a probe file written into it."""
    if metrics is not None:
        check_metrics_path(metrics)
    if save is not None:
        prepare_save_folder(save)


def check_metrics_path(path: str) -> None:
    """A file that can be opened for writing, in an existing folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--metrics {path}: {folder} is not an existing folder")
    check_output(path, "--metrics")  # before opening: opening a named pipe to write blocks
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"--metrics {path} cannot be written: {e.strerror}") from None
    if not existed:
        os.remove(path)


def prepare_save_folder(path: str) -> None:
    """Create the ``--save`` folder (and its parents) and check a file can be written into it."""
    prepare_folder(path, "--save")


@dataclass(kw_only=True, frozen=True)
class TorchrunEnv:
    """This process's place in a torchrun job, read from the environment torchrun sets."""

    rank: int
    """Global rank (``RANK``)."""
    world_size: int
    """Processes in the job (``WORLD_SIZE``)."""
    local_rank: int
    """Rank on this node (``LOCAL_RANK``): the index of this process's GPU."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> TorchrunEnv | None:
        """The torchrun environment, or None when the process was not started by torchrun."""
        if not all(name in environ for name in TORCHRUN_VARIABLES):
            return None
        try:
            return cls(rank=int(environ["RANK"]), world_size=int(environ["WORLD_SIZE"]),
                       local_rank=int(environ["LOCAL_RANK"]))
        except ValueError:
            raise ValueError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None


def check_world_size(plan: Plan, env: TorchrunEnv) -> None:
    """torchrun started one process per device of the plan."""
    need = num_devices(plan)
    if env.world_size != need:
        raise ValueError(
            f"torchrun started {env.world_size} processes but the plan uses {need} devices: run torchrun with "
            f"{need} processes in all (--nnodes x --nproc-per-node = {need})"
        )


T = TypeVar("T")


def save_with_fallback(write: Callable[[str], None], path: str, *, agree: Callable[[T], T] = lambda value: value
                       ) -> None:
    """Write the weights with ``write(folder)`` to ``path``; if that fails or leaves no loadable folder, write
    them to a timestamped folder in the current directory (else the system temp folder) instead.

    Args:
        write: writes the trained weights to a folder (collective under torchrun: every rank calls it).
        path: the folder the user asked for (``--save``).
        agree: makes every process use one process's value (rank 0's under torchrun); identity on Ray.

    Raises:
        SavedElsewhere: the weights are in a fallback folder (named in the message).
        OSError: no folder could be written.
    """
    error = agree(_write_error(write, path))
    if error is None:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    fallbacks = agree([os.path.join(base, FALLBACK_PREFIX + stamp) for base in (os.getcwd(), tempfile.gettempdir())])
    for folder in fallbacks:
        if agree(_write_error(write, folder)) is None:
            raise SavedElsewhere(f"cannot save to {path} ({error}); the trained weights were written to {folder}")
    raise OSError(f"cannot save to {path} ({error}) nor to {' or '.join(fallbacks)}: the trained weights are lost")


def _write_error(write: Callable[[str], None], folder: str) -> str | None:
    """None when ``write`` left a loadable folder, else why not (one line)."""
    try:
        write(folder)
        read_checkpoint_config(folder)
    except Exception as e:  # any failure to write (OSError, safetensors' own errors, ...) must reach the fallback
        return " ".join(str(e).split()) or type(e).__name__
    return None

"""``python -m runtime.export CHECKPOINT OUT``: a complete training checkpoint (runtime.checkpoints.dcp_checkpoint) as a
Hugging Face folder that ``from_pretrained`` and ``--checkpoint`` load, with no running job and no process group.

The checkpoint is checked as ``--resume`` checks it (runtime.checkpoints.dcp_checkpoint.checkpoint_problem; its metadata
read without running code from it, runtime.checkpoints.dcp_metadata). The weights are read with DCP's no-distributed load (``dcp.load(..., no_dist=True)``), which assembles each
tensor from the shards every rank wrote, whatever the plan was. They are read and written one output file at a
time (at most ``--max-file-bytes``, one tensor at least), so the exporting process holds one file's tensors.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from runtime.run.checkpoint_dir import is_complete


def export(checkpoint: str, out: str, *, max_file_bytes: int = 1 << 30) -> list[str]:
    """Write the checkpoint's weights and config as a Hugging Face folder ``out``; returns the tensor names.

    Raises:
        ValueError: ``checkpoint`` is not a complete training checkpoint.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from runtime.checkpoints.hf_folder import plan_files, write_index
    from runtime.checkpoints.dcp_checkpoint import CONFIG_FILE, PARAM, checkpoint_problem
    from runtime.checkpoints.dcp_metadata import SafeFileSystemReader, read_metadata
    from planner.contract.file_io import read_text, write_output

    if not os.path.isdir(checkpoint) or not is_complete(checkpoint):
        raise ValueError(f"{checkpoint} is not a complete training checkpoint (written by --checkpoint-dir)")
    problem = checkpoint_problem(checkpoint)  # the check --resume makes: a damaged or crafted one is refused
    if problem is not None:
        raise ValueError(f"{checkpoint} is damaged: {problem}")
    metadata = read_metadata(checkpoint).state_dict_metadata
    prefix = PARAM + "/"
    shapes = {key.removeprefix(prefix): (meta.size, meta.properties.dtype)
              for key, meta in metadata.items() if key.startswith(prefix)}
    sizes = {"model": [(name, size.numel() * dtype.itemsize) for name, (size, dtype) in shapes.items()]}
    files = plan_files(sizes, {"model": (0,)}, max_file_bytes)
    os.makedirs(out, exist_ok=True)
    for file in files:
        tensors = {prefix + name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in file.tensors}
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=SafeFileSystemReader(checkpoint), no_dist=True)
        save_file({k.removeprefix(prefix): v for k, v in tensors.items()}, os.path.join(out, file.name),
                  metadata={"format": "pt"})
    total = sum(nbytes for _, nbytes in sizes["model"])
    write_index(out, total, {n: f.name for f in files for n in f.tensors})  # after every weight file, atomically
    config = os.path.join(checkpoint, CONFIG_FILE)
    write_output(os.path.join(out, CONFIG_FILE), read_text(config, kind="checkpoint config"), flag="the export")
    return sorted(shapes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.export",
                                     description="Export a training checkpoint as a Hugging Face folder.")
    parser.add_argument("checkpoint", help="a complete checkpoint folder (DIR/step-NNNNNN of --checkpoint-dir)")
    parser.add_argument("out", help="the Hugging Face folder to write (created)")
    args = parser.parse_args(argv)
    try:
        names = export(args.checkpoint, args.out)
    except (ValueError, OSError) as e:
        print(f"runtime.export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(names)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A DCP checkpoint's ``.metadata`` read without running code from it.

torch.distributed.checkpoint pickles its ``Metadata`` and ``FileSystemReader.read_metadata`` unpickles it with
``pickle.load``: a crafted ``.metadata`` would run whatever its pickle asks for (``os.system``, ``open``, ...) in
the process resuming or exporting it. Here the pickle may name only the classes a metadata file of this project's
checkpoints is made of (``ALLOWED``, found by recording the classes every checkpoint the tests write asks for:
plain, FSDP2, TP, SP and pipeline shards all give the same ones); anything else is refused in one line before it
is created. Every path that reads a training checkpoint reads its metadata here (``read_metadata``), and loads
its shards through ``SafeFileSystemReader``.

Tensor entries only: DCP unpickles an entry stored as bytes (``BytesStorageMetadata``, never written by this
project) with torch's unrestricted loader, so that class is refused too.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_FILE = ".metadata"
"""DCP's metadata file in a checkpoint folder."""

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "StorageMeta"), (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
})
"""(module, name) of every class or function a DCP metadata pickle may name: DCP's metadata dataclasses, the
storage index of its file system writer, ``torch.Size``, torch's dtypes, the layout lookup ``TensorProperties``
unpickles with, the checkpoint's path and an ordered dict. Built-in containers, strings and numbers need none."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint's metadata names something a DCP metadata file never holds: it is refused, not unpickled."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that creates only ``ALLOWED`` classes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise UnsafeCheckpoint(f"it names {module}.{name}, which a DCP metadata file never holds (refused "
                                   "unread: unpickling it could run code)")
        return super().find_class(module, name)


def load_metadata(data: bytes) -> Metadata:
    """The ``Metadata`` pickled in ``data``, through ``RestrictedUnpickler``.

    Raises:
        UnsafeCheckpoint: the pickle names a class outside ``ALLOWED``, or holds something other than Metadata.
    """
    metadata = RestrictedUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


def read_metadata(path: str, file: str = METADATA_FILE) -> Metadata:
    """The DCP metadata ``file`` of the checkpoint folder ``path``, read safely (``load_metadata``).

    Raises:
        UnsafeCheckpoint: as ``load_metadata``.
        OSError: the file cannot be read.
        Exception: a damaged pickle raises any of several errors (EOFError, UnpicklingError, ...).
    """
    with open(os.path.join(path, file), "rb") as f:
        return load_metadata(f.read())


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader with the metadata (also a rank's own, ``__<rank>.metadata``, DCP's fallback) read
    by ``read_metadata``: what ``dcp.load`` is given."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(str(self.path), METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

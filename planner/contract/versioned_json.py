"""Reading the project's versioned JSON documents (plans, profiles) through ``planner.contract.file_io``: every way a file
can be unusable is one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from planner.contract.file_io import read_json

Document = TypeVar("Document", bound=BaseModel)


def read_versioned(path: str | Path, *, kind: str, readable: tuple[int, ...], writer: str,
                   error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The JSON object in ``path`` whose ``schema_version`` is one of ``readable``; raise ``error`` with one line
    (naming the file as a ``kind``, and ``writer``, the command that writes one) when it cannot be read, is not
    JSON, has no whole-number version or one this tool does not read."""
    path = Path(path)
    data = read_json(path, kind=kind, error=error)
    versions = ", ".join(map(str, readable))
    if not isinstance(data, dict) or "schema_version" not in data:
        raise error(f"{path} is not a {kind}: it has no schema_version (write one with `{writer}`)")
    version = data["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise error(f"{kind} {path}: schema_version must be a whole number, got {version!r} "
                    f"({type(version).__name__}); this tool reads versions {versions}")
    if version not in readable:
        raise error(f"{kind} {path} has schema version {version}, this tool reads versions {versions}: "
                    f"re-run `{writer}` with this version to regenerate it")
    return data


def validated(model: type[Document], data: dict[str, Any], path: str | Path, *, kind: str,
              error: type[ValueError] = ValueError) -> Document:
    """``data`` as a ``model``; ``error`` with the first invalid field in one line if it is not one."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise error(f"{kind} {path} is invalid at {where}: {first['msg']}") from None


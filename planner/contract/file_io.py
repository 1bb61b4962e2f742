"""Reading and writing the project's files, torch-free (the planner and the runtime both use it).

Every file read goes through ``read_text`` / ``read_json``: only a regular file is opened (a named pipe never blocks
the reader, a folder or device is refused), its size is bounded, its JSON nesting too, and every error is one line
naming the file. Every file written goes through ``write_output``: a regular file (or a new one) is replaced
atomically, a character device (``/dev/null``, a terminal) is written into in place, a symlink is followed (the
link stays, its target is written), and anything else (a named pipe, a socket, a folder, a block device) is refused
in one line naming the flag and the path. ``refuse_shared_paths`` keeps an output from being an input or another
output.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any, Mapping

MAX_DOCUMENT_BYTES = 64 * 2**20
"""Largest plan, profile, cluster file, histogram, calibration table or checkpoint file read (64 MiB); the project
writes none above a few MiB."""
MAX_METRICS_BYTES = 2**32
"""Largest metrics file read (4 GiB: some million steps' JSON lines): the summary line is added to it, calibration
reads its step times."""
MAX_DEPTH = 100
"""Deepest nesting of lists and mappings a JSON or YAML document may have (the project's own nest under 10)."""
MIB = 2**20

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISCHR, "a character device"))


def _what(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((words for test, words in _KINDS if test(mode)), "a special file")


# ---- reading ---------------------------------------------------------------------------------------------------


def read_bytes(path: str | Path, *, kind: str, max_bytes: int = MAX_DOCUMENT_BYTES,
               error: type[ValueError] = ValueError) -> bytes:
    """The bytes of the regular file ``path`` (a ``kind``), at most ``max_bytes``; ``error`` in one line naming
    the file otherwise. Opened non-blocking, so that a named pipe put in its place never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise error(f"cannot read {kind} {path}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{kind} {path} is {_what(mode)}, not a regular file")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(max_bytes + 1)
        except OSError as e:
            raise error(f"cannot read {kind} {path}: {e.strerror}") from None
    if len(data) > max_bytes:
        raise error(f"{kind} {path} is larger than {max_bytes / MIB:g} MiB: not a {kind} this tool writes")
    return data


def read_text(path: str | Path, *, kind: str, max_bytes: int = MAX_DOCUMENT_BYTES,
              error: type[ValueError] = ValueError) -> str:
    """``read_bytes`` decoded as UTF-8; ``error`` naming the file and the byte when it is not UTF-8 text."""
    data = read_bytes(path, kind=kind, max_bytes=max_bytes, error=error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{kind} {path} is not UTF-8 text (byte {e.start}): not a {kind}") from None


def parse_json(text: str, *, where: str, error: type[ValueError] = ValueError) -> Any:
    """The JSON document ``text`` (``where`` names it in errors: "plan file p.json"), nested at most ``MAX_DEPTH``
    deep; ``error`` in one line when it is not JSON or nested deeper."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise error(f"{where} is nested deeper than {MAX_DEPTH} levels: not a file this tool writes") from None
    except json.JSONDecodeError as e:
        raise error(f"{where} is not JSON: {e.msg} at line {e.lineno}") from None
    check_depth(data, where=where, error=error)
    return data


def parse_yaml(text: str, *, where: str, error: type[ValueError] = ValueError) -> Any:
    """The YAML document ``text`` (``yaml.safe_load``: no tags that build objects), nested at most ``MAX_DEPTH``
    deep as ``parse_json``'s documents; ``error`` in one line when it is not YAML or nested deeper."""
    import yaml  # pyyaml; only YAML files need it

    try:
        data = yaml.safe_load(text)
    except RecursionError:  # deeper than the composer's recursion allows
        raise error(f"{where} is nested deeper than {MAX_DEPTH} levels: not a file this tool writes") from None
    except yaml.YAMLError as e:
        raise error(f"{where} is not YAML: {' '.join(str(e).split())}") from None
    check_depth(data, where=where, error=error)
    return data


def check_depth(data: Any, *, where: str, error: type[ValueError] = ValueError) -> None:
    """``error`` in one line when ``data`` nests lists and mappings deeper than ``MAX_DEPTH`` (checked without
    recursion, so any depth is measured; each container once per level, so YAML aliases that share one many times
    or hold themselves cost no more than the containers there are)."""
    level = [data] if isinstance(data, (list, dict)) else []
    for _ in range(MAX_DEPTH):
        children = (child for node in level for child in (node.values() if isinstance(node, dict) else node))
        level = list({id(child): child for child in children if isinstance(child, (list, dict))}.values())
    if level:
        raise error(f"{where} is nested deeper than {MAX_DEPTH} levels: not a file this tool writes")


def read_json(path: str | Path, *, kind: str, max_bytes: int = MAX_DOCUMENT_BYTES,
              error: type[ValueError] = ValueError) -> Any:
    """The JSON document in the regular file ``path`` (a ``kind``): ``read_text`` then ``parse_json``."""
    return parse_json(read_text(path, kind=kind, max_bytes=max_bytes, error=error), where=f"{kind} {path}",
                      error=error)


# ---- writing ---------------------------------------------------------------------------------------------------


def output_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot take an output file (its target, a symlink followed, is a folder, a named pipe, a
    socket or a block device), or None: a regular file, a character device or nothing yet."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:  # a symlink loop, a name too long
        return e.strerror
    if stat.S_ISREG(mode) or stat.S_ISCHR(mode):
        return None
    return f"it is {_what(mode)}, not a regular file: give a file path"


def check_output(path: str | Path, flag: str) -> None:
    """Raise a one-line ValueError naming ``flag`` and ``path`` unless ``path`` can take an output file."""
    problem = output_problem(path)
    if problem is not None:
        raise ValueError(f"cannot write {flag} {path}: {problem}")


def is_device(path: str | Path) -> bool:
    """Whether ``path`` (a symlink followed) is a character device, written in place (``/dev/null``)."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def write_output(path: str | Path, text: str, *, flag: str) -> None:
    """Write ``text`` as the output ``flag`` names: a character device in place; a regular file or a new one through
    a temporary file in its folder renamed over it (a full disk or an interrupted write never leaves a truncated file
    in place of a good one); a symlink's target, the link kept. Raises ValueError (one line) for any other target,
    OSError when the write fails."""
    check_output(path, flag)
    target = os.path.realpath(path)
    if is_device(target):
        fd = os.open(target, os.O_WRONLY)
        with os.fdopen(fd, "w", encoding="utf-8") as device:
            device.write(text)
        return
    _replace_atomically(target, text)


def _replace_atomically(target: str, text: str) -> None:
    """``text`` to a temporary file of a name of its own beside ``target`` (processes writing one target at once do
    not collide), renamed over it; the temporary is removed if anything fails."""
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


# ---- inputs and outputs that must differ -------------------------------------------------------------------------


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file: the same file when both exist (through symlinks and hard links), else the
    same path once symlinks and ``..`` are resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def refuse_shared_paths(inputs: Mapping[str, str | Path | None], outputs: Mapping[str, str | Path | None]) -> None:
    """Raise a one-line ValueError when an output (flag -> path; None: not given) is the same file as an existing
    input (one that is not a path, a catalog name, is passed over) or another output; a character device
    (``/dev/null``) may take several outputs."""
    written = [(flag, path) for flag, path in outputs.items() if path is not None and not is_device(path)]
    read = [(flag, path) for flag, path in inputs.items() if path is not None and os.path.exists(path)]
    for i, (flag, path) in enumerate(written):
        for other_flag, other in read + written[:i]:
            if same_file(path, other):
                raise ValueError(f"{flag} {path} is the same file as {other_flag} {other}: it would be overwritten; "
                                 f"give {flag} a path of its own")

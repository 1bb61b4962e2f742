"""Tiny video files for tests: an MPEG-4 clip written with PyAV and frame-list videos written with PIL, random pixels
fixed by a seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_mp4(path: Path, frames: int, fps: int, width: int, height: int, seed: int = 0, codec: str = "mpeg4") -> str:
    """An MP4 file of ``frames`` random frames at ``fps`` (MPEG-4 Part 2 unless ``codec`` says otherwise); returns its
    name (rows name files relative to the dataset file, in the same folder here)."""
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path.name


def write_frames(folder: Path, stem: str, sizes: list[tuple[int, int]], seed: int = 0) -> list[str]:
    """One PNG per (width, height) in ``sizes``, named ``{stem}{i}.png``; returns their names."""
    rng = np.random.default_rng(seed)
    names = []
    for i, (width, height) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / f"{stem}{i}.png")
        names.append(f"{stem}{i}.png")
    return names


def write_empty_video(path: Path) -> str:
    """A container with no video frame (PyAV writes its header only)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    return path.name


def write_mkv_claiming(path: Path, frames: int, fps: int, claimed_seconds: float) -> str:
    """A Matroska file of ``frames`` random 64 x 48 frames at ``fps`` whose header says it lasts ``claimed_seconds``
    (its Segment Duration, in the default millisecond timecode, rewritten in place); returns its name."""
    import struct

    import av

    rng = np.random.default_rng(0)
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data = bytearray(path.read_bytes())
    at = data.index(b"\x44\x89") + 2  # the Duration element's ID, then its size byte: 0x88 (double) or 0x84 (float)
    width, kind = (8, ">d") if data[at] == 0x88 else (4, ">f")
    data[at + 1:at + 1 + width] = struct.pack(kind, claimed_seconds * 1000)
    path.write_bytes(bytes(data))
    return path.name

"""Writing frames to an H.264 mp4 (test videos, the synth worlds, a clip sent to a model)."""
from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

import numpy as np


def write_video(path: str | Path | BinaryIO, frames: Iterable[np.ndarray], fps: int | Fraction, width: int,
                height: int, crf: int = 23, gop_seconds: float = 2.0,
                pts: Sequence[int] | None = None) -> str | Path | BinaryIO:
    """Encode RGB uint8 frames (H, W, 3) to an H.264 mp4 with PyAV. Deterministic for equal input.

    `path` may be a writable binary file object (an mp4 in memory, e.g. for a data URL). `pts`, one per frame in
    units of 1/fps and increasing, places frames on that grid with gaps where a clip skips time (a sampled clip
    keeps its timing); by default frame i is shown at i/fps.
    """
    import av

    if isinstance(path, (str, os.PathLike)):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        target, kwargs = str(path), {}
    else:
        target, kwargs = path, {"format": "mp4"}
    time_base = 1 / Fraction(fps)
    with av.open(target, "w", options={"fflags": "+bitexact"}, **kwargs) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": str(crf), "g": str(max(1, int(fps * gop_seconds))),
                          "threads": "1", "flags": "+bitexact"}
        for i, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            if pts is not None:
                picture.pts, picture.time_base = int(pts[i]), time_base
            for packet in stream.encode(picture):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path

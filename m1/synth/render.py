"""Draw an M1-Synth script to frames and encode them as an mp4.

Frames are flat colours with hard edges (no anti-aliasing): every object pixel is exactly its
palette colour before encoding, so colour detection after H.264 stays reliable.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np

from m1.synth.world import BACKGROUNDS, COLOURS, Script


@lru_cache(maxsize=64)
def shape_mask(shape: str, side: int) -> np.ndarray:
    """Boolean (side, side) mask of a shape filling its box; the box is tight on every shape."""
    yy, xx = np.mgrid[0:side, 0:side].astype(np.float64)
    c = (side - 1) / 2
    if shape == "square":
        m = np.ones((side, side), bool)
    elif shape == "circle":
        m = (xx - c) ** 2 + (yy - c) ** 2 <= (side / 2) ** 2
    elif shape == "triangle":  # apex up, base on the bottom row
        m = np.abs(xx - c) <= (yy + 1) * 0.5
    elif shape == "cross":  # plus sign with arms a third of the side thick
        m = (np.abs(xx - c) <= side / 6) | (np.abs(yy - c) <= side / 6)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    m.setflags(write=False)
    return m


def render_frame(script: Script, t: float) -> np.ndarray:
    """The (H, W, 3) uint8 RGB picture of the world at time t."""
    frame = np.empty((script.height, script.width, 3), np.uint8)
    frame[:] = BACKGROUNDS[script.background_at(t)]
    for v in script.visible_at(t):
        x0, y0, x1, y1 = v.box
        mask = shape_mask(v.event.obj.shape, x1 - x0)
        frame[y0:y1, x0:x1][mask] = COLOURS[v.event.obj.colour]
    return frame


def frames(script: Script) -> Iterator[np.ndarray]:
    for i in range(script.num_frames):
        yield render_frame(script, script.frame_time(i))


def render(script: Script, path: str | Path, crf: int = 23) -> Path:
    """Write the script's video to `path` (H.264 mp4). Same script -> same bytes."""
    from m1.video import write_video

    return write_video(path, frames(script), fps=script.fps, width=script.width, height=script.height,
                       crf=crf)

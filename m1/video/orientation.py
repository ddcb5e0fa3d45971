"""Orientation: a phone stores a portrait video as a landscape picture plus a display matrix (mp4 `tkhd`) that tells
a player to turn it. Frames come out as a player shows them: turned (and mirrored) by that matrix; a matrix that is
not a quarter turn is a VideoError that says so."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from m1.video.errors import VideoError

# A display matrix (9 int32, 16.16 fixed point; FFmpeg's layout [a b u; c d v; x y w]) maps a stored pixel at
# (column x, row y) to the shown (a*x + c*y, b*x + d*y). Players honour the eight quarter-turn/mirror matrices.
Orientation = tuple[bool, bool, bool]  # (transpose, flip rows, flip columns), applied in that order


def matrix_orientation(matrix: Sequence[int] | None, path: Path) -> Orientation:
    if matrix is None:
        return (False, False, False)
    units = [v / 65536 for v in (matrix[0], matrix[1], matrix[3], matrix[4])]
    a, b, c, d = (round(u) if abs(u - round(u)) < 0.01 else None for u in units)  # exactly -1, 0 or 1, or not
    if b == 0 and c == 0 and abs(a) == 1 and abs(d) == 1:
        return (False, d < 0, a < 0)
    if a == 0 and d == 0 and abs(b) == 1 and abs(c) == 1:
        return (True, b < 0, c < 0)
    angle = -math.degrees(math.atan2(matrix[1], matrix[0]))  # counter-clockwise, as FFmpeg reports it
    raise VideoError(path, f"its display matrix turns the picture by {angle:.0f} degrees, not a quarter turn; "
                           "M1 cannot show it as a player does (re-encode it upright, e.g. ffmpeg -i IN OUT)")


def turn(orientation: Orientation) -> tuple[int, bool]:
    """(degrees clockwise, mirrored) of an orientation, as docs and errors name it."""
    transpose, rows, cols = orientation
    table = {(False, False, False): (0, False), (True, False, True): (90, False), (False, True, True): (180, False),
             (True, True, False): (270, False), (False, False, True): (0, True), (True, False, False): (90, True),
             (False, True, False): (180, True), (True, True, True): (270, True)}
    return table[(transpose, rows, cols)]


def orient(frame: np.ndarray, orientation: Orientation) -> np.ndarray:
    """A stored (H, W, 3) picture as a player shows it."""
    transpose, rows, cols = orientation
    if transpose:
        frame = frame.transpose(1, 0, 2)
    if rows:
        frame = frame[::-1]
    if cols:
        frame = frame[:, ::-1]
    return np.ascontiguousarray(frame) if orientation != (False, False, False) else frame


def display_matrix(path: Path, stream_index: int) -> list[int] | None:
    """The display matrix FFmpeg attaches to the first decoded frame (from mp4 `tkhd`, mkv projection, ...)."""
    import av

    with av.open(str(path), metadata_errors="ignore") as container:
        stream = container.streams[stream_index]
        for frame in container.decode(stream):
            for side in frame.side_data:
                if side.type.name == "DISPLAYMATRIX":
                    raw = bytes(side)
                    return list(np.frombuffer(raw[:36], dtype="<i4")) if len(raw) >= 36 else None
            return None
    return None

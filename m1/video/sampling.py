"""Sampling by time (pure): which frames to read for a span, a rate or a list of times.

Time convention: frame i is on screen from its start time until the next frame's, on the clock a player shows
(0 at the start of the file). For a constant-rate stream that starts at 0 the start of frame i is i/fps; a stream
whose frames are not on that grid (variable frame rate, screen recordings, gaps, video that starts after the audio,
a header whose rate contradicts its packets) keeps each frame's own start (`VideoInfo.times`), read from the
packets' timestamps, never from the header. `index_to_time(i)` is the start of frame i and `time_to_index(t)` the
frame on screen at t, so sampling by time never depends on the decoding backend.
"""
from __future__ import annotations

import bisect
import math

from m1.video.probing import VideoInfo

_EPS = 1e-6


def index_to_time(info: VideoInfo, i: int) -> float:
    """Start time in seconds of frame i."""
    if not 0 <= i < info.num_frames:
        raise IndexError(f"frame {i} out of range [0, {info.num_frames}) for {info.path}")
    return info.times[i] if info.times is not None else i / info.fps


def time_to_index(info: VideoInfo, t: float) -> int:
    """The frame on screen at time t, clipped to the video."""
    if not math.isfinite(t):
        raise ValueError(f"time must be finite, got {t!r}")
    if info.times is not None:  # the last frame that started by t (the first before the video's first frame)
        return min(max(bisect.bisect_right(info.times, t + _EPS) - 1, 0), info.num_frames - 1)
    return min(max(int(math.floor(t * info.fps + _EPS)), 0), info.num_frames - 1)


def _span(info: VideoInfo, start: float, end: float | None) -> tuple[float, float]:
    end = info.duration if end is None else end
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"span must be finite, got start={start!r} end={end!r}")
    if end < start:
        raise ValueError(f"end {end} is before start {start}")
    return min(max(start, 0.0), info.duration), min(max(end, 0.0), info.duration)


def uniform_indices(info: VideoInfo, n: int, start: float = 0.0, end: float | None = None) -> list[int]:
    """n frames at the centres of n equal segments of [start, end), clipped and deduplicated."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    s, e = _span(info, start, end)
    if e <= s:
        return [time_to_index(info, s)]
    seg = (e - s) / n
    return sorted({time_to_index(info, s + (k + 0.5) * seg) for k in range(n)})


def fps_indices(info: VideoInfo, fps: float, start: float = 0.0, end: float | None = None,
                max_frames: int | None = None) -> list[int]:
    """Frames at `fps` per second from start; uniform max_frames over the span if that is fewer."""
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if max_frames is not None and max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    s, e = _span(info, start, end)
    count = max(1, math.ceil((e - s) * fps - _EPS))
    out = sorted({time_to_index(info, s + k / fps) for k in range(count)})
    if max_frames is not None and len(out) > max_frames:
        return uniform_indices(info, max_frames, s, e)
    return out

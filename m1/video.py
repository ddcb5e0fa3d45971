"""Video I/O: probing, sampling by time, a bounded shared frame cache, and writing mp4s.

Every agent, tool and episode asks for frames of the same few videos, so decoding goes through a
shared `FrameCache` and one `VideoReader` per file (`VideoPool`): a frame is decoded once. A reader and its frames
stand for the content they were read from (its signature, m1/signature.py), never for a name, and a pool holds a
bounded number of files open. Backend failures of every kind surface as `VideoError`, which names the file and the
cause; running out of file handles is the OSError it is (`out_of_handles`), since no video is at fault.

Time convention: frame i is on screen from its start time until the next frame's, on the clock a player shows
(0 at the start of the file). For a constant-rate stream that starts at 0 the start of frame i is i/fps; a stream
whose frames are not on that grid (variable frame rate, screen recordings, gaps, video that starts after the audio,
a header whose rate contradicts its packets) keeps each frame's own start (`VideoInfo.times`), read from the
packets' timestamps, never from the header. `index_to_time(i)` is the start of frame i and `time_to_index(t)` the
frame on screen at t, so sampling by time never depends on the decoding backend.

Orientation: a phone stores a portrait video as a landscape picture plus a display matrix (mp4 `tkhd`) that tells a
player to turn it. Frames come out as a player shows them: turned (and mirrored) by that matrix, with
`VideoInfo.width`/`height` the shown size; a matrix that is not a quarter turn is a VideoError that says so.
"""
from __future__ import annotations

import bisect
import errno
import itertools
import math
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

import numpy as np

from m1.signature import Signature, signature

VIDEO_EXTENSIONS = (".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v")
BACKENDS = ("auto", "decord", "pyav")

# FFmpeg demuxers that turn non-video files into "frames": text renderers and single images.
_TEXT_DEMUXERS = {"tty", "bin", "xbin", "adf", "idf"}
_TEXT_CODECS = {"ansi", "bintext", "xbin", "idf"}
_IMAGE_DEMUXERS = {"image2"}
_EPS = 1e-6


class VideoError(Exception):
    """A video could not be opened or decoded; `.path` is the file, `.reason` the cause."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read video {self.path}: {reason}")

    def __reduce__(self):  # keep pickling (worker processes) working with the two-arg init
        return (type(self), (self.path, self.reason))


class VideoChanged(VideoError):
    """The file changed on disk after M1 began reading it: frames of two files must never be mixed in one answer, so
    the question is an error row that a rerun answers from the new file."""

    @classmethod
    def of(cls, path: str | os.PathLike, was: Signature, now: Signature | None) -> VideoChanged:
        now_text = f"now {now}" if now is not None else "now unreadable"
        return cls(path, f"the file changed on disk while it was being read (was {was}; {now_text}); "
                         "rerun to answer from the new file")


def out_of_handles(exc: BaseException) -> OSError | None:
    """The OSError to raise when `exc` says the process or system ran out of file handles (EMFILE/ENFILE, as an
    OSError or in FFmpeg's and decord's words), else None. That is no fault of the video, so it must not become a
    VideoError (an error row, a 400 that blames the file): the caller stops, or `m1 serve` answers 503."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return exc
    text = str(exc)
    if "Too many open files" in text:
        code = errno.ENFILE if "in system" in text else errno.EMFILE
        return OSError(code, os.strerror(code))
    return None


def _cause(exc: BaseException) -> str:
    """One readable line from a backend exception (decord appends long C++ stack traces)."""
    text = str(exc).split("Stack trace", 1)[0].strip().replace("\n", " ")
    text = re.sub(r"^\[\d\d:\d\d:\d\d\] ", "", text)  # decord's log-time prefix
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _decord_errors() -> tuple[type[BaseException], ...]:
    try:
        from decord import DECORDError
    except ImportError:
        return (RuntimeError,)
    return (RuntimeError, DECORDError)


def _av_errors() -> tuple[type[BaseException], ...]:
    import av

    return (av.FFmpegError, OSError, RuntimeError, ValueError, EOFError)


# --------------------------------------------------------------------------------------------
# probing


@dataclass(frozen=True)
class VideoInfo:
    """What sampling needs to know about a video, as a player shows it. duration = num_frames / fps for a
    constant-rate stream (`times` None); otherwise `times` holds each frame's start in seconds, duration is the end
    of the last frame and fps the average rate. width x height is the shown size (after `rotation`)."""

    path: str
    duration: float
    fps: float
    num_frames: int
    width: int
    height: int
    times: tuple[float, ...] | None = None
    rotation: int = 0  # degrees clockwise a player turns the stored picture (0, 90, 180, 270)
    mirrored: bool = False  # the display matrix also mirrors the picture


def _check_file(path: Path) -> None:
    if not path.exists():
        raise VideoError(path, "no such file")
    if not path.is_file():
        raise VideoError(path, "not a regular file")
    if path.stat().st_size == 0:
        raise VideoError(path, "file is empty")


def _video_stream(container, path: Path):
    """The first real video stream, rejecting text/image demuxers and cover art."""
    import av.stream

    fmt = container.format.name or ""
    if set(fmt.split(",")) & _TEXT_DEMUXERS:
        raise VideoError(path, f"not a video: FFmpeg read it as text (demuxer {fmt!r})")
    if fmt in _IMAGE_DEMUXERS or fmt.endswith("_pipe"):
        raise VideoError(path, f"not a video: FFmpeg read it as a still image (demuxer {fmt!r})")
    for stream in container.streams.video:
        if stream.disposition & av.stream.Disposition.attached_pic:
            continue
        codec = stream.codec_context.name if stream.codec_context is not None else None
        if not codec:
            continue
        if codec in _TEXT_CODECS:
            raise VideoError(path, f"not a video: stream codec {codec!r} renders text")
        return stream
    raise VideoError(path, f"no video stream (container format {fmt!r})")


def _stream_fps(stream, container, num_frames: int, path: Path) -> float:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate is not None and float(rate) > 0 and math.isfinite(float(rate)):
            return float(rate)
    if container.duration and num_frames:
        return num_frames / (container.duration / 1_000_000)
    raise VideoError(path, "the video stream has no frame rate")


def _packet_table(container, stream, to_eof: bool = False) -> tuple[list[int], list[int]]:
    """Presentation timestamps of all video packets (sorted) and the positions of keyframes. With `to_eof` (a file
    known to be cut), the packets up to where the file ends."""
    entries: list[tuple[int, bool]] = []
    packets = container.demux(stream)
    while True:
        try:
            packet = next(packets)
        except StopIteration:
            break
        except EOFError:
            if not to_eof:
                raise
            break
        if packet.size == 0:
            continue
        ts = packet.pts if packet.pts is not None else packet.dts
        if ts is None:
            continue
        entries.append((ts, bool(packet.is_keyframe)))
    entries.sort(key=lambda e: e[0])
    pts = [ts for ts, _ in entries]
    keys = [i for i, (_, key) in enumerate(entries) if key]
    return pts, keys


# A file still being written, or cut short, must not pass for a shorter video: FFmpeg reads what is
# there and reports that as the whole video. For ISO BMFF (mp4/mov) two things show it:
#  - the file ends inside a top-level box (a `moof`/`mdat` whose size runs past the end of the file): a recorder
#    that is still writing, or a copy cut in half, almost always stops mid-box; a finished file never does;
#  - a fragmented MP4 that declares its total length (`mehd` in `moov/mvex`, written by MP4Box, GStreamer and
#    recorders that rewrite the header when they finish) holds less than that: compared with the packets present.
# What cannot be told: a fragmented MP4 that declares no total length (FFmpeg's `empty_moov` writes no `mehd` and
# an `mvhd` of 0 s) cut exactly at a fragment boundary is a valid shorter file; nothing in it says more was meant.
# A non-fragmented mp4 describes every sample in its `moov`, so a cut one shows a torn `mdat` (or FFmpeg finds no
# `moov` at all). Other containers (mkv/webm/avi) are not compared: FFmpeg may estimate their duration from the
# bitrate, which PyAV does not tell apart from a declared one, so a comparison would flag good files.
_BMFF_FIRST = {b"ftyp", b"styp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"uuid", b"sidx", b"junk"}
_LENGTH_TOLERANCE = 0.02  # what a file holds may fall short of its declared length by 2% (or 1 s, or two frames)


@dataclass(frozen=True)
class _BmffLayout:
    fragmented: bool  # a `moof` or `moov/mvex` is present
    declared: float | None  # total seconds from `mehd` (fragmented files only); None when not declared
    torn: tuple[str, int, int] | None  # (box type, its declared size, bytes present) when the file ends inside it


def _boxes(data: bytes, start: int, end: int) -> Iterable[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of the boxes in data[start:end]; stops at the first malformed one."""
    pos = start
    while pos + 8 <= end:
        size, kind, header = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8], 8
        if size == 1 and pos + 16 <= end:
            size, header = int.from_bytes(data[pos + 8:pos + 16], "big"), 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            return
        yield kind, pos + header, pos + size
        pos += size


def _declared_from_moov(moov: bytes) -> float | None:
    """The total length a fragmented movie declares: `mehd` fragment_duration over the `mvhd` timescale."""
    timescale, total = 0, None
    for kind, a, b in _boxes(moov, 0, len(moov)):
        if kind == b"mvhd" and b - a >= 24:
            timescale = int.from_bytes(moov[a + 20:a + 24] if moov[a] == 1 else moov[a + 12:a + 16], "big")
        elif kind == b"mvex":
            for sub, c, d in _boxes(moov, a, b):
                if sub == b"mehd" and d - c >= 8:
                    wide = moov[c] == 1 and d - c >= 12
                    value = int.from_bytes(moov[c + 4:c + 12] if wide else moov[c + 4:c + 8], "big")
                    if 0 < value < (1 << (64 if wide else 32)) - 1:  # all ones means "unknown"
                        total = value
    return total / timescale if total and timescale > 0 else None


def _bmff_layout(path: Path) -> _BmffLayout | None:
    """The top-level boxes of an ISO BMFF file, walked by their headers (only `moov` is read); None when the file
    does not start like one."""
    size = path.stat().st_size
    declared, fragmented, pos = None, False, 0
    with open(path, "rb") as f:
        while pos + 8 <= size:
            f.seek(pos)
            head = f.read(16)
            box, kind, header = int.from_bytes(head[:4], "big"), head[4:8], 8
            if not (kind.isascii() and kind.decode("latin-1").isprintable()):
                if pos == 0:
                    return None
                break  # trailing bytes that are not a box (padding): not a sign of a cut
            if pos == 0 and kind not in _BMFF_FIRST:
                return None
            if box == 1:
                if len(head) < 16:
                    return _BmffLayout(fragmented, None, (kind.decode("latin-1"), 16, len(head)))
                box, header = int.from_bytes(head[8:16], "big"), 16
            elif box == 0:  # "extends to the end of the file"
                box = size - pos
            if box < header:
                if pos == 0:
                    return None
                break
            if pos + box > size:
                return _BmffLayout(fragmented, declared if fragmented else None,
                                   (kind.decode("latin-1"), box, size - pos))
            if kind == b"moof":
                fragmented = True
            elif kind == b"moov" and box <= 64 << 20:
                f.seek(pos + header)
                moov = f.read(box - header)
                fragmented = fragmented or any(k == b"mvex" for k, _, _ in _boxes(moov, 0, len(moov)))
                declared = _declared_from_moov(moov)
            pos += box
    return _BmffLayout(fragmented, declared if fragmented else None, None)


def _count_problem(declared: int, held: int, seconds: float) -> str:
    """Why a file whose header counts more frames than its packets hold is refused: it is cut short, or the header
    is wrong; either way its length is not known (a header field never sets it, docs/video_input.md)."""
    return (f"the header lists {declared} frames but the file holds {held} ({seconds:.1f} s): cut short, or a "
            "header that contradicts its packets; if it plays whole, re-mux it (ffmpeg -i IN -c copy OUT)")


def _held_seconds(info: VideoInfo, stream, pts: list[int] | None) -> float:
    """How long the packets present last: their timestamp span plus one average frame (not the header's frame rate,
    which FFmpeg may derive from the declared length), else frames / fps."""
    if pts and len(pts) > 1 and stream.time_base:
        return float((pts[-1] - pts[0]) * stream.time_base) * len(pts) / (len(pts) - 1)
    return info.duration


def _check_complete(path: Path, info: VideoInfo, layout: _BmffLayout, held: float) -> None:
    """A VideoError for an mp4/mov that is cut short or still being written (see the notes above)."""
    said = f"the header says {layout.declared:.1f} s, " if layout.declared else ""
    if layout.torn is not None:
        kind, size, present = layout.torn
        # a non-fragmented moov lists every sample, present or not: what is held is not known from the packets
        held_text = f"the file holds {held:.1f} s and ends" if layout.fragmented else \
            f"the header says {info.duration:.1f} s, but the file ends"
        raise VideoError(path, f"incomplete or still being written: {said}{held_text} inside its {kind!r} box "
                               f"({present} of {size} bytes present)")
    if layout.declared and held < layout.declared - max(1.0, 2 / info.fps, _LENGTH_TOLERANCE * layout.declared):
        raise VideoError(path, f"incomplete or still being written: {said}the file holds {held:.1f} s")



# A display matrix (9 int32, 16.16 fixed point; FFmpeg's layout [a b u; c d v; x y w]) maps a stored pixel at
# (column x, row y) to the shown (a*x + c*y, b*x + d*y). Players honour the eight quarter-turn/mirror matrices.
_Orientation = tuple[bool, bool, bool]  # (transpose, flip rows, flip columns), applied in that order


def _orientation(matrix: Sequence[int] | None, path: Path) -> _Orientation:
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


def _turn(orientation: _Orientation) -> tuple[int, bool]:
    """(degrees clockwise, mirrored) of an orientation, as docs and errors name it."""
    transpose, rows, cols = orientation
    table = {(False, False, False): (0, False), (True, False, True): (90, False), (False, True, True): (180, False),
             (True, True, False): (270, False), (False, False, True): (0, True), (True, False, False): (90, True),
             (False, True, False): (180, True), (True, True, True): (270, True)}
    return table[(transpose, rows, cols)]


def _orientation_of(info: VideoInfo) -> _Orientation:
    return next(o for o in itertools.product((False, True), repeat=3) if _turn(o) == (info.rotation, info.mirrored))


def orient(frame: np.ndarray, orientation: _Orientation) -> np.ndarray:
    """A stored (H, W, 3) picture as a player shows it."""
    transpose, rows, cols = orientation
    if transpose:
        frame = frame.transpose(1, 0, 2)
    if rows:
        frame = frame[::-1]
    if cols:
        frame = frame[:, ::-1]
    return np.ascontiguousarray(frame) if orientation != (False, False, False) else frame


def _display_matrix(path: Path, stream_index: int) -> list[int] | None:
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


def _frame_times(container, stream, pts: list[int], fps: float) -> tuple[float, ...] | None:
    """Each frame's start on the player's clock (0 = the file's start), or None when the frames sit on the
    i/fps grid (a quarter frame of slack: container timescales round)."""
    if not pts or not stream.time_base:
        return None
    tb = float(stream.time_base)
    zero = container.start_time / 1_000_000 if container.start_time is not None else pts[0] * tb
    times = tuple(max(0.0, p * tb - zero) for p in pts)
    if all(abs(t - i / fps) <= 0.25 / fps for i, t in enumerate(times)):
        return None
    return times


def _with_times(info: VideoInfo, times: tuple[float, ...] | None) -> VideoInfo:
    if times is None:
        return info
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    last = gaps[len(gaps) // 2] if gaps else 1 / info.fps  # the last frame lasts a typical frame
    duration = times[-1] + last
    return replace(info, times=times, duration=duration, fps=info.num_frames / duration)


def _make_info(path: Path, stream, container, num_frames: int) -> VideoInfo:
    if num_frames <= 0:
        raise VideoError(path, "the video stream has no frames")
    width, height = stream.codec_context.width, stream.codec_context.height
    if not width or not height:
        raise VideoError(path, f"the video stream has no frame size ({width}x{height})")
    fps = _stream_fps(stream, container, num_frames, path)
    return VideoInfo(str(path), num_frames / fps, fps, int(num_frames), int(width), int(height))


def _oriented(info: VideoInfo, orientation: _Orientation) -> VideoInfo:
    degrees, mirrored = _turn(orientation)
    if orientation[0]:
        info = replace(info, width=info.height, height=info.width)
    return replace(info, rotation=degrees, mirrored=mirrored)


def probe(path: str | os.PathLike) -> VideoInfo:
    """Read a video as a player would show it (PyAV): the packets' timestamps (demuxed, not decoded) and the first
    frame's display matrix. Full verification happens when a VideoReader opens it."""
    import av

    path = Path(path).resolve()
    _check_file(path)
    try:
        with av.open(str(path), metadata_errors="ignore") as container:
            stream = _video_stream(container, path)
            # mp4, mov, m4v, 3gp (FFmpeg's "mov" demuxer): ISO BMFF boxes, checked for a cut below
            layout = _bmff_layout(path) if "mov" in (container.format.name or "").split(",") else None
            # the packets' timestamps (demux only, no decoding): the time axis, read from the stream, not the header
            pts = _packet_table(container, stream, to_eof=layout is not None and layout.torn is not None)[0]
            # the length is what the packets hold, never a header's count (an AVI's strh length, a moov that counts
            # only the samples before the first fragment); packets without any timestamp leave it to the header
            declared = stream.frames
            info = _make_info(path, stream, container, len(pts) if pts else declared)
            if layout is not None:  # a plain mp4's moov lists every sample: its count is what the header says
                said = info if layout.fragmented or not declared else _make_info(path, stream, container, declared)
                _check_complete(path, said, layout, _held_seconds(said, stream, pts))
            if pts and declared > len(pts) and not (layout is not None and layout.fragmented):
                raise VideoError(path, _count_problem(declared, len(pts), _held_seconds(info, stream, pts)))
            if len(pts) == info.num_frames:
                info = _with_times(info, _frame_times(container, stream, pts, info.fps))
            index = stream.index
        return _oriented(info, _orientation(_display_matrix(path, index), path))
    except _av_errors() as exc:
        if out_of_handles(exc) is not None:
            raise out_of_handles(exc) from exc
        try:  # FFmpeg gives up on a file cut inside a `moof` (EOF): say that it is cut when the boxes show it
            layout = _bmff_layout(path)
        except OSError:
            layout = None
        if layout is not None and layout.torn is not None:
            kind, size, present = layout.torn
            said = f"the header says {layout.declared:.1f} s, " if layout.declared else ""
            raise VideoError(path, f"incomplete or still being written: {said}the file ends inside its {kind!r} box "
                                   f"({present} of {size} bytes present); FFmpeg: {_cause(exc)}") from exc
        raise VideoError(path, _cause(exc)) from exc


# --------------------------------------------------------------------------------------------
# sampling by time (pure)


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


# --------------------------------------------------------------------------------------------
# cache


class FrameCache:
    """Thread-safe LRU of decoded RGB frames keyed by (path, frame index), bounded in bytes. A frame may carry a tag
    (a reader passes its file's content signature): a lookup with another tag misses and drops the stale frame, so a
    file replaced under its name never serves the old file's frames."""

    def __init__(self, max_bytes: int = 1 << 30):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._nbytes = 0
        self._items: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._tags: dict[tuple[str, int], object] = {}
        self._lock = threading.Lock()

    def get(self, path: str, index: int, tag: object = None) -> np.ndarray | None:
        """The cached frame (read-only) stored with `tag`, or None; counts a hit or a miss."""
        key = (str(path), int(index))
        with self._lock:
            frame = self._items.get(key)
            if frame is not None and self._tags.get(key) != tag:  # another content under this name
                self._nbytes -= self._items.pop(key).nbytes
                self._tags.pop(key, None)
                frame = None
            if frame is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return frame

    def put(self, path: str, index: int, frame: np.ndarray, tag: object = None) -> None:
        """Store a frame, evicting least recently used ones; frames larger than the bound are not kept."""
        key = (str(path), int(index))
        frame = np.ascontiguousarray(frame)
        frame.setflags(write=False)  # shared by every caller: nobody may mutate it
        with self._lock:
            old = self._items.pop(key, None)
            self._tags.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes
            if frame.nbytes > self.max_bytes:
                return
            self._items[key] = frame
            if tag is not None:
                self._tags[key] = tag
            self._nbytes += frame.nbytes
            while self._nbytes > self.max_bytes:
                gone, dropped = self._items.popitem(last=False)
                self._tags.pop(gone, None)
                self._nbytes -= dropped.nbytes
                self.evictions += 1

    def __contains__(self, key: tuple[str, int]) -> bool:
        with self._lock:
            return (str(key[0]), int(key[1])) in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def drop(self, path: str) -> None:
        """Remove every frame of one video."""
        with self._lock:
            for key in [k for k in self._items if k[0] == str(path)]:
                self._nbytes -= self._items.pop(key).nbytes
                self._tags.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._tags.clear()
            self._nbytes = 0


# --------------------------------------------------------------------------------------------
# backends


class _DecordBackend:
    name = "decord"

    def __init__(self, path: Path, header: VideoInfo, threads: int):
        import decord

        self.path = path
        try:
            self._vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=threads)
            num_frames = len(self._vr)
            fps = float(self._vr.get_avg_fps()) or header.fps
        except _decord_errors() as exc:
            if out_of_handles(exc) is not None:
                raise out_of_handles(exc) from exc
            raise VideoError(path, f"decord could not open it: {_cause(exc)}") from exc
        if num_frames <= 0:
            raise VideoError(path, "the video stream has no frames")
        if header.mirrored:  # decord turns a picture by the matrix's angle but never mirrors it
            raise VideoError(path, "decord cannot show a mirrored display matrix")
        if num_frames != header.num_frames:  # decord may count from a header field; the packets decide
            raise VideoError(path, f"decord sees {num_frames} frames, the packets {header.num_frames}")
        if header.times is not None:  # frames off the i/fps grid: the packets' own times
            self.info = header
        else:
            self.info = replace(header, num_frames=num_frames, fps=fps, duration=num_frames / fps)

    def read(self, indices: list[int]) -> dict[int, np.ndarray]:
        try:
            batch = self._vr.get_batch(indices).asnumpy()
        except _decord_errors() as exc:
            raise VideoError(self.path, f"decord failed to decode frames: {_cause(exc)}") from exc
        if batch.shape[1:] != (self.info.height, self.info.width, 3):  # decord did not turn it as a player does
            raise VideoError(self.path, f"decord decoded frames of {batch.shape[2]}x{batch.shape[1]}, the video "
                                        f"shows {self.info.width}x{self.info.height}")
        return {i: batch[k] for k, i in enumerate(indices)}

    def close(self) -> None:
        self._vr = None


class _PyAVBackend:
    """Seek to the keyframe before a target, decode forward; keep going forward when cheaper."""

    name = "pyav"

    def __init__(self, path: Path, header: VideoInfo, threads: int):
        import av

        self.path = path
        try:
            self._container = av.open(str(path), metadata_errors="ignore")
        except _av_errors() as exc:
            if out_of_handles(exc) is not None:
                raise out_of_handles(exc) from exc
            raise VideoError(path, _cause(exc)) from exc
        try:
            self._stream = _video_stream(self._container, path)
            self._stream.codec_context.thread_count = threads
            declared = self._stream.frames
            self._pts, self._keys = _packet_table(self._container, self._stream)
            if declared and len(self._pts) < declared:
                raise VideoError(path, _count_problem(declared, len(self._pts), header.duration))
            info = _make_info(path, self._stream, self._container, len(self._pts))
            info = _with_times(info, _frame_times(self._container, self._stream, self._pts, info.fps))
            self._orientation = _orientation_of(header)
            self.info = _oriented(info, self._orientation)
        except BaseException as exc:
            self._container.close()
            if isinstance(exc, _av_errors()):
                raise VideoError(path, _cause(exc)) from exc
            raise
        self._pts_index = {p: i for i, p in enumerate(self._pts)}
        self._gen = None  # decode generator positioned after frame self._pos
        self._pos = -1

    def _index_of(self, frame) -> int:
        ts = frame.pts if frame.pts is not None else frame.dts
        if ts is None:
            return self._pos + 1
        i = self._pts_index.get(ts)
        if i is None:  # timestamp not in the packet table: take the nearest entry
            i = min(max(bisect.bisect_left(self._pts, ts), 0), len(self._pts) - 1)
        return i

    def _seek(self, key_index: int) -> None:
        self._container.seek(self._pts[key_index], stream=self._stream, backward=True)
        self._gen = self._container.decode(self._stream)
        self._pos = key_index - 1

    def _decode_to(self, target: int, wanted: set[int], out: dict[int, np.ndarray]) -> None:
        """Decode forward until `target`, keeping wanted frames passed on the way."""
        for frame in self._gen:
            i = self._index_of(frame)
            self._pos = i
            if i in wanted and i not in out:
                out[i] = orient(np.ascontiguousarray(frame.to_ndarray(format="rgb24")), self._orientation)
            if i >= target:
                return
        self._gen = None  # end of stream

    def read(self, indices: list[int]) -> dict[int, np.ndarray]:
        wanted = set(indices)
        out: dict[int, np.ndarray] = {}
        try:
            for target in sorted(wanted):
                if target in out:
                    continue
                k = bisect.bisect_right(self._keys, target) - 1
                key_index = self._keys[k] if k >= 0 else 0
                if self._gen is not None and key_index - 1 <= self._pos < target:
                    self._decode_to(target, wanted, out)  # cheaper than seeking
                # seek to the keyframe before target; if the demuxer lands too late, to earlier ones
                earlier = self._keys[max(k - 2, 0): max(k, 0)][::-1]
                for start in dict.fromkeys([key_index, *earlier, 0]):
                    if target in out:
                        break
                    self._seek(start)
                    self._decode_to(target, wanted, out)
                if target not in out:
                    self._gen = None
                    raise VideoError(self.path, f"frame {target} could not be decoded "
                                                f"(decoder stopped at frame {self._pos})")
        except _av_errors() as exc:
            self._gen = None
            raise VideoError(self.path, f"PyAV failed to decode frames: {_cause(exc)}") from exc
        return out

    def close(self) -> None:
        self._gen = None
        self._container.close()


def _open_backend(name: str, path: Path, header: VideoInfo, threads: int):
    if name == "decord":
        try:
            import decord  # noqa: F401
        except (ImportError, OSError) as exc:  # OSError: its shared library failed to load
            raise VideoError(path, f"backend 'decord' is not available ({_cause(exc)}); "
                                   "decord is not installed or cannot load") from exc
        return _DecordBackend(path, header, threads)
    return _PyAVBackend(path, header, threads)


# --------------------------------------------------------------------------------------------
# reader and pool


class VideoReader:
    """Frames of one video by index, through an optional shared FrameCache.

    `decoded` counts frames this reader fetched from the file (cache misses), so callers can
    check that every frame is decoded once. Safe to share between threads (one decode at a time).

    A reader belongs to the content it was opened on (`signature`, m1/signature.py): its frames are cached under it,
    and every decode checks that the file still holds it. A file changed after opening makes the reader a
    VideoChanged from then on (`changed`), so no answer mixes frames of two files. `release()` closes the file and
    keeps what was learnt about it; the next decode opens it again (the same content only). `on_use(reader)` is
    called at each decode, while the file is open: a VideoPool bounds its open files with it.
    """

    def __init__(self, path: str | os.PathLike, cache: FrameCache | None = None,
                 backend: str = "auto", threads: int = 1, on_use=None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.path = Path(path).resolve()
        self.cache = cache
        self.decoded = 0
        self.decode_seconds = 0.0  # wall time spent decoding (cache misses only)
        self.requested_backend = backend
        self.changed: str | None = None  # why the file is no longer the one opened (sticky)
        self._threads = threads
        self._on_use = on_use
        self._lock = threading.Lock()
        _check_file(self.path)  # missing, empty, not a file: named before anything is read
        signed = _signature_of(self.path)
        if signed is None:
            raise VideoError(self.path, "cannot be read (permission denied, or it went away)")
        self.signature: Signature = signed
        header = probe(self.path)  # rejects non-video files before any backend
        self._header = header
        if backend == "auto":
            try:
                self._backend = _open_backend("decord", self.path, header, threads)
            except VideoError as decord_error:
                try:
                    self._backend = _open_backend("pyav", self.path, header, threads)
                except VideoError as pyav_error:
                    raise VideoError(self.path, f"{pyav_error.reason}; decord: {decord_error.reason}") \
                        from pyav_error
        else:
            self._backend = _open_backend(backend, self.path, header, threads)
        self.info: VideoInfo = self._backend.info
        self._kind = self._backend.name
        try:
            self._verify()  # what was probed and opened is the content signed above
        except VideoError:
            self._backend.close()
            raise

    @property
    def backend(self) -> str:
        """The backend actually in use ('decord' or 'pyav')."""
        return self._kind

    @property
    def is_open(self) -> bool:
        """Whether the reader holds its file open now (a released one opens it again on its next decode)."""
        return self._backend is not None

    def __len__(self) -> int:
        return self.info.num_frames

    def _check(self, indices: Sequence[int]) -> list[int]:
        out = []
        for i in indices:
            if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
                raise TypeError(f"frame indices must be integers, got {i!r} for {self.path}")
            if not 0 <= i < self.info.num_frames:
                raise IndexError(f"frame {i} out of range [0, {self.info.num_frames}) for {self.path}")
            out.append(int(i))
        return out

    def _verify(self) -> None:
        """Raise VideoChanged (and remember it) when the file no longer holds the signed content. A file that is
        gone while this reader holds it open is still the content it reads."""
        now = _signature_of(self.path)
        if now is None and self._backend is not None:
            return
        if now != self.signature:
            error = VideoChanged.of(self.path, self.signature, now)
            self.changed = error.reason
            raise error

    def _ensure_open(self) -> None:
        if self._backend is not None:
            return
        self._verify()
        backend = _open_backend(self._kind, self.path, self._header, self._threads)
        if backend.info.num_frames != self.info.num_frames:
            backend.close()
            raise VideoError(self.path, f"opened again, it holds {backend.info.num_frames} frames, not "
                                        f"{self.info.num_frames}")
        self._backend = backend

    def _decode(self, missing: list[int]) -> dict[int, np.ndarray]:
        try:
            return self._backend.read(missing)
        except VideoError:
            self._verify()  # a file that changed mid-decode is said to have changed, not to be broken
            if self.requested_backend != "auto" or self._backend.name != "decord":
                raise
        # auto: decord opened the file but cannot decode it; PyAV gets one chance
        self._backend.close()
        self._backend = _open_backend("pyav", self.path, self._header, self._threads)
        self._kind = "pyav"
        if self._backend.info.num_frames != self.info.num_frames:
            raise VideoError(self.path, f"decord saw {self.info.num_frames} frames, PyAV "
                                        f"{self._backend.info.num_frames}; cannot switch backend")
        return self._backend.read(missing)

    def frames(self, indices: Iterable[int]) -> np.ndarray:
        """RGB uint8 frames (N, H, W, 3) in the requested order; only uncached frames are decoded."""
        order = self._check(list(indices))
        h, w = self.info.height, self.info.width
        if not order:
            return np.zeros((0, h, w, 3), np.uint8)
        key = str(self.path)
        with self._lock:
            if self.changed is not None:
                raise VideoChanged(self.path, self.changed)
            got: dict[int, np.ndarray] = {}
            for i in dict.fromkeys(order):
                cached = self.cache.get(key, i, self.signature) if self.cache is not None else None
                if cached is not None:
                    got[i] = cached
            missing = sorted(set(order) - got.keys())
            if missing:
                self._ensure_open()
                if self._on_use is not None:
                    self._on_use(self)
                t0 = time.perf_counter()
                self._verify()
                decoded = self._decode(missing)
                self._verify()  # nothing decoded from a file that changed meanwhile is kept
                self.decode_seconds += time.perf_counter() - t0
                for i in missing:
                    frame = decoded[i]
                    if frame.shape != (h, w, 3) or frame.dtype != np.uint8:
                        raise VideoError(self.path, f"frame {i} decoded as {frame.shape} {frame.dtype}, "
                                                    f"expected ({h}, {w}, 3) uint8")
                    got[i] = frame
                    if self.cache is not None:
                        self.cache.put(key, i, frame, self.signature)
                self.decoded += len(missing)
        return np.stack([got[i] for i in order])

    def check_frames(self) -> None:
        """Decode the first frame (kept in the cache): a video whose frames cannot be read is a VideoError before
        any model is asked about it, never an answer from zero frames."""
        try:
            self.frames([0])
        except VideoChanged:
            raise
        except VideoError as exc:
            raise VideoError(self.path, f"no frame can be read ({exc.reason})") from exc

    def timestamps(self, indices: Iterable[int]) -> list[float]:
        """Start time in seconds of each frame."""
        return [index_to_time(self.info, i) for i in self._check(list(indices))]

    def release(self, blocking: bool = True, then=None) -> bool:
        """Close the file (the next decode opens it again). Not blocking: False, and nothing done, while another
        thread decodes. `then()` runs under the reader's lock once the file is closed."""
        if not self._lock.acquire(blocking=blocking):
            return False
        try:
            if self._backend is not None:
                self._backend.close()
                self._backend = None
            if then is not None:
                then()
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        self.release()

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signature_of(path: Path) -> Signature | None:
    """The file's content signature, None when it cannot be read (missing, ...); running out of file handles is
    raised as the OSError it is."""
    try:
        return signature(path)
    except OSError as exc:
        if out_of_handles(exc) is not None:
            raise
        return None


class VideoPool:
    """One VideoReader per resolved path and one FrameCache for all of them; thread-safe.

    A reader is reused only while its file holds the content it was opened on (checked by signature at each
    `open`): a file replaced under its name gets a new reader, and its old frames are dropped. At most `max_open`
    readers hold their file open: the least recently used ones are released (a reader in use is never closed under
    its caller; a released one opens again when next decoded), so a server over ever new files keeps its file
    handles and memory bounded. A file that failed to open keeps failing fast with the same error until it
    changes on disk.
    """

    def __init__(self, cache: FrameCache | None = None, max_bytes: int = 1 << 30,
                 backend: str = "auto", threads: int = 1, max_open: int = 64):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        self.cache = cache if cache is not None else FrameCache(max_bytes)
        self.backend = backend
        self.threads = threads
        self.max_open = max_open
        self.max_kept = 4 * max_open  # readers remembered (released ones hold no file, only what was probed)
        self._readers: OrderedDict[str, VideoReader] = OrderedDict()
        self._open: OrderedDict[int, VideoReader] = OrderedDict()  # readers holding their file, least recent first
        self._failures: OrderedDict[str, tuple[Signature | None, VideoError]] = OrderedDict()
        self._path_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def open(self, path: str | os.PathLike) -> VideoReader:
        problem = link_problem(path)
        if problem is not None:  # a VideoError (an error row), not resolve()'s RuntimeError that stops the run
            raise VideoError(path, problem)
        resolved = Path(path).resolve()
        key = str(resolved)
        now = _signature_of(resolved)
        with self._lock:
            reader = self._current(key, now)
            if reader is not None:
                return reader
            path_lock = self._path_locks.setdefault(key, threading.Lock())
        with path_lock:  # other paths open in parallel; the same path opens once
            with self._lock:
                reader = self._current(key, now)
                if reader is not None:
                    return reader
                stale = self._readers.pop(key, None)
                failure = self._failures.get(key)
            if stale is not None:  # the name holds other content now: its old reader and frames go
                self._retire(stale)
                self.cache.drop(key)
            if failure is not None and failure[0] == now:
                raise VideoError(failure[1].path, failure[1].reason)
            try:
                reader = VideoReader(resolved, cache=self.cache, backend=self.backend, threads=self.threads,
                                     on_use=self._used)
            except VideoError as exc:
                with self._lock:
                    self._failures[key] = (now, exc)
                    while len(self._failures) > self.max_kept:
                        self._failures.popitem(last=False)
                raise
            with self._lock:
                self._failures.pop(key, None)
                self._readers[key] = reader
                dropped = []
                while len(self._readers) > self.max_kept:
                    gone_key, gone = self._readers.popitem(last=False)
                    self._path_locks.pop(gone_key, None)
                    dropped.append(gone)
            for gone in dropped:
                self._retire(gone)
            self._used(reader)
            return reader

    def _current(self, key: str, now: Signature | None) -> VideoReader | None:
        """The remembered reader of `key` if the file still holds its content (under self._lock)."""
        reader = self._readers.get(key)
        if reader is None or now is None or reader.changed is not None or reader.signature != now:
            return None
        self._readers.move_to_end(key)
        return reader

    def _used(self, reader: VideoReader) -> None:
        """`reader` holds its file open and is being used: it becomes the most recent, and the least recent ones
        beyond `max_open` are released, skipping any that another thread is decoding with right now."""
        with self._lock:
            self._open[id(reader)] = reader
            self._open.move_to_end(id(reader))
            over = len(self._open) - self.max_open
            victims = [r for r in self._open.values() if r is not reader][:max(0, over)]
        for victim in victims:
            self._retire(victim)

    def _retire(self, reader: VideoReader, blocking: bool = False) -> None:
        def untrack():
            with self._lock:
                self._open.pop(id(reader), None)
        reader.release(blocking=blocking, then=untrack)

    def open_files(self) -> int:
        """How many readers hold their file open now."""
        with self._lock:
            return len(self._open)

    def forget(self, path: str | os.PathLike) -> None:
        """Close the reader of a file that is gone for good (an upload `m1 serve` deleted) and drop its frames,
        so a long-running server keeps nothing per request."""
        key = str(Path(path).resolve())
        with self._lock:
            reader = self._readers.pop(key, None)
            self._failures.pop(key, None)
            self._path_locks.pop(key, None)
        if reader is not None:
            self._retire(reader, blocking=True)
        self.cache.drop(key)

    def probe(self, path: str | os.PathLike) -> VideoInfo:
        """The info of an opened (and verified) video."""
        return self.open(path).info

    @property
    def decoded_total(self) -> int:
        with self._lock:
            return sum(r.decoded for r in self._readers.values())

    @property
    def readers(self) -> dict[str, VideoReader]:
        with self._lock:
            return dict(self._readers)

    def close(self) -> None:
        with self._lock:
            readers = list(self._readers.values()) + [r for r in self._open.values()
                                                      if r not in self._readers.values()]
            self._readers = OrderedDict()
        for reader in readers:
            self._retire(reader, blocking=True)


def link_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be followed to a file when a symlink is in the way (a loop, or a dangling link: named with
    its target), else None (a plain missing file is left to the reader's own message)."""
    import errno

    p = Path(path)
    try:
        p.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop (a link that leads back to itself); point it at a video file"
        if exc.errno == errno.ENOENT and p.is_symlink():
            return f"a dangling symlink (its target {os.readlink(p)} does not exist); restore it or remove the link"
    return None


def list_videos(folder: str | os.PathLike) -> list[Path]:
    """Video files (by extension, any case) directly inside folder, sorted by name; a link of a video's name that
    leads nowhere (dangling, a loop) is listed too, so it gets its error row (`VideoPool.open` names why)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise VideoError(folder, "not a directory" if folder.exists() else "no such folder")
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in VIDEO_EXTENSIONS
                  and (p.is_file() or (p.is_symlink() and link_problem(p) is not None)))


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

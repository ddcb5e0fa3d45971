"""What a video file holds, as a player shows it (`probe` -> `VideoInfo`): its video stream, the packets' timestamps,
whether it is whole (bmff.py) and how it is turned (orientation.py); and which files in a folder are videos."""
from __future__ import annotations

import errno
import itertools
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from m1.video.bmff import BmffLayout, bmff_layout
from m1.video.errors import VideoError, av_errors, cause_of, out_of_handles
from m1.video.orientation import Orientation, display_matrix, matrix_orientation, turn

VIDEO_EXTENSIONS = (".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v", ".flv", ".3gp", ".gif")
# Containers the readers open but do not read frame-exact (measured on 20-frame test files here: decord shows MPEG-TS
# one frame late and MPEG-PS / ASF black or repeated frames after a seek; PyAV trips on MPEG-TS start times). A
# folder leaves them out, each named with why (`left_out_videos`); a question that names one is read as it is.
INEXACT_CONTAINERS = {".ts": "MPEG-TS", ".m2ts": "MPEG-TS", ".mts": "MPEG-TS", ".mpg": "MPEG-PS",
                      ".mpeg": "MPEG-PS", ".vob": "MPEG-PS", ".wmv": "ASF", ".asf": "ASF"}


# FFmpeg demuxers that turn non-video files into "frames": text renderers and single images.
_TEXT_DEMUXERS = {"tty", "bin", "xbin", "adf", "idf"}
_TEXT_CODECS = {"ansi", "bintext", "xbin", "idf"}
_IMAGE_DEMUXERS = {"image2"}
_LENGTH_TOLERANCE = 0.02  # what a file holds may fall short of its declared length by 2% (or 1 s, or two frames)


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


def check_file(path: Path) -> None:
    if not path.exists():
        raise VideoError(path, "no such file")
    if not path.is_file():
        raise VideoError(path, "not a regular file")
    if path.stat().st_size == 0:
        raise VideoError(path, "file is empty")


def video_stream(container, path: Path):
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


def packet_table(container, stream, to_eof: bool = False) -> tuple[list[int], list[int]]:
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


def count_problem(declared: int, held: int, seconds: float) -> str:
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


def _check_complete(path: Path, info: VideoInfo, layout: BmffLayout, held: float) -> None:
    """A VideoError for an mp4/mov that is cut short or still being written (what shows it: bmff.py)."""
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


def frame_times(container, stream, pts: list[int], fps: float) -> tuple[float, ...] | None:
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


def with_times(info: VideoInfo, times: tuple[float, ...] | None) -> VideoInfo:
    if times is None:
        return info
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    last = gaps[len(gaps) // 2] if gaps else 1 / info.fps  # the last frame lasts a typical frame
    duration = times[-1] + last
    return replace(info, times=times, duration=duration, fps=info.num_frames / duration)


def make_info(path: Path, stream, container, num_frames: int) -> VideoInfo:
    if num_frames <= 0:
        raise VideoError(path, "the video stream has no frames")
    width, height = stream.codec_context.width, stream.codec_context.height
    if not width or not height:
        raise VideoError(path, f"the video stream has no frame size ({width}x{height})")
    fps = _stream_fps(stream, container, num_frames, path)
    return VideoInfo(str(path), num_frames / fps, fps, int(num_frames), int(width), int(height))


def oriented(info: VideoInfo, orientation: Orientation) -> VideoInfo:
    degrees, mirrored = turn(orientation)
    if orientation[0]:
        info = replace(info, width=info.height, height=info.width)
    return replace(info, rotation=degrees, mirrored=mirrored)


def orientation_of(info: VideoInfo) -> Orientation:
    return next(o for o in itertools.product((False, True), repeat=3) if turn(o) == (info.rotation, info.mirrored))


def probe(path: str | os.PathLike) -> VideoInfo:
    """Read a video as a player would show it (PyAV): the packets' timestamps (demuxed, not decoded) and the first
    frame's display matrix. Full verification happens when a VideoReader opens it."""
    import av

    path = Path(path).resolve()
    check_file(path)
    try:
        with av.open(str(path), metadata_errors="ignore") as container:
            stream = video_stream(container, path)
            # mp4, mov, m4v, 3gp (FFmpeg's "mov" demuxer): ISO BMFF boxes, checked for a cut below
            layout = bmff_layout(path) if "mov" in (container.format.name or "").split(",") else None
            # the packets' timestamps (demux only, no decoding): the time axis, read from the stream, not the header
            pts = packet_table(container, stream, to_eof=layout is not None and layout.torn is not None)[0]
            # the length is what the packets hold, never a header's count (an AVI's strh length, a moov that counts
            # only the samples before the first fragment); packets without any timestamp leave it to the header
            declared = stream.frames
            info = make_info(path, stream, container, len(pts) if pts else declared)
            if layout is not None:  # a plain mp4's moov lists every sample: its count is what the header says
                said = info if layout.fragmented or not declared else make_info(path, stream, container, declared)
                _check_complete(path, said, layout, _held_seconds(said, stream, pts))
            if pts and declared > len(pts) and not (layout is not None and layout.fragmented):
                raise VideoError(path, count_problem(declared, len(pts), _held_seconds(info, stream, pts)))
            if len(pts) == info.num_frames:
                info = with_times(info, frame_times(container, stream, pts, info.fps))
            index = stream.index
        return oriented(info, matrix_orientation(display_matrix(path, index), path))
    except av_errors() as exc:
        if out_of_handles(exc) is not None:
            raise out_of_handles(exc) from exc
        try:  # FFmpeg gives up on a file cut inside a `moof` (EOF): say that it is cut when the boxes show it
            layout = bmff_layout(path)
        except OSError:
            layout = None
        if layout is not None and layout.torn is not None:
            kind, size, present = layout.torn
            said = f"the header says {layout.declared:.1f} s, " if layout.declared else ""
            raise VideoError(path, f"incomplete or still being written: {said}the file ends inside its {kind!r} box "
                                   f"({present} of {size} bytes present); FFmpeg: {cause_of(exc)}") from exc
        raise VideoError(path, cause_of(exc)) from exc


def link_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be followed to a file when a symlink is in the way (a loop, or a dangling link: named with
    its target), else None (a plain missing file is left to the reader's own message)."""
    p = Path(path)
    try:
        p.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop (a link that leads back to itself); point it at a video file"
        if exc.errno == errno.ENOENT and p.is_symlink():
            return f"a dangling symlink (its target {os.readlink(p)} does not exist); restore it or remove the link"
    return None


def left_out_videos(folder: str | os.PathLike) -> list[str]:
    """One line per file of `folder` that `list_videos` leaves out though it is a video (INEXACT_CONTAINERS): what
    it is and what to do, so a folder run says which videos got no answer instead of skipping them unseen."""
    out = []
    for p in sorted(Path(folder).iterdir()):
        kind = INEXACT_CONTAINERS.get(p.suffix.lower())
        if kind and p.is_file():
            out.append(f"{p}: not read from a folder: the readers here do not decode {kind} frame-exact (frames late "
                       f"or wrong after a seek); convert it (ffmpeg -i {p.name} {p.stem}.mp4), or give the file "
                       f"itself as the video to read it as it is")
    return out


def list_videos(folder: str | os.PathLike) -> list[Path]:
    """Video files (by extension, any case) directly inside folder, sorted by name; a link of a video's name that
    leads nowhere (dangling, a loop) is listed too, so it gets its error row (`VideoPool.open` names why)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise VideoError(folder, "not a directory" if folder.exists() else "no such folder")
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in VIDEO_EXTENSIONS
                  and (p.is_file() or (p.is_symlink() and link_problem(p) is not None)))

"""The two decoding backends behind a VideoReader: decord (fast, batch) and PyAV (seek and decode forward). Each
opens a file already probed and hands back frames as a player shows them, or a VideoError."""
from __future__ import annotations

import bisect
from dataclasses import replace
from pathlib import Path

import numpy as np

from m1.video.errors import VideoError, av_errors, cause_of, decord_errors, out_of_handles
from m1.video.orientation import orient
from m1.video.probing import (
    VideoInfo, count_problem, frame_times, make_info, orientation_of, oriented, packet_table, video_stream, with_times,
)

BACKENDS = ("auto", "decord", "pyav")  # what a reader may be asked for; auto tries decord, then PyAV


class _DecordBackend:
    name = "decord"

    def __init__(self, path: Path, header: VideoInfo, threads: int):
        import decord

        self.path = path
        try:
            self._vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=threads)
            num_frames = len(self._vr)
            fps = float(self._vr.get_avg_fps()) or header.fps
        except decord_errors() as exc:
            if out_of_handles(exc) is not None:
                raise out_of_handles(exc) from exc
            raise VideoError(path, f"decord could not open it: {cause_of(exc)}") from exc
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
        except decord_errors() as exc:
            raise VideoError(self.path, f"decord failed to decode frames: {cause_of(exc)}") from exc
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
        except av_errors() as exc:
            if out_of_handles(exc) is not None:
                raise out_of_handles(exc) from exc
            raise VideoError(path, cause_of(exc)) from exc
        try:
            self._stream = video_stream(self._container, path)
            self._stream.codec_context.thread_count = threads
            declared = self._stream.frames
            self._pts, self._keys = packet_table(self._container, self._stream)
            if declared and len(self._pts) < declared:
                raise VideoError(path, count_problem(declared, len(self._pts), header.duration))
            info = make_info(path, self._stream, self._container, len(self._pts))
            info = with_times(info, frame_times(self._container, self._stream, self._pts, info.fps))
            self._orientation = orientation_of(header)
            self.info = oriented(info, self._orientation)
        except BaseException as exc:
            self._container.close()
            if isinstance(exc, av_errors()):
                raise VideoError(path, cause_of(exc)) from exc
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
        except av_errors() as exc:
            self._gen = None
            raise VideoError(self.path, f"PyAV failed to decode frames: {cause_of(exc)}") from exc
        return out

    def close(self) -> None:
        self._gen = None
        self._container.close()


def open_backend(name: str, path: Path, header: VideoInfo, threads: int):
    """The backend `name` ('decord' or 'pyav') over a probed file; a decord that cannot load is a VideoError."""
    if name == "decord":
        try:
            import decord  # noqa: F401
        except (ImportError, OSError) as exc:  # OSError: its shared library failed to load
            raise VideoError(path, f"backend 'decord' is not available ({cause_of(exc)}); "
                                   "decord is not installed or cannot load") from exc
        return _DecordBackend(path, header, threads)
    return _PyAVBackend(path, header, threads)

"""Frames of one video by index (`VideoReader`, one decoder and the shared cache) and the pool that keeps one reader
per file and a bounded number of files open (`VideoPool`). A reader and its frames stand for the content they were
read from (its signature, m1/signature.py), never for a name."""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from m1.signature import Signature, signature
from m1.video.cache import FrameCache
from m1.video.decoders import BACKENDS, open_backend
from m1.video.errors import VideoChanged, VideoError, out_of_handles
from m1.video.probing import VideoInfo, check_file, link_problem, probe
from m1.video.sampling import index_to_time


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
        check_file(self.path)  # missing, empty, not a file: named before anything is read
        signed = _signature_of(self.path)
        if signed is None:
            raise VideoError(self.path, "cannot be read (permission denied, or it went away)")
        self.signature: Signature = signed
        header = probe(self.path)  # rejects non-video files before any backend
        self._header = header
        if backend == "auto":
            try:
                self._backend = open_backend("decord", self.path, header, threads)
            except VideoError as decord_error:
                try:
                    self._backend = open_backend("pyav", self.path, header, threads)
                except VideoError as pyav_error:
                    raise VideoError(self.path, f"{pyav_error.reason}; decord: {decord_error.reason}") \
                        from pyav_error
        else:
            self._backend = open_backend(backend, self.path, header, threads)
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
        backend = open_backend(self._kind, self.path, self._header, self._threads)
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
        self._backend = open_backend("pyav", self.path, self._header, self._threads)
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

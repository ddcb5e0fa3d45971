"""The decoded-frame cache every reader of a pool shares: a frame is decoded once."""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np


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

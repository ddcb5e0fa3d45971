"""What a file holds, told cheaply: its size, its mtime and a hash of a few fixed blocks; and the full content hash.

A path names a place, not content: a video copied over in place, or moved into another's place, keeps its name. So
what M1 keeps about a video (an open reader, decoded frames, CLIP rows, a results line's fingerprint) is reused only
while the file's `Signature` is the one it was read from. Size and mtime alone miss a copy that keeps timestamps, or
a network file system that caches attributes; three 64 KiB blocks (start, middle, end) catch those, and reading
them costs well under a millisecond, so the signature is taken each time a file is opened. `file_sha256` hashes the
whole file, for keys that must name the content exactly (the CLIP disk cache, the experiment's train/test overlap).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

BLOCK = 64 << 10  # bytes read at each of the three places
_CHUNK = 1 << 20  # bytes read at a time by file_sha256


@dataclass(frozen=True)
class Signature:
    """A file's size, mtime (ns) and the hash of its blocks: two are equal when the content is (as far as a cheap
    look can tell)."""

    size: int
    mtime_ns: int
    blocks: str  # hex SHA-256 of the size and the three blocks, first 16 digits

    def __str__(self) -> str:
        return f"{self.size} bytes, mtime {self.mtime_ns / 1e9:.3f}, blocks {self.blocks[:8]}"


def _digest(f, spans) -> hashlib._Hash:
    """SHA-256 of the bytes of `f` in each (offset, length) of `spans`, length None meaning to the end."""
    h = hashlib.sha256()
    for offset, length in spans:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            chunk = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h


def signature(path: str | os.PathLike) -> Signature:
    """The file's Signature, read from one open file (size and mtime from that file, not a second stat); raises
    OSError when it cannot be read."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        starts = sorted({0, max(0, st.st_size // 2 - BLOCK // 2), max(0, st.st_size - BLOCK)})
        h = _digest(f, [(s, BLOCK) for s in starts])
    h.update(st.st_size.to_bytes(8, "big"))
    return Signature(st.st_size, st.st_mtime_ns, h.hexdigest()[:16])


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    with open(path, "rb") as f:
        return _digest(f, [(0, None)]).hexdigest()

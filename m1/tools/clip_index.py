"""CLIP embeddings of a video's frames, computed once per (model, video, frame) and reused by
every agent, tool and episode; text embeddings cached too.

In memory the index is keyed by the video's path, as before. With `cache_dir` it also keeps the
embeddings on disk so a later process (another `m1 infer` run, a training job) does not push the
same frames through the image encoder again. The disk key is what decides whether embeddings are
still valid: the SHA-256 of the video file's *content* (a re-encoded file at the same path gets a
new key; a copy at another path shares the old one) and a fingerprint of the CLIP model. One file
per (model, video) holds the frame indices embedded so far and their rows:

    <cache_dir>/<model-slug>-<model-hash>/<video-sha256>.npz
        indices (N,) int64, embeddings (N, D) float32, model (str), video (str), version (int)

Writes go to a temporary file in the same folder and are renamed over the target, so a reader
never sees half a file. A file that cannot be read or does not match its key is ignored with a
`ClipCacheWarning` and rewritten; the cache never stops an episode.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from m1.models.base import ClipModel
from m1.signature import Signature, file_sha256, signature

CACHE_VERSION = 1


class ClipCacheWarning(RuntimeWarning):
    """The on-disk CLIP cache could not be read or written; embeddings are recomputed."""


def model_fingerprint(model: ClipModel) -> str:
    """A string that changes when the embedder would: class, name and, for our backends, the
    full ModelSpec (architecture, pretrained tag or checkpoint, tiny seed) plus the size and
    modification time of a local checkpoint file. Pass `model_id` to ClipIndex for models whose
    weights can change under the same description."""
    parts: dict[str, object] = {"class": f"{type(model).__module__}.{type(model).__qualname__}",
                                "name": getattr(model, "name", None)}
    spec = getattr(model, "spec", None)
    if spec is not None and hasattr(spec, "recorded"):
        dumped = spec.recorded()
        for key in ("device", "dtype", "concurrency", "timeout", "max_retries"):
            dumped.pop(key, None)  # how it runs, not what it computes (dtype noise is tiny)
        parts["spec"] = dumped
        pretrained = dumped.get("pretrained")
        if pretrained and os.path.isfile(os.path.expanduser(pretrained)):
            st = os.stat(os.path.expanduser(pretrained))
            parts["checkpoint"] = [st.st_size, st.st_mtime_ns]
    return json.dumps(parts, sort_keys=True, default=str)


@dataclass
class _Video:
    """What the index holds for one path: its rows and, with a disk cache, its content key."""

    rows: dict[int, np.ndarray] = field(default_factory=dict)
    signature: Signature | None = None  # the content the rows were computed from (m1/signature.py)
    sha256: str | None = None


class ClipIndex:
    def __init__(self, model: ClipModel, batch_size: int = 64, cache_dir: str | os.PathLike | None = None,
                 model_id: str | None = None):
        self.model = model
        self.batch_size = batch_size
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.model_id = model_id if model_id is not None else model_fingerprint(model)
        self._videos: dict[str, _Video] = {}
        self._texts: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self.images_encoded = 0  # frames pushed through the image encoder (for tests/benchmarks)
        self.disk_loaded = 0  # rows read from the disk cache
        self.disk_writes = 0  # cache files written

    # ------------------------------------------------------------------ public API
    def frame_embeddings(self, video, indices: list[int]) -> np.ndarray:
        """(len(indices), D) rows; only frames never seen before (in memory or, with a disk
        cache, on disk) are decoded and encoded."""
        path = str(video.info.path)
        indices = [int(i) for i in indices]
        with self._lock:
            entry = self._entry(path, getattr(video, "signature", None))
            missing = sorted({i for i in indices if i not in entry.rows})
            self._encode(video, entry, path, missing)
            # rows dropped by a width mismatch with the disk cache are encoded afresh
            self._encode(video, entry, path, sorted({i for i in indices if i not in entry.rows}))
            if missing and self.cache_dir is not None:
                self._save(entry, path)
            return np.stack([entry.rows[i] for i in indices])

    MAX_TEXTS = 4096  # text embeddings kept (least recently used dropped): a server sees ever new key infos

    def text_embedding(self, text: str) -> np.ndarray:
        with self._lock:
            row = self._texts.pop(text, None)
            if row is None:
                row = self.model.encode_texts([text])[0]
            self._texts[text] = row  # most recently used last
            while len(self._texts) > self.MAX_TEXTS:
                del self._texts[next(iter(self._texts))]
            return row

    def forget(self, path: str) -> None:
        """Drop the rows of a video that is gone for good (an upload `m1 serve` deleted)."""
        with self._lock:
            self._videos.pop(str(path), None)

    def scores(self, video, indices: list[int], text: str) -> np.ndarray:
        return self.frame_embeddings(video, indices) @ self.text_embedding(text)

    def cache_path(self, video_sha256: str) -> Path:
        """Where the embeddings of the video with this content hash live for this model."""
        if self.cache_dir is None:
            raise ValueError("ClipIndex.cache_path: this index has no cache_dir")
        name = getattr(self.model, "name", None) or type(self.model).__name__
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name))[:40] or "clip"
        digest = hashlib.sha256(self.model_id.encode()).hexdigest()[:16]
        return self.cache_dir / f"{slug}-{digest}" / f"{video_sha256}.npz"

    # ------------------------------------------------------------------ internals
    def _entry(self, path: str, sig: Signature | None) -> _Video:
        """The rows of `path` for the content its reader was opened on (`sig`, the reader's signature): rows of a
        file since replaced under its name are never reused. With a disk cache the content's SHA-256 keys them."""
        entry = self._videos.get(path)
        if self.cache_dir is None:
            if entry is None or entry.signature != sig:
                entry = self._videos[path] = _Video(signature=sig)
            return entry
        try:
            sig = sig if sig is not None else signature(path)
            if entry is not None and entry.signature == sig:
                return entry
            sha = file_sha256(path)
            if signature(path) != sig:  # changed since its reader opened it: the hash is not of what is read
                raise OSError(f"{path} changed since it was opened")
        except OSError as exc:  # gone, unreadable or changed since it was opened: memory only
            self._warn(f"cannot hash {path} for the CLIP cache ({exc}); its embeddings stay in memory only")
            entry = self._videos[path] = _Video(signature=sig)
            return entry
        if entry is not None and entry.sha256 == sha:  # touched, same bytes
            entry.signature = sig
            return entry
        entry = self._videos[path] = _Video(signature=sig, sha256=sha)
        self._load(entry, path)
        return entry

    def _load(self, entry: _Video, path: str) -> None:
        target = self.cache_path(entry.sha256)
        got = self._try_read(target, entry.sha256, path, "ignoring")
        if got is None:
            return
        indices, emb = got
        for i, e in zip(indices.tolist(), emb):
            entry.rows[int(i)] = e
        self.disk_loaded += len(indices)

    def _try_read(self, target: Path, sha: str, path: str, verb: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The file's (indices, embeddings), or None when absent; a damaged file is reported with
        a ClipCacheWarning and treated as absent. np.load raises many types on damaged zips
        (BadZipFile, zlib.error, EOFError, ValueError, KeyError, OSError), hence the broad catch."""
        if not target.exists():
            return None
        try:
            return self._read(target, sha)
        except Exception as exc:  # noqa: BLE001 - reported, then recomputed
            self._warn(f"{verb} unreadable CLIP cache file {target} (for {path}): "
                       f"{type(exc).__name__}: {exc}; its embeddings will be recomputed")
            return None

    def _read(self, target: Path, sha: str) -> tuple[np.ndarray, np.ndarray]:
        """Load and validate one cache file; raises ValueError naming what is wrong."""
        with np.load(target, allow_pickle=False) as data:
            missing = {"indices", "embeddings", "model", "video", "version"} - set(data.files)
            if missing:
                raise ValueError(f"missing arrays {sorted(missing)}")
            version = int(data["version"])
            model, video = str(data["model"]), str(data["video"])
            indices, emb = np.array(data["indices"]), np.array(data["embeddings"])
        if version != CACHE_VERSION:
            raise ValueError(f"cache version {version}, expected {CACHE_VERSION}")
        if video != sha:
            raise ValueError(f"holds video {video[:16]}..., expected {sha[:16]}...")
        if model != self.model_id:
            raise ValueError("written for a different CLIP model")
        if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(f"indices must be a 1-D integer array, got {indices.dtype} {indices.shape}")
        if emb.ndim != 2 or emb.shape[0] != indices.shape[0] or emb.dtype != np.float32:
            raise ValueError(f"embeddings {emb.dtype} {emb.shape} do not match {indices.shape[0]} indices")
        if (indices < 0).any() or len(np.unique(indices)) != len(indices):
            raise ValueError("indices must be unique and non-negative")
        if not np.isfinite(emb).all():
            raise ValueError("embeddings contain NaN or inf")
        return indices.astype(np.int64), emb

    def _encode(self, video, entry: _Video, path: str, missing: list[int]) -> None:
        for start in range(0, len(missing), self.batch_size):
            chunk = missing[start:start + self.batch_size]
            emb = np.asarray(self.model.encode_images(video.frames(chunk)), dtype=np.float32)
            self.images_encoded += len(chunk)
            self._check_dim(entry, path, emb)
            for i, e in zip(chunk, emb):
                entry.rows[i] = e

    def _check_dim(self, entry: _Video, path: str, emb: np.ndarray) -> None:
        """Rows loaded from disk must have the width the model produces now."""
        if not entry.rows:
            return
        have = next(iter(entry.rows.values())).shape
        if emb.ndim == 2 and have != emb.shape[1:]:
            self._warn(f"CLIP cache rows for {path} have shape {have} but the model gives "
                       f"{emb.shape[1:]}; dropping the cached rows")
            entry.rows.clear()

    def _save(self, entry: _Video, path: str) -> None:
        """Write every row known for this video, merged with what another process may have
        added to the file meanwhile; atomic rename."""
        if entry.sha256 is None:  # the file could not be hashed: memory only
            return
        target = self.cache_path(entry.sha256)
        rows = dict(entry.rows)
        got = self._try_read(target, entry.sha256, path, "replacing")
        if got is not None and rows and got[1].shape[1:] == next(iter(rows.values())).shape:
            for i, e in zip(got[0].tolist(), got[1]):
                rows.setdefault(int(i), e)
        order = sorted(rows)
        emb = np.stack([rows[i] for i in order]).astype(np.float32, copy=False)
        tmp = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.stem[:16]}.", suffix=".tmp", dir=target.parent)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, indices=np.asarray(order, np.int64), embeddings=emb,
                         model=np.array(self.model_id), video=np.array(entry.sha256),
                         version=np.array(CACHE_VERSION))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            tmp = None
            self.disk_writes += 1
        except OSError as exc:
            self._warn(f"cannot write CLIP cache file {target} (for {path}): {exc}; "
                       "embeddings stay in memory only")
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(message, ClipCacheWarning, stacklevel=3)


def team_clip_index(cfg, hub) -> ClipIndex | None:
    """The CLIP index of a team config's tools (None without a CLIP), built once per team by its engine (the CPP
    Team, the single-agent loop) when a tool first needs it, so its model loads only then."""
    if cfg.tools.clip is None:
        return None
    return ClipIndex(hub.clip(cfg.tools.clip), cache_dir=cfg.tools.clip_cache_dir)

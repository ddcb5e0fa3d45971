"""CLIP embeddings of a video's frames, computed once per (model, video, frame) and reused by
every agent, tool and episode; text embeddings cached too."""
from __future__ import annotations

import threading

import numpy as np

from m1.models.base import ClipModel


class ClipIndex:
    def __init__(self, model: ClipModel, batch_size: int = 64):
        self.model = model
        self.batch_size = batch_size
        self._frames: dict[tuple[str, int], np.ndarray] = {}
        self._texts: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self.images_encoded = 0  # frames pushed through the image encoder (for tests/benchmarks)

    def frame_embeddings(self, video, indices: list[int]) -> np.ndarray:
        """(len(indices), D) rows; only frames never seen before are decoded and encoded."""
        path = str(video.info.path)
        with self._lock:
            missing = sorted({i for i in indices if (path, i) not in self._frames})
            for start in range(0, len(missing), self.batch_size):
                chunk = missing[start:start + self.batch_size]
                emb = self.model.encode_images(video.frames(chunk))
                self.images_encoded += len(chunk)
                for i, e in zip(chunk, emb):
                    self._frames[(path, i)] = e
            return np.stack([self._frames[(path, i)] for i in indices])

    def text_embedding(self, text: str) -> np.ndarray:
        with self._lock:
            if text not in self._texts:
                self._texts[text] = self.model.encode_texts([text])[0]
            return self._texts[text]

    def scores(self, video, indices: list[int], text: str) -> np.ndarray:
        return self.frame_embeddings(video, indices) @ self.text_embedding(text)

"""open_clip image/text embedder for the retrieval tools (Video, Image and Time Stamp Retrieval).

Runs offline: the text BPE vocab ships inside the open_clip wheel, and weights come from a local
checkpoint, a pretrained tag already in the local cache, or the tiny folder built by
`m1.models.tiny.ensure_tiny`.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np

from m1.config import ModelSpec
from m1.models.base import ModelError
from m1.models.hf import resolve_device, resolve_dtype
from m1.models.tiny import CLIP_CHECKPOINT, clip_config_name, ensure_tiny


def register_config(path: Path) -> str:
    """Register an open_clip model config json with open_clip; returns the model name (stem)."""
    import open_clip

    path = Path(path)
    cfg = json.loads(path.read_text())
    if not all(k in cfg for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise ModelError(f"{path}: not an open_clip model config (needs embed_dim, vision_cfg, "
                         f"text_cfg)")
    open_clip.add_model_config(path)
    return path.stem


def _tiny_source(spec: ModelSpec) -> tuple[str, str]:
    folder = ensure_tiny(spec.tiny)
    name = register_config(folder / f"{clip_config_name(spec.tiny)}.json")
    return name, str(folder / CLIP_CHECKPOINT)


SYNTH_CLIP = "m1-synth"  # clip_name of the world's own CLIP (`m1 synth train-clip`)
# CLIPs known by name, found like the hub's backends so that models never import the synthetic world:
# clip_name -> (module, function() -> (open_clip config json, checkpoint))
NAMED_CLIPS: dict[str, tuple[str, str]] = {SYNTH_CLIP: ("m1.synth.clip_train", "synth_clip_files")}


class OpenClipModel:
    """CLIP embeddings, L2-normalised float32 rows, computed in batches."""

    def __init__(self, spec: ModelSpec, name: str, batch_size: int = 64):
        if spec.interface != "clip":
            raise ModelError(f"model {name!r}: OpenClipModel needs interface 'clip', got {spec.interface!r}")
        import open_clip
        import torch

        self.name = name
        self.spec = spec
        self.batch_size = batch_size
        self.calls = 0
        self._lock = threading.Lock()
        if spec.tiny is not None:
            arch, pretrained = _tiny_source(spec)
        elif spec.clip_name in NAMED_CLIPS:  # e.g. the M1-Synth CLIP: shipped, or trained on first use
            import importlib

            module, fn = NAMED_CLIPS[spec.clip_name]
            cfg_path, ckpt = getattr(importlib.import_module(module), fn)()
            arch, pretrained = register_config(cfg_path), str(ckpt)
        else:
            arch, pretrained = spec.clip_name, spec.pretrained
            if arch and arch.endswith(".json"):  # a custom config file, e.g. a trained synth CLIP
                if not os.path.isfile(arch):
                    raise ModelError(f"model {name!r}: clip_name {arch!r} is not a file")
                arch = register_config(Path(arch))
            if pretrained:
                pretrained = os.path.expanduser(pretrained)
        self.device = resolve_device(spec.device)
        try:
            model, _, preprocess = open_clip.create_model_and_transforms(
                arch, pretrained=pretrained or None, device=self.device)
            self.tokenizer = open_clip.get_tokenizer(arch)
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            raise ModelError(f"model {name!r}: cannot build open_clip {arch!r} with pretrained="
                             f"{pretrained!r}: {exc}") from exc
        self.dtype = resolve_dtype(spec.dtype, self.device)
        self.model = model.to(self.device, dtype=self.dtype).eval()
        self.preprocess = preprocess
        self.dim = int(getattr(model.visual, "output_dim", 0) or model.text_projection.shape[-1])
        self._torch = torch

    def encode_images(self, frames: np.ndarray) -> np.ndarray:
        from PIL import Image

        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ModelError(f"model {self.name!r}: frames must be (N, H, W, 3) uint8, got "
                             f"shape {frames.shape}")
        if frames.dtype != np.uint8:
            raise ModelError(f"model {self.name!r}: frames must be uint8, got {frames.dtype}")
        torch = self._torch
        rows = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(frames), self.batch_size):
                chunk = frames[start:start + self.batch_size]
                x = torch.stack([self.preprocess(Image.fromarray(f)) for f in chunk])
                rows.append(self._normalise(self.model.encode_image(
                    x.to(self.device, dtype=self.dtype))))
                self.calls += 1
        return np.concatenate(rows) if rows else np.zeros((0, self.dim), np.float32)

    def encode_texts(self, texts: list[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise ModelError(f"model {self.name!r}: encode_texts takes a list of strings")
        torch = self._torch
        rows = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                tokens = self.tokenizer(list(texts[start:start + self.batch_size]))
                rows.append(self._normalise(self.model.encode_text(tokens.to(self.device))))
                self.calls += 1
        return np.concatenate(rows) if rows else np.zeros((0, self.dim), np.float32)

    def _normalise(self, feats) -> np.ndarray:
        feats = self._torch.nn.functional.normalize(feats.float(), dim=-1)
        return feats.cpu().numpy().astype(np.float32)

"""Architecture shapes of the paper's models, known without downloading them.

Nothing can be fetched from a model hub on the machines M1 is tested on, yet two things need the real sizes: the
placement plan (memory per GPU from parameter counts and KV-cache widths) and `scripts/gpu_check.py` (random models
of the paper's shapes). The numbers are those of each model's public `config.json`. For a hub id not listed here, or a
local folder, `text_shape` reads the `config.json` in the folder or in the Hugging Face cache.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


class ShapeError(ValueError):
    pass


@dataclass(frozen=True)
class TextShape:
    """A decoder-only language model (Qwen2 / Qwen3 family): what parameter count and KV cache depend on."""

    model_type: str  # "qwen2" | "qwen3"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768

    def parameters(self) -> int:
        """Exact parameter count of the HF implementation (Qwen2: q/k/v biases; Qwen3: q/k RMS norms)."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        attn = h * q + 2 * h * kv + q * h
        if self.model_type == "qwen2":
            attn += q + 2 * kv  # biases of q, k, v
        else:
            attn += 2 * hd  # q_norm, k_norm
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h
        return embed + self.num_hidden_layers * layer + h + (0 if self.tie_word_embeddings else embed)

    def lora_parameters(self, r: int, targets: tuple[str, ...] | list[str]) -> int:
        """Parameters of a LoRA adapter of rank r on the named linear layers of every decoder layer."""
        h, hd, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        unknown = [t for t in targets if t not in dims]
        if unknown:
            raise ShapeError(f"LoRA target modules {unknown} are not linear layers of a {self.model_type} model "
                             f"(known: {sorted(dims)})")
        return self.num_hidden_layers * sum(r * (dims[t][0] + dims[t][1]) for t in targets)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Key + value cache of one token over all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_value

    def hf_config(self, **extra):
        """A transformers config of this shape (for random initialisation; no download)."""
        from transformers import AutoConfig

        kw = asdict(self)
        model_type = kw.pop("model_type")
        return AutoConfig.for_model(model_type, **kw, **extra)


# The paper's policy agents (public config.json of each hub id).
TEXT_SHAPES: dict[str, TextShape] = {
    "Qwen/Qwen3-8B": TextShape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False, 40960),
    "Qwen/Qwen3-4B": TextShape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, 40960),
    "Qwen/Qwen2.5-7B-Instruct": TextShape("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False, 32768),
    "Qwen/Qwen2.5-3B-Instruct": TextShape("qwen2", 2048, 36, 16, 2, 128, 11008, 151936, True, 32768),
}
TEXT_SHAPES["Qwen/Qwen2.5-7B"] = TEXT_SHAPES["Qwen/Qwen2.5-7B-Instruct"]
TEXT_SHAPES["Qwen/Qwen2.5-3B"] = TEXT_SHAPES["Qwen/Qwen2.5-3B-Instruct"]

# Vision-language models and CLIP used as tools (inference only): total parameters, language model included.
# Qwen2.5-VL-7B: Qwen2.5-7B + a 32-layer 1280-wide ViT; InternVL3.5-8B: Qwen3-8B + InternViT-300M;
# Eagle2.5-8B: Qwen2.5-7B + SigLIP-so400m; CLIP ViT-B/16: 150M.
VISION_PARAMS: dict[str, int] = {
    "Qwen/Qwen2.5-VL-7B-Instruct": 8_292_000_000,
    "Qwen/Qwen2.5-VL-3B-Instruct": 3_755_000_000,
    "OpenGVLab/InternVL3_5-8B-HF": 8_528_000_000,
    "OpenGVLab/InternVL3_5-8B": 8_528_000_000,
    "nvidia/Eagle2.5-8B": 8_334_000_000,
    "ViT-B-16": 149_620_000,
    "ViT-L-14": 427_616_000,
}


@dataclass(frozen=True)
class VisionShape:
    """What one request costs a vision tool model beyond its weights: its language model (KV cache and prefill of the
    request's tokens), its vision tower (width; ViT patches merged into one visual token) and the visual tokens a frame
    becomes. Frames are resized to at most `frame_pixels` (the processor's own cap, or the spec's max_pixels where
    the model honours it), each `token_pixels` of a frame giving one token, `frames_per_token` frames folded into one
    (Qwen2.5-VL's temporal patch of 2)."""

    text: TextShape
    vit_width: int
    patches_per_token: int
    token_pixels: int
    frames_per_token: int
    frame_pixels: int
    tiles: bool = False  # every frame becomes one fixed tile (InternVL, Eagle): max_pixels does not change it

    def tokens_per_frame(self, max_pixels: int | None = None) -> int:
        """Visual tokens of one frame (rounded up): the language model's share of a request's tokens."""
        pixels = self.frame_pixels if max_pixels is None or self.tiles else min(self.frame_pixels, max_pixels)
        return -(-pixels // (self.token_pixels * self.frames_per_token))


# The paper's vision tools: the language model (a TEXT_SHAPES entry) and the vision tower of each. Qwen2.5-VL: a
# 1280-wide ViT of 14-pixel patches merged 2x2 and 2 frames, frames capped by its video processor at 768 * 28 * 28
# pixels; InternVL3.5 (InternViT-300M, 1024 wide) and Eagle2.5 (SigLIP-so400m, 1152 wide): a 448-pixel tile per
# frame, pixel-shuffled to 256 tokens.
VISION_SHAPES: dict[str, VisionShape] = {
    "Qwen/Qwen2.5-VL-7B-Instruct": VisionShape(TEXT_SHAPES["Qwen/Qwen2.5-7B-Instruct"], 1280, 4, 28 * 28, 2,
                                               768 * 28 * 28),
    "Qwen/Qwen2.5-VL-3B-Instruct": VisionShape(TEXT_SHAPES["Qwen/Qwen2.5-3B-Instruct"], 1280, 4, 28 * 28, 2,
                                               768 * 28 * 28),
    "OpenGVLab/InternVL3_5-8B-HF": VisionShape(TEXT_SHAPES["Qwen/Qwen3-8B"], 1024, 4, 28 * 28, 1, 448 * 448, True),
    "nvidia/Eagle2.5-8B": VisionShape(TEXT_SHAPES["Qwen/Qwen2.5-7B-Instruct"], 1152, 4, 28 * 28, 1, 448 * 448, True),
}
VISION_SHAPES["OpenGVLab/InternVL3_5-8B"] = VISION_SHAPES["OpenGVLab/InternVL3_5-8B-HF"]


def vision_shape_from_config(cfg: dict, where: str) -> VisionShape:
    """A VisionShape from a VLM's config.json (Qwen2.5-VL layout: vision_config with hidden_size, patch_size,
    spatial_merge_size, temporal_patch_size); frames capped as Qwen2.5-VL's video processor caps them."""
    vis = cfg.get("vision_config")
    if not isinstance(vis, dict):
        raise ShapeError(f"{where}: config.json has no vision_config; cannot size its requests")
    patch, merge = int(vis.get("patch_size", 14)), int(vis.get("spatial_merge_size", 2))
    return VisionShape(shape_from_config(cfg, where), int(vis.get("hidden_size", vis.get("embed_dim", 1280))),
                       merge * merge, (patch * merge) ** 2, int(vis.get("temporal_patch_size", 1) or 1),
                       768 * 28 * 28)


def vision_shape(path: str) -> VisionShape:
    """The request-sizing shape of a vision tool model given by hub id or local folder; a clear error when unknown."""
    return VISION_SHAPES.get(path) or vision_shape_from_config(
        _required_config(path, "request size unknown", "VISION_SHAPES", "set the model's max_batch_requests or add "
                         "its shape"), path)


def _required_config(path: str, what: str, table: str, fix: str) -> dict:
    """config.json of a model missing from a table of known shapes; a ShapeError saying how to fix it when absent."""
    cfg = _read_config(path)
    if cfg is None:
        raise ShapeError(f"model {path!r}: {what} (not in m1.models.shapes.{table}, and no config.json in that "
                         f"folder or in the Hugging Face cache); {fix}")
    return cfg


def _read_config(path: str) -> dict | None:
    """config.json of a local folder, or of a hub id already in the Hugging Face cache (no download)."""
    folder = Path(path)
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text())
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
    except Exception:  # not a valid repo id: no cache entry to look for
        return None
    if isinstance(cached, str) and Path(cached).is_file():
        return json.loads(Path(cached).read_text())
    return None


def shape_from_config(cfg: dict, where: str) -> TextShape:
    """A TextShape from a transformers config dict (text_config of a VLM is used when present)."""
    cfg = cfg.get("text_config", cfg)
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return TextShape(
            model_type=cfg.get("model_type", "qwen2") if cfg.get("model_type") in ("qwen2", "qwen3") else "qwen2",
            hidden_size=hidden, num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or hidden // heads, intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"], tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768))
    except KeyError as exc:
        raise ShapeError(f"{where}: config.json has no {exc.args[0]!r}; cannot size the model") from exc


def text_shape(path: str) -> TextShape:
    """The shape of a chat model given by hub id or local folder; a clear error when it is unknown here."""
    return TEXT_SHAPES.get(path) or shape_from_config(
        _required_config(path, "shape unknown", "TEXT_SHAPES", "download it first or add its shape"), path)


def vision_parameters(path: str) -> int:
    """Total parameters of a vision tool model (VLM or CLIP) given by hub id, open_clip name or local folder."""
    if path in VISION_PARAMS:
        return VISION_PARAMS[path]
    cfg = _read_config(path)
    if cfg is not None:
        return text_shape(path).parameters()  # the language model dominates; the vision tower is under 10%
    raise ShapeError(f"model {path!r}: size unknown (not in m1.models.shapes.VISION_PARAMS and no config.json "
                     "found); add its parameter count")

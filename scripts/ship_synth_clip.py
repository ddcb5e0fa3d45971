"""Ship a trained synth CLIP folder as the default asset (m1/assets/synth_clip), so the demo does not train one.

    python scripts/ship_synth_clip.py ~/.cache/m1/synth_clip/<hash>
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m1.synth.clip_train import MANIFEST, METRICS, SHIPPED  # noqa: E402


def ship(model_dir: str | os.PathLike, dest: str | os.PathLike = SHIPPED) -> Path:
    """Copy a trained synth CLIP folder to `dest/<its hash>` as safetensors, the token embedding (93% of the
    weights, mostly rows no caption uses) in fp16 and the rest in fp32: half the size, and the demo's answers stay
    exactly those of the fp32 model (with every weight in fp16 one grounding answer moved by 0.2 s)."""
    import torch
    from safetensors.torch import save_file

    src = Path(model_dir)
    manifest = json.loads((src / MANIFEST).read_text())
    out = Path(dest) / src.name
    out.mkdir(parents=True, exist_ok=True)
    state = torch.load(src / manifest["checkpoint"], map_location="cpu", weights_only=False)
    save_file({k: (v.to(torch.float16) if k == "token_embedding.weight" else v).contiguous() for k, v in state.items()},
              out / "open_clip_model.safetensors")
    shutil.copy(src / manifest["config"], out)
    if (src / METRICS).is_file():
        shutil.copy(src / METRICS, out)
    (out / MANIFEST).write_text(json.dumps({**manifest, "checkpoint": "open_clip_model.safetensors"}, indent=2))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", help="a folder synth CLIP training wrote")
    p.add_argument("--dest", default=str(SHIPPED))
    print(ship(p.parse_args().model_dir, p.parse_args().dest))

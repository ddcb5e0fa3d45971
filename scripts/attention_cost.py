"""The evidence attention loss's cost per `m1 pretrain` step, side by side with the same step without it.

Two pretrainers on one config (the loss on, and off), stepped alternately in one process so that both see the same
machine load; prints the median CPU seconds per step of each and their ratio.

    python scripts/attention_cost.py --config m1/configs/pretrain/mini_base.yaml --frames 16 --steps 20
"""
import argparse
import statistics
import tempfile
import time

from m1.pretrain.config import load_pretrain_config
from m1.pretrain.train import Pretrainer

ap = argparse.ArgumentParser()
ap.add_argument("--config", default="m1/configs/pretrain/mini_base.yaml")
ap.add_argument("--frames", type=int, default=16)
ap.add_argument("--steps", type=int, default=20)
a = ap.parse_args()
with tempfile.TemporaryDirectory() as tmp:
    sets = [f"curriculum=[{{start: 0, frames: {a.frames}}}]", "checkpoint_every=100000"]
    on = load_pretrain_config(a.config, sets + [f"out_dir={tmp}/on"])
    off = load_pretrain_config(a.config, sets + [f"out_dir={tmp}/off", "attention.weight=0"])
    assert on.attention.on, "the config's attention loss is off: nothing to compare"
    trainers = {"on": Pretrainer(on, progress=lambda s: None), "off": Pretrainer(off, progress=lambda s: None)}
    spent: dict[str, list[float]] = {k: [] for k in trainers}
    for step in range(a.steps + 2):
        for name, tr in trainers.items():
            t0 = time.process_time()
            tr.train_step()
            if step >= 2:  # the first steps warm caches up
                spent[name].append(time.process_time() - t0)
    med = {k: statistics.median(v) for k, v in spent.items()}
    print(f"frames {a.frames}, batch {on.batch_size}, {a.steps} steps each: loss on {med['on']:.3f} CPU-s/step, "
          f"off {med['off']:.3f}; ratio {med['on'] / med['off']:.2f}")

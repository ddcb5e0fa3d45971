"""The shipped mini base (assets/mini_base, `m1 pretrain --config mini_base`): a plain Qwen checkpoint that loads
with `from_pretrained` in a process that never imports M1, and reads held-out drills as its record says."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from m1.pretrain.drills import CHAINS, DrillSource
from m1.pretrain.train import grade

BASE = Path(__file__).resolve().parents[2] / "assets" / "mini_base"

# run in a fresh interpreter: transformers and torch only
READER = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
base, prompts, new = sys.argv[1], json.loads(sys.stdin.read()), int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(base)
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(base).eval()
outs = []
for i in range(0, len(prompts), 16):
    enc = tok(prompts[i:i + 16], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    outs += tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
assert not any(m == "m1" or m.startswith("m1.") for m in sys.modules), "M1 code was imported"
print(json.dumps(outs))
"""


def test_the_shipped_base_has_its_record():
    record = json.loads((BASE / "record.json").read_text())
    assert record["steps"] > 0 and record["core_hours"] <= 2.0
    assert sum(record["graded"][f] >= 0.9 for f in CHAINS) >= 3, record["graded"]
    assert (BASE / "model.safetensors").is_file() and (BASE / "tokenizer.json").is_file()


@pytest.mark.slow
def test_the_shipped_base_loads_without_m1_and_reads_held_out_drills():
    record = json.loads((BASE / "record.json").read_text())
    steps = record["config"].get("steps_written", True)
    source = DrillSource("held_out", seed=4242)
    drills = [source.draw(f, frames=16, steps=steps) for f in CHAINS for _ in range(24)]
    r = subprocess.run([sys.executable, "-c", READER, str(BASE), "60"], input=json.dumps([d.prompt for d in drills]),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = json.loads(r.stdout.strip().splitlines()[-1])
    for family in CHAINS:
        hits = [grade(d, o) for d, o in zip(drills, outs) if d.family == family]
        # 24 fresh drills per family: the record's >= .9 with room for the noise of a small sample
        assert sum(hits) / len(hits) >= 0.75, (family, sum(hits), [o for d, o in zip(drills, outs)][:3])

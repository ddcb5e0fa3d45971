"""Option -> letter alone (issue #64, pt_d's puzzle): the `option` drill of m1/pretrain/drills.py, batch 32, lr 1e-3,
one thread, the mini base's student (Qwen3 hidden 128, 2 layers, the reading tokenizer); the loss on the letter only
(`letter`, a softmax over the whole vocabulary) or on every token (`all`), from init INIT. Prints held-out accuracy
on 200 drills every 100 steps.

    python scripts/option_probe.py 0.2 letter 600
"""
import os, sys, json, random, time, torch
os.environ.setdefault("M1_CACHE", "runs/cache")
torch.set_num_threads(1)
from m1.config import TinySpec
from m1.models.tiny import ensure_tiny
from m1.pretrain.drills import DrillSource
from transformers import AutoModelForCausalLM, AutoTokenizer
init, loss_kind, steps = float(sys.argv[1]), sys.argv[2], int(sys.argv[3])
spec = TinySpec(arch="qwen3", hidden_size=128, layers=2, heads=4, kv_heads=2, corpus="reading", init_std=init, seed=11)
folder = ensure_tiny(spec); tok = AutoTokenizer.from_pretrained(folder)
torch.manual_seed(0); model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
src, held = DrillSource("train", 0), DrillSource("held_out", 1)
test = [held.draw("option") for _ in range(200)]
def enc(ds):
    rows = [(tok(d.prompt, add_special_tokens=False)["input_ids"], tok(d.target, add_special_tokens=False)["input_ids"]) for d in ds]
    W = max(len(p) + len(t) for p, t in rows)
    ids = torch.tensor([p + t + [tok.pad_token_id] * (W - len(p) - len(t)) for p, t in rows])
    return ids, rows
def acc():
    model.eval()
    with torch.no_grad():
        ids, rows = enc(test)
        lg = model(input_ids=ids).logits
        hit = [int(lg[b, len(p) - 1].argmax() == t[0]) for b, (p, t) in enumerate(rows)]
    model.train(); return sum(hit) / len(hit)
t0 = time.time()
for step in range(steps + 1):
    if step % 100 == 0: print(json.dumps({"step": step, "acc": acc(), "s": round(time.time() - t0)}), flush=True)
    ids, rows = enc([src.draw("option") for _ in range(32)])
    lab = ids.clone()
    for b, (p, t) in enumerate(rows):
        lab[b, len(p) + len(t):] = -100
        if loss_kind == "letter": lab[b, :len(p)] = -100
    lg = model(input_ids=ids).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()

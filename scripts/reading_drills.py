"""Can a tiny student learn to read described frames at all? A probe for issue #52.

The seed-kind students answer at chance after SFT on the rule policies' episodes (docs/experiments/seed_kinds.md).
This probe removes everything but the reading: short drills built from the captions the policies see (the glance of
each training episode, `<frame k at t s>` plus its description), a question of two families whose answer is written
in those captions (attribute: "Where in the frame does the X appear?", timestamp: "What colour is the shape that
appears at mm:ss?"), four options, and the letter as the only target. Drills are drawn afresh every step (no data
runs out); evaluation drills come from other videos. Reported: held-out drill accuracy (argmax over the four letters
at the answer position) as steps go, against chance (25%).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

from m1.config import TinySpec
from m1.models.tiny import ensure_tiny

POSITIONS = ["top left", "top right", "bottom left", "bottom right"]
CAPTION = re.compile(r"an? (?:small|medium|large) (\w+) (\w+) at the (top left|top right|bottom left|bottom right)")


def glances(path: Path) -> list[tuple[str, list[tuple[float, str]]]]:
    """(video, [(time, caption)]) of each distinct glance in an SFT-examples file (the first user turn's frames)."""
    seen: dict[str, list[tuple[float, str]]] = {}
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            if row["video"] in seen:
                continue
            user = next(m for m in row["messages"] if m["role"] == "user")
            seen[row["video"]] = [(p["time"], p["caption"]) for p in user["content"] if p["type"] == "image"]
    return list(seen.items())


def objects(caption: str) -> list[tuple[str, str, str]]:
    return CAPTION.findall(caption)


def drill(frames: list[tuple[float, str]], rng: random.Random, colours: list[str]) -> tuple[str, int, str] | None:
    """One drill from a glance, or None when this glance cannot carry the family drawn."""
    where: dict[str, set[str]] = {}
    singles = []
    for t, cap in frames:
        objs = objects(cap)
        for colour, shape, pos in objs:
            where.setdefault(f"{colour} {shape}", set()).add(pos)
        if len(objs) == 1:
            singles.append((t, objs[0][0]))
    if rng.random() < 0.5:
        names = [n for n, ps in where.items() if len(ps) == 1]
        if not names:
            return None
        name = rng.choice(names)
        right = next(iter(where[name]))
        options = POSITIONS[:]
        rng.shuffle(options)
        question, family = f"Where in the frame does the {name} appear?", "attribute"
    else:
        times = {t for t, _ in singles}
        clashes = {t for t, cap in frames if t in times and len(objects(cap)) != 1}
        cands = [(t, c) for t, c in singles if t not in clashes]
        if not cands:
            return None
        t, right = rng.choice(cands)
        options = [right] + rng.sample([c for c in colours if c != right], 3)
        rng.shuffle(options)
        question, family = f"What colour is the shape that appears at {int(t) // 60:02d}:{int(t) % 60:02d}?", "timestamp"
    parts = [f"<frame {k} at {t:.1f}s>[{cap}]" for k, (t, cap) in enumerate(frames)]
    letters = "ABCD"
    opts = "\n".join(f"{letters[i]}: {o}" for i, o in enumerate(options))
    text = "".join(parts) + f"\nQuestion: {question}\nOptions:\n{opts}\n<answer>"
    return text, options.index(right), family


def batch(pool, rng, colours, n):
    out = []
    while len(out) < n:
        _, frames = rng.choice(pool)
        d = drill(frames, rng, colours)
        if d:
            out.append(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=Path, default=Path("runs/seed_kinds/weaver/sft_examples_ev360.jsonl"))
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    pool = glances(args.examples)
    held = len(pool) // 6
    train, test = pool[held:], pool[:held]
    colours = sorted({c for _, fr in pool for _, cap in fr for c, _, _ in objects(cap)})
    rng, erng = random.Random(0), random.Random(1)
    evals = batch(test, erng, colours, 400)
    spec = TinySpec(arch="qwen3", hidden_size=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                    corpus="seed_kinds", seed=21)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder = ensure_tiny(spec)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    letter_ids = [tok.encode(c, add_special_tokens=False)[0] for c in "ABCD"]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))

    def logits_at_end(texts):
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
        out = model(**enc).logits[:, -1, :]
        return out[:, letter_ids]

    def accuracy():
        """Held-out drill accuracy, overall and per family."""
        model.eval()
        hits: dict[str, list[int]] = {}
        with torch.no_grad():
            for i in range(0, len(evals), 50):
                chunk = evals[i:i + 50]
                pred = logits_at_end([t for t, _, _ in chunk]).argmax(-1)
                for p, (_, a, fam) in zip(pred.tolist(), chunk):
                    hits.setdefault(fam, []).append(int(p == a))
        model.train()
        acc = {f: round(sum(h) / len(h), 3) for f, h in sorted(hits.items())}
        acc["all"] = round(sum(map(sum, hits.values())) / len(evals), 3)
        return acc

    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "log.jsonl").open("a")
    t0 = time.time()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0:
            row = {"step": step, "dev_drill_acc": accuracy(), "s": round(time.time() - t0, 1)}
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
            log.flush()
        if step == args.steps:
            break
        drills = batch(train, rng, colours, args.batch)
        loss = torch.nn.functional.cross_entropy(logits_at_end([t for t, _, _ in drills]),
                                                 torch.tensor([a for _, a, _ in drills]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 50 == 0:
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "s": round(time.time() - t0, 1)}),
                  flush=True)
    model.save_pretrained(args.out / "model")
    tok.save_pretrained(args.out / "model")


if __name__ == "__main__":
    main()

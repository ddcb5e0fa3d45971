"""Issue #83 item 1: is it layout, forgetting or depth that stops a Weaver student from reading in its own chat?

100 SFT steps from the mini base on Weaver's timestamp answer turns (the rule teacher's, train world), four arms:
  a  the answer turns as the rules write them (prose, then `Read: <chain>`, then <answer>);
  b  chain first: `Read: <chain>.` then <answer>, the prose dropped (each chain token one lookup);
  c  b, plus drills in Weaver's own chat as half of each batch: a real Weaver chat of the train world (any family,
     its system prompt, Task: line and tool turns kept) whose question is rewritten to ask the colour of the shape
     seen at one of its tool frames' times, the target the drill chain with its exact evidence;
  d  b, plus the base's raw timestamp drills (m1/pretrain/drills.py) as half of each batch: rehearsal, the control
     for forgetting.
  e  every turn `m1 sft` would train a Weaver student on, in the rules' layout: the act and answer turns of the
     train world's timestamp questions and of every 4th question of any family (the chats of arm c, unchanged).
Every arm trains as `m1 sft` does for weaver_synth (next-token loss on the target, the evidence attention loss,
lr 2e-3 cosine, warm-up 5) and is measured at steps 0, 50 and 100, teacher-forced, per hop of the chain
(`77 -> 77.0s>[caption] -> white -> A`: clock, frame, colour, letter; a hop is right when all its tokens are):
on the dev world's held-out Weaver answer turns in the rules' layout and chain first, and on raw dev drills.

    python scripts/seed_layout_sft.py --build      # the rule teacher's examples (about 3 minutes)
    python scripts/seed_layout_sft.py --arms a b c d --steps 100 --json runs/r83/seed_layout.json
    python scripts/seed_layout_sft.py --table --json runs/r83/seed_layout.json
    python scripts/seed_layout_sft.py --arms a b --free --eval-at 0 100 --json runs/r83/free.json   # free-running too
    python scripts/seed_layout_sft.py --arms e --free --act --steps 300 --eval-at 0 100 300 --json runs/r83/e.json
`--act` adds the dev act turns, free-running: the tool the teacher called, its whole call, whether one parses, and
whether a trim window holds the time the question names.
`--build` runs weaver_synth's teacher over the timestamp questions of runs/mini/train (seed 1, 120 videos) and
runs/mini/dev (seed 2001, 40 videos), and over every 4th train question of any family (arm c's chats).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from m1.attention_loss import HeadScores, evidence_attention_loss, supervised_layers  # noqa: E402
from m1.evidence import ChatEvidence, chat_token_evidence, token_evidence  # noqa: E402
from m1.marl.config import load_sft_config, scheduled_lr  # noqa: E402
from m1.models.base import text_only  # noqa: E402
from m1.pretrain.drills import DrillSource  # noqa: E402
from m1.synth.world import COLOURS, fmt_time  # noqa: E402

BASE = "assets/mini_base"
LETTERS = "ABCD"


# ------------------------------------------------------------------------------------------ samples
class Sample:
    """Token ids, where the target starts, evidence rows, and the chain's hops as token index ranges."""

    def __init__(self, ids, start, rows, hops):
        self.ids, self.start, self.rows, self.hops = ids, start, rows, hops


def hop_ranges(target: str, chain_at: int, chain_end: int, offsets, first: int) -> list[list[int]]:
    """The token positions (in the whole sample) of each ` -> `-separated hop of the chain at
    target[chain_at:chain_end], leaving out tokens that are only `]` or blanks (as the probe does)."""
    chain = target[chain_at:chain_end]
    out, pos = [], chain_at
    for part in chain.split(" ->"):
        a, b = pos, pos + len(part)
        toks = [first + i for i, (x, y) in enumerate(offsets) if x < b and y > a and target[x:y].strip() not in ("]", "")]
        out.append(toks)
        pos = b + 3
    return out


def chat_sample(tok, messages, completion: str, evidence, eos: int) -> Sample:
    """A chat example as the SFT learner sees it: the chat template's prompt, the reply and an end-of-turn."""
    msgs = text_only(messages)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    reply = tok(completion, add_special_tokens=False, return_offsets_mapping=True)
    rows = chat_token_evidence(text, [m.get("content") or "" for m in msgs], prompt["offset_mapping"], completion,
                               reply["offset_mapping"], evidence, tail=1)
    first = len(prompt["input_ids"])
    hops = []  # an act turn, or an answer turn without a chain, has no hops
    if "Read:" in completion and ".\n<answer>" in completion:
        at = completion.index("Read:") + len("Read:")
        hops = hop_ranges(completion, at, completion.rindex(".\n<answer>"), reply["offset_mapping"], first)
    return Sample(prompt["input_ids"] + reply["input_ids"] + [eos], first, rows, hops)


def drill_sample(tok, drill) -> Sample:
    """A raw drill as `m1 pretrain` encodes it (prompt, then target and a newline)."""
    prompt = tok(drill.prompt, add_special_tokens=False, return_offsets_mapping=True)
    target = tok(drill.target + "\n", add_special_tokens=False, return_offsets_mapping=True)
    shift = len(drill.prompt)
    offsets = list(prompt["offset_mapping"]) + [(a + shift, b + shift) for a, b in target["offset_mapping"]]
    first = len(prompt["input_ids"])
    rows = token_evidence(offsets, drill.evidence, first=first)
    return Sample(prompt["input_ids"] + target["input_ids"], first, rows,
                  hop_ranges(drill.target, 0, len(drill.target), target["offset_mapping"], first))


def chain_first(completion: str, evidence: list[ChatEvidence]) -> tuple[str, list[ChatEvidence]]:
    """`Read: <chain>.\\n<answer>X</answer>`: the rules' prose dropped, the chain's evidence moved with it."""
    at = completion.index("Read:")
    out = completion[at:]
    moved = [ChatEvidence(e.start - at, e.end - at, e.sources, e.copy) for e in evidence if e.start >= at]
    return out, moved


def load_examples(path: str) -> list[dict]:
    rows = [json.loads(line) for line in open(path)]
    for r in rows:
        r["evidence"] = [ChatEvidence(**e) if isinstance(e, dict) else ChatEvidence(*e) for e in r.get("evidence") or []]
    return rows


def timestamp_turns(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["phase"] == "answer" and "Read:" in r["completion"] and ".\n<answer>" in r["completion"]]


# ------------------------------------------------------------------------------------------ drills in the chat
_FRAME = re.compile(r"<frame \d+ at (\d+(?:\.\d+)?)s>\[([^\]]*)\]")
_QUESTION = re.compile(r"\nQuestion: .*?\nTask: [^\n]*", re.S)


def chat_drill(row: dict, rng: random.Random) -> tuple[list[dict], str, list[ChatEvidence]] | None:
    """A Weaver chat of any family with its question rewritten to a timestamp drill on one of its tool frames (a
    frame of one shape, at a whole second no other frame of the chat shares): the messages, the chain target and
    its evidence, in characters of the messages' text_only contents. None when the chat has no such frame."""
    msgs = text_only(row["messages"])
    if len(msgs) < 4 or msgs[-1]["role"] != "user":
        return None
    tool = msgs[-1]["content"]
    frames = [(float(m.group(1)), m.group(2), m) for m in _FRAME.finditer(tool)]
    every = [round(float(m.group(1))) for i in (1, len(msgs) - 1) for m in _FRAME.finditer(msgs[i]["content"])]
    single = [(t, cap, m) for t, cap, m in frames
              if cap.count(";") == 0 and cap != "only the background" and every.count(round(t)) == 1]
    if not single:
        return None
    t, cap, m = rng.choice(single)
    colour = next((c for c in COLOURS if f" {c} " in f" {cap} "), None)
    if colour is None:
        return None
    others = rng.sample([c for c in COLOURS if c != colour], 3)
    options = others + [colour]
    rng.shuffle(options)
    letter = LETTERS[options.index(colour)]
    first = msgs[1]["content"]
    q = _QUESTION.search(first)
    if q is None:
        return None
    clock = fmt_time(t)
    head = (f"\nQuestion: What colour is the shape that appears at {clock}?\nOptions:\n"
            + "".join(f"{L}: {o}\n" for L, o in zip(LETTERS, options))
            + "Task: multiple choice - the answer is the letter of one option")
    new_first = first[:q.start()] + head + first[q.end():]
    msgs = [*msgs[:1], {**msgs[1], "content": new_first}, *msgs[2:]]
    clock_at = q.start() + head.index(clock)
    opt_at = q.start() + head.index(f"{letter}: {colour}") + 3
    marker = m.group(0)  # '<frame k at 77.0s>[caption]'
    quoted = marker[marker.index(" at ") + 3:]  # ' 77.0s>[caption]'
    src = m.start() + marker.index(" at ") + 3
    secs = str(round(t))
    target = f"Read: {secs} ->{quoted} -> {colour} -> {letter}.\n<answer>{letter}</answer>"
    ev, at = [], len("Read: ")
    last = len(msgs) - 1
    ev.append(ChatEvidence(at, at + len(secs), ((1, clock_at, clock_at + len(clock)),)))
    at += len(secs) + len(" ->")
    ev.append(ChatEvidence(at, at + len(quoted), ((last, src, src + len(quoted)),), True))
    at += len(quoted) + len(" -> ")
    ev.append(ChatEvidence(at, at + len(colour), ((1, opt_at, opt_at + len(colour)),), True))
    at += len(colour) + len(" -> ")
    ev.append(ChatEvidence(at, at + 1, ((1, opt_at, opt_at + len(colour)),)))
    a2 = target.index("<answer>") + len("<answer>")
    ev.append(ChatEvidence(a2, a2 + 1, ((1, opt_at, opt_at + len(colour)),)))
    return msgs, target, ev


# ------------------------------------------------------------------------------------------ training
def step(model, opt, batch: list[Sample], att, lr: float, pad: int) -> dict[str, float]:
    width = max(len(s.ids) for s in batch)
    ids = torch.tensor([s.ids + [pad] * (width - len(s.ids)) for s in batch])
    mask = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in batch])
    target = torch.full_like(ids, -100)
    for b, s in enumerate(batch):
        target[b, s.start:len(s.ids)] = ids[b, s.start:len(s.ids)]
    with HeadScores(model, supervised_layers(att)) as heads:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    shown = evidence_attention_loss(heads, att, [s.rows for s in batch], mask)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1), ignore_index=-100)
    loss = nll + (shown.loss if shown else 0)
    for g in opt.param_groups:
        g["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"loss": nll.item(), **({"att": shown.loss.item()} if shown else {})}


@torch.no_grad()
def hop_accuracy(model, samples: list[Sample]) -> list[float]:
    """Per hop: the share of samples whose every token of that hop the model predicts, teacher-forced; and last,
    the whole chain."""
    hits, n = None, 0
    for s in samples:
        pred = model(input_ids=torch.tensor([s.ids])).logits[0].argmax(-1)
        ok = [all(bool(pred[i - 1] == s.ids[i]) for i in toks) for toks in s.hops if toks]
        ok.append(all(ok))
        hits = ok if hits is None else [a + b for a, b in zip(hits, ok)]
        n += 1
    return [round(h / n, 3) for h in hits]


_ANSWER = re.compile(r"<answer>\s*([A-D])\s*</answer>")


@torch.no_grad()
def free_accuracy(model, tok, samples: list[Sample], eos: int) -> list[float]:
    """Free-running from the same prompts (greedy, the student's own tokens fed back): the share of samples whose
    reply names the teacher's letter in `<answer>`, whose whole chain (up to `.` before `<answer>`) is the
    teacher's word for word, and whose reply parses at all."""
    letter = chain = parsed = 0
    for s in samples:
        want = tok.decode(s.ids[s.start:-1])
        out = model.generate(torch.tensor([s.ids[:s.start]]), max_new_tokens=len(s.ids) - s.start + 16,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)
        got = tok.decode(out[0, s.start:], skip_special_tokens=True)
        g, w = _ANSWER.search(got), _ANSWER.search(want)
        parsed += g is not None
        letter += bool(g and w and g.group(1) == w.group(1))
        chain += got.split("\n<answer>")[0].strip() == want.split("\n<answer>")[0].strip()
    n = len(samples)
    return [round(letter / n, 3), round(chain / n, 3), round(parsed / n, 3)]


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def tool_call(text: str) -> dict | None:
    """The JSON object of a reply's `<tool_call>`, or None when there is none or it does not parse."""
    m = _CALL.search(text)
    try:
        got = json.loads(m.group(1)) if m else None
    except json.JSONDecodeError:
        return None
    return got if isinstance(got, dict) else None


_ASKED_AT = re.compile(r"Question: [^\n]*? at (\d+):(\d\d)")


def holds(call: dict | None, at: float | None) -> bool:
    """A trim call whose window holds the moment the question names."""
    try:
        return bool(call and at is not None and call.get("tool_name") == "trim"
                    and float(call.get("start", 0.0)) <= at <= float(call["end"]))
    except (KeyError, TypeError, ValueError):
        return False


@torch.no_grad()
def act_accuracy(model, tok, samples: list[Sample], eos: int) -> list[float]:
    """Free-running act turns from the teacher's prompts (greedy): the share whose tool call names the teacher's
    tool, whose call equals the teacher's in every argument, whose call parses at all, and, of the turns where the
    teacher trims around a stated time, the share whose trim window holds that time."""
    name = exact = parsed = held = timed = 0
    for s in samples:
        want = tool_call(tok.decode(s.ids[s.start:-1]))
        asked = _ASKED_AT.search(tok.decode(s.ids[:s.start]))
        at = int(asked.group(1)) * 60 + int(asked.group(2)) if asked else None
        out = model.generate(torch.tensor([s.ids[:s.start]]), max_new_tokens=len(s.ids) - s.start + 16,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)
        got = tool_call(tok.decode(out[0, s.start:], skip_special_tokens=True))
        parsed += got is not None
        name += bool(got and want and got.get("tool_name") == want.get("tool_name"))
        exact += bool(got and got == want)
        if holds(want, at):
            timed += 1
            held += holds(got, at)
    n = len(samples)
    return [round(name / n, 3), round(exact / n, 3), round(parsed / n, 3), round(held / max(timed, 1), 3)]


def build(out: Path) -> None:
    """The Weaver rule teacher's kept examples: timestamp questions of the train and dev worlds, and every 4th train
    question of any family."""
    from m1.marl.sft import prepare_examples

    out.mkdir(parents=True, exist_ok=True)
    picks = {"weaver_train": ("runs/mini/train", lambda i, r: r["meta"].get("family") == "timestamp"),
             "weaver_dev": ("runs/mini/dev", lambda i, r: r["meta"].get("family") == "timestamp"),
             "weaver_chats": ("runs/mini/train", lambda i, r: i % 4 == 0)}
    for name, (world, keep) in picks.items():
        rows = [json.loads(line) for line in open(f"{world}/questions.jsonl")]
        qfile = out / f"{name}_questions.jsonl"
        qfile.write_text("".join(json.dumps(r) + "\n" for i, r in enumerate(rows) if keep(i, r)))
        cfg = load_sft_config("weaver_synth", [f"data.questions={qfile}", f"data.video_dir={world}",
                                               f"data.examples={out / name}.jsonl", "data.workers=1"])
        prepare_examples(cfg, progress=print)


def table(results: dict) -> str:
    """The results as markdown: one row per arm, seed and step; per layout the hops clock / frame / colour / letter
    and the whole chain."""
    layouts = list(next(iter(results.values()))["evals"]["0"])
    free = ("letter / chain / parses", lambda v: " / ".join(f"{x:.2f}" for x in v))
    act = ("tool / whole call / parses / window holds the time", lambda v: " / ".join(f"{x:.2f}" for x in v))
    hops = ("clock / frame / colour / letter (chain)", lambda v: " / ".join(f"{x:.2f}" for x in v[:-1]) + f" ({v[-1]:.2f})")
    kind = {n: free if n.endswith("free-running") else act if n.startswith("dev act turns") else hops for n in layouts}
    lines = ["| arm | seed | step | " + " | ".join(f"{name}: {kind[name][0]}" for name in layouts)
             + " |", "|---|---|---|" + "---|" * len(layouts)]
    for key, r in results.items():
        arm, seed = key.split("/seed")
        for step_, evals in r["evals"].items():
            cells = [kind[n][1](evals[n]) for n in layouts]
            lines.append(f"| {arm} | {seed} | {step_} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=["a", "b", "c", "d"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-at", type=int, nargs="+", default=[0, 50, 100])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", default="runs/r83/weaver_train.jsonl")
    p.add_argument("--dev", default="runs/r83/weaver_dev.jsonl")
    p.add_argument("--chats", default="runs/r83/weaver_chats.jsonl", help="Weaver examples of every family (arm c)")
    p.add_argument("--drills", type=int, default=50, help="raw dev drills measured")
    p.add_argument("--json", default="runs/r83/seed_layout.json")
    p.add_argument("--free", action="store_true", help="also measure free-running replies on the dev chats (greedy: "
                   "letter right, chain word for word, parses)")
    p.add_argument("--act", action="store_true", help="also measure free-running act turns on the dev chats (greedy: "
                   "the teacher's tool, its whole call, parses)")
    p.add_argument("--save", default=None, help="also write each arm's trained student to SAVE/<arm>_s<seed> (a model "
                   "folder with the base's tokenizer), for its own episodes: m1 infer --team weaver_synth --set "
                   "'models.policy={interface: chat, backend: hf, device: cpu, path: SAVE/<arm>_s<seed>}'")
    p.add_argument("--table", action="store_true", help="print the results in --json as a markdown table and stop")
    p.add_argument("--build", action="store_true", help="write the teacher's examples into runs/r83 and stop")
    args = p.parse_args()
    if args.build:
        torch.set_num_threads(1)
        build(Path("runs/r83"))
        return
    if args.table:
        print(table(json.loads(Path(args.json).read_text())))
        return
    torch.set_num_threads(1)
    att = load_sft_config("weaver_synth").learner.attention
    tok = AutoTokenizer.from_pretrained(BASE)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id
    train_all, dev_all = load_examples(args.train), load_examples(args.dev)
    train, dev = timestamp_turns(train_all), timestamp_turns(dev_all)
    held = {"dev chats, rules' layout": [chat_sample(tok, r["messages"], r["completion"], r["evidence"], eos)
                                         for r in dev],
            "dev chats, chain first": [chat_sample(tok, r["messages"], *chain_first(r["completion"], r["evidence"]),
                                                   eos) for r in dev]}
    acts = [chat_sample(tok, r["messages"], r["completion"], r["evidence"], eos) for r in dev_all if r["phase"] == "act"]
    src = DrillSource("dev", 12345, 120.0)
    held["raw dev drills"] = [drill_sample(tok, src.draw("timestamp", 16, True)) for _ in range(args.drills)]
    results = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {}
    for arm in args.arms:
        key = f"{arm}/seed{args.seed}"
        if key in results:
            continue
        rng = random.Random(f"{arm}/{args.seed}")
        torch.manual_seed(args.seed)
        own = [chat_sample(tok, r["messages"], *((r["completion"], r["evidence"]) if arm == "a" else
                                                 chain_first(r["completion"], r["evidence"])), eos) for r in train]
        if arm == "e":
            own = [chat_sample(tok, r["messages"], r["completion"], r["evidence"], eos)
                   for r in train_all + load_examples(args.chats)]
        extra: list[Sample] = []
        if arm == "c":
            chats = load_examples(args.chats)
            for r in chats:
                got = chat_drill(r, rng)
                if got:
                    extra.append(chat_sample(tok, got[0], got[1], got[2], eos))
        model = AutoModelForCausalLM.from_pretrained(BASE)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        drills = DrillSource("train", 1000 + args.seed, 120.0)
        rows, t0 = {}, time.time()
        for s in range(args.steps + 1):
            if s in args.eval_at:
                model.eval()
                rows[s] = {name: hop_accuracy(model, samples) for name, samples in held.items()}
                if args.free:
                    rows[s].update({f"{name}, free-running": free_accuracy(model, tok, samples, eos)
                                    for name, samples in held.items() if name.startswith("dev chats")})
                if args.act:
                    rows[s]["dev act turns"] = act_accuracy(model, tok, acts, eos)
                print(arm, s, rows[s], flush=True)
                model.train()
            if s == args.steps:
                break
            half = args.batch // 2 if arm in ("c", "d") else 0
            batch = rng.sample(own, args.batch - half)
            if arm == "c":
                batch += rng.sample(extra, half)
            elif arm == "d":
                batch += [drill_sample(tok, drills.draw("timestamp", 16, True)) for _ in range(half)]
            m = step(model, opt, batch, att, scheduled_lr(2e-3, s, args.steps, 5, "cosine"), pad)
            if s % 10 == 0:
                print(arm, "step", s, m, f"{time.time() - t0:.0f}s", flush=True)
        if args.save:
            folder = Path(args.save) / f"{arm}_s{args.seed}"
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
        results[key] = {"evals": rows, "train_turns": len(own), "chat_drills": len(extra),
                        "seconds": round(time.time() - t0, 1)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

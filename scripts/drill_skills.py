"""Does a student still have the mini base's reading skills? Greedy decoding of dev drills (m1/pretrain/drills.py,
steps written, as the base was trained) on each model folder given, graded on the last step. A student fine-tuned
into a seed kind's format may answer a drill in that format (`C</answer>`), so the first line is read up to
`</answer>` before grading.

    python scripts/drill_skills.py assets/mini_base runs/.../checkpoints/step-000300/agents/weaver/model
"""
import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from m1.pretrain.drills import DrillSource
from m1.pretrain.train import grade

FAMILIES = ("clock", "option", "attribute", "timestamp")


def first_answer(generated: str) -> str:
    """The student's first line up to `</answer>`, with the leading space a drill's target starts with."""
    return " " + generated.split("</answer>")[0].split("\n")[0].strip()


def skills(folder: str, tok, drills: dict[str, list], batch: int = 32) -> dict[str, float]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    acc = {}
    for family, items in drills.items():
        hits = 0
        for i in range(0, len(items), batch):
            chunk = items[i:i + batch]
            longest = max(len(tok(d.target)["input_ids"]) for d in chunk) + 2
            enc = tok([d.prompt for d in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=longest, do_sample=False, pad_token_id=tok.pad_token_id)
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            hits += sum(grade(d, first_answer(t)) for d, t in zip(chunk, texts))
        acc[family] = hits / len(items)
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", help="model folders (the base, a trained student's checkpoint)")
    ap.add_argument("--tokenizer", default="assets/mini_base", help="the base's tokenizer (students share it)")
    ap.add_argument("--per-family", type=int, default=64)
    ap.add_argument("--seed", type=int, default=12345)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    source = DrillSource("dev", args.seed, 120.0)
    drills = {f: [source.draw(f, 16, True) for _ in range(args.per_family)] for f in FAMILIES}
    print("| model | " + " | ".join(FAMILIES) + " |")
    print("|---|" + "---|" * len(FAMILIES))
    for folder in args.folders:
        acc = skills(folder, tok, drills)
        print(f"| {folder} | " + " | ".join(f"{100 * acc[f]:.1f}%" for f in FAMILIES) + " |", flush=True)


if __name__ == "__main__":
    main()

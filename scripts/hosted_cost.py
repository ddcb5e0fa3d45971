"""What a question costs the hosted team (configs/team/hosted.yaml), per role, before anyone pays for a server.

The hosted team sends the same prompts as any CPP team; what differs is who answers. This runs the rule-based synth
teacher team (a competent stand-in for the paper's agents: real plans, notes and answers) on M1-Synth questions,
and counts every call as a hosted server would bill it: chat prompts and replies in Qwen-vocabulary tokens
(m1/team/budget.py's estimate, within ~3% of Qwen's tokenizer on these prompts), VLM calls as their text tokens plus
their frames at Qwen2.5-VL's rate for a frame of `--frame-side` pixels (28 x 28 pixels per token after merging).

    python scripts/hosted_cost.py --questions runs/mini/dev/questions.jsonl --videos runs/mini/dev --limit 100
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=Path, required=True)
    ap.add_argument("--videos", type=Path, required=True)
    ap.add_argument("--team", default="synth_teacher")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--frame-side", type=int, default=448, help="pixels per side of a frame as the VLM reads it")
    args = ap.parse_args()

    from m1.config import load_team
    from m1.data.questions import read_questions
    from m1.team.budget import estimate_tokens
    from m1.team.engines_registry import make_team

    qs, issues = read_questions(args.questions, args.videos)
    if issues:
        raise SystemExit(f"{args.questions}: {len(issues)} unreadable questions, e.g. {issues[0]}")
    qs = qs[:args.limit]
    team = make_team(load_team(args.team))
    per_frame = math.ceil(args.frame_side / 28) ** 2
    vision: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for key in {team.cfg.tools.browser, team.cfg.tools.space, team.cfg.tools.grounding} - {None}:
        model = team.hub.vision(key)
        real = model.describe

        def describe(requests, params, real=real, key=key):
            for r in requests:  # what a hosted VLM reads: the prompt's text and every frame
                vision[key]["calls"] += 1
                vision[key]["frames"] += len(r.frames)
                vision[key]["prompt"] += estimate_tokens([{"role": "user", "content": r.prompt}])
            outs = real(requests, params)
            for o in outs:
                vision[key]["completion"] += estimate_tokens([{"role": "assistant", "content": o.text}]) - 12
            return outs

        model.describe = describe
    chat: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ep in team.run(qs):
        for g in ep.generations:
            row = chat[g.agent]
            row["calls"] += 1
            row["prompt"] += estimate_tokens(g.prompt)
            row["completion"] += max(1, estimate_tokens([{"role": "assistant", "content": g.completion}]) - 12)
    n = len(qs)
    print(f"{n} questions of {args.questions}, team {args.team}; per question (Qwen-vocabulary tokens; frames at "
          f"{args.frame_side}x{args.frame_side} = {per_frame} tokens each)\n")
    print("| role | calls | prompt tokens | reply tokens |\n|---|---|---|---|")
    total_in = total_out = 0.0
    for name, row in chat.items():
        print(f"| agent {name} | {row['calls'] / n:.1f} | {row['prompt'] / n:,.0f} | {row['completion'] / n:,.0f} |")
        total_in, total_out = total_in + row["prompt"], total_out + row["completion"]
    for key, row in vision.items():
        prompt = row["prompt"] + row["frames"] * per_frame
        print(f"| VLM {key} | {row['calls'] / n:.1f} | {prompt / n:,.0f} ({row['frames'] / n:.1f} frames) | "
              f"{row['completion'] / n:,.0f} |")
        total_in, total_out = total_in + prompt, total_out + row["completion"]
    print(f"| all | | {total_in / n:,.0f} | {total_out / n:,.0f} |")
    print(json.dumps({"questions": n, "prompt_tokens_per_question": round(total_in / n),
                      "reply_tokens_per_question": round(total_out / n)}))


if __name__ == "__main__":
    main()

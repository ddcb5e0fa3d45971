"""The decisions a team makes, per agent and question family: its first plan and its communicate decisions
(`continue()` or add a tool), greedy and in K sampled runs, and whether adding a tool paid.

For each question: one greedy episode and K episodes sampled at `--temperature` (the MARL rollouts' setting), every
agent reading every other (the complete graph). Per agent and family it reports
- plan: the mean entropy (bits) of the K sampled first plans of a question, their mean number of distinct plans,
  the share of questions whose sampled plans are all the greedy one, and the most common greedy plan;
- communicate: the revision rate (decisions that add a tool) greedy and sampled, the greedy one per round
  (`revision_by_round_greedy`: round -> [revisions, decisions]), and the entropy of a question's K first decisions;
- add-tool: over the questions where some sampled runs of an agent added a tool at its first decision and some
  continued, the agent's accuracy after adding against after continuing.
With `--plans` it measures the plans instead: the team's greedy accuracy per family when every seat's first plan is
replaced by one of the 16 select x browse plans (each seat keeps the key info it wrote, reads the notes and may revise
as usual), beside the team's own plans, and the per-question oracle (right under at least one of the 16).

    python scripts/decision_space.py --team mini_trained --world runs/mini/dev --questions 96 --k 8 \
        --json runs/decision_space/mini_trained.json
    python scripts/decision_space.py --team mini_trained --plans --json runs/decision_space/mini_trained_plans.json
A dev world (seed 2001, as configs/experiments/mini_recipe_dev.yaml makes it) is made when `--world` is absent.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter, defaultdict
from itertools import product
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m1.agents.parsers import parse_decision, parse_plan  # noqa: E402
from m1.config import load_team  # noqa: E402
from m1.data.metrics import is_correct  # noqa: E402
from m1.data.questions import read_questions  # noqa: E402
from m1.models.base import ChatRequest  # noqa: E402
from m1.schema import Topology  # noqa: E402
from m1.team.engines_registry import make_team  # noqa: E402
from m1.tools import BROWSE_TOOLS, SELECT_TOOLS  # noqa: E402


def entropy(counts: Counter) -> float:
    n = sum(counts.values())
    return -sum(c / n * math.log2(c / n) for c in counts.values()) if n else 0.0


def choices(episode, agent: str) -> tuple[str | None, list[str], bool | None]:
    """(the agent's first plan as 'Tool -> Tool', its communicate decisions as 'continue' / 'add Tool', whether its
    own answer was right)."""
    plan, decisions = None, []
    for g in episode.generations:
        if g.agent != agent:
            continue
        if g.phase == "plan" and plan is None:
            plan = " -> ".join(parse_plan(g.completion).plan.tools)
        elif g.phase == "communicate":
            d = parse_decision(g.completion).decision
            decisions.append("continue" if d.action == "continue" else f"add {d.tool}")
    answer = next((a.answer for a in episode.answers if a.agent == agent), None)
    right = None if answer is None else bool(is_correct(episode.question, answer))
    return plan, decisions, right


def family(q) -> str:
    return str(q.meta.get("family") or q.meta.get("task_type") or "all")


def measure(team_name: str, questions, k: int, temperature: float, sets: list[str]) -> dict:
    cfg = load_team(team_name, sets + [f"sampling.temperature={temperature}"])
    agents = [a.name for a in cfg.agents]
    topo = complete(agents)
    greedy_team = make_team(cfg.greedy())
    team = make_team(cfg, hub=greedy_team.hub, pool=greedy_team.pool)
    team.reseed(1234)
    rows: dict[tuple[str, str], dict] = defaultdict(lambda: defaultdict(list))
    for i in range(0, len(questions), 8):
        chunk = questions[i:i + 8]
        greedy = greedy_team.run(chunk, topologies=[topo] * len(chunk))
        sampled = team.run([q for q in chunk for _ in range(k)], topologies=[topo] * (len(chunk) * k))
        for j, q in enumerate(chunk):
            draws = sampled[j * k:(j + 1) * k]
            for agent in agents:
                r = rows[(agent, family(q))]
                g_plan, g_dec, _ = choices(greedy[j], agent)
                s = [choices(e, agent) for e in draws]
                plans = Counter(p for p, _, _ in s if p is not None)
                firsts = Counter(d[0] for _, d, _ in s if d)
                r["plan_entropy"].append(entropy(plans))
                r["plan_distinct"].append(len(plans))
                r["plan_all_greedy"].append(float(set(plans) == {g_plan}))
                r["greedy_plan"].append(g_plan)
                r["dec_entropy"].append(entropy(firsts))
                r["greedy_revisions"] += [d != "continue" for d in g_dec]
                for n, d in enumerate(g_dec):  # per round: is a revision a first-round habit or a later one?
                    r[f"greedy_round_{n + 1}"].append(d != "continue")
                r["sampled_revisions"] += [d != "continue" for _, ds, _ in s for d in ds]
                added = [ok for _, ds, ok in s if ds and ds[0] != "continue" and ok is not None]
                kept = [ok for _, ds, ok in s if ds and ds[0] == "continue" and ok is not None]
                if added and kept:
                    r["add_right"].append(sum(added) / len(added))
                    r["continue_right"].append(sum(kept) / len(kept))
        print(f"{min(i + 8, len(questions))}/{len(questions)} questions", flush=True)
    return {f"{a}|{f}": summarize(r) for (a, f), r in sorted(rows.items())}


def complete(agents: list[str]) -> Topology:
    return Topology(agents=agents, active=agents, edges=[(a, b) for a in agents for b in agents if a != b])


def forced(read_plan, tools: tuple[str, ...]):
    """An agent's plan reader that keeps the key info the agent wrote and replaces its tools with `tools`."""
    def read(text, q):
        parsed = read_plan(text, q)
        parsed.plan = parsed.plan.model_copy(update={"tools": list(tools)})
        return parsed
    return read


def measure_plans(team_name: str, questions, sets: list[str]) -> dict:
    """Per family: the greedy team's accuracy under its own plans and under each of the 16 select x browse plans
    given to every seat, and the oracle (a question is right if one of the 16 gets it right)."""
    team = make_team(load_team(team_name, sets).greedy())
    topo = complete([a.name for a in team.policies])
    own = {a.name: a.read_plan for a in team.policies}
    right: dict[str, dict[str, bool]] = {}  # plan -> question id -> right
    try:
        for plan in [None] + list(product(SELECT_TOOLS, BROWSE_TOOLS)):
            for a in team.policies:
                a.read_plan = own[a.name] if plan is None else forced(own[a.name], plan)
            name = "own plans" if plan is None else " -> ".join(plan)
            episodes = team.run(questions, topologies=[topo] * len(questions))
            right[name] = {e.question.id: bool(is_correct(e.question, e.final_answer)) for e in episodes}
            print(f"{name}: {sum(right[name].values())}/{len(questions)}", flush=True)
    finally:
        for a in team.policies:
            a.read_plan = own[a.name]
    fams = defaultdict(list)
    for q in questions:
        fams[family(q)].append(q.id)
    out = {}
    for fam, ids in sorted(fams.items()):
        acc = {name: sum(r[i] for i in ids) / len(ids) for name, r in right.items()}
        fixed = {k: v for k, v in acc.items() if k != "own plans"}
        best = max(fixed, key=fixed.get)
        out[fam] = {"questions": len(ids), "own": acc["own plans"], "plans": fixed, "best_plan": best,
                    "best": fixed[best], "oracle": sum(any(right[k][i] for k in fixed) for i in ids) / len(ids)}
    return out


def plan_logprobs(chat, gen, plans: list[tuple[str, ...]], temperatures: tuple[float, ...]) -> dict[float, list[float]]:
    """The log-probability, at each sampling temperature, that the policy writes each of `plans` as the tool list of
    its plan reply `gen` (same prompt, same key-info tokens as it generated them, then `##tool use: <A>, <B>` and the
    end of the turn), scored with its logits divided by the temperature."""
    import torch

    done = gen.completion_ids
    k = next(i for i, t in enumerate(done) if "##tool use" in chat.tokenizer.decode(done[:i + 1]))
    prefix = (gen.prompt_ids or chat.tokenizer(chat.render(ChatRequest(gen.prompt)), add_special_tokens=False)
              ["input_ids"]) + done[:k]
    # the reply up to the tool list as the policy generated it: the tool line is scored from the token boundary
    # where it began, which may hold the line's first characters (the newline before `##tool use`)
    lead = chat.tokenizer.decode(done[k:]).split("##tool use")[0]
    end = done[-1] if done[-1] in chat.eos_ids else chat.eos_ids[0]
    rows = [prefix + chat.tokenizer(lead + "##tool use: " + ", ".join(f"<{t}>" for t in plan),
                                    add_special_tokens=False)["input_ids"] + [end] for plan in plans]
    width = max(len(r) for r in rows)
    x = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    with torch.no_grad():
        logits = chat.model(input_ids=x, attention_mask=mask).logits.float()
    out: dict[float, list[float]] = {}
    for t in temperatures:
        lp = torch.log_softmax(logits / t, dim=-1)
        out[t] = [float(sum(lp[j, i - 1, r[i]] for i in range(len(prefix), len(r)))) for j, r in enumerate(rows)]
    return out


def measure_logprobs(team_name: str, questions, sets: list[str], draws: int, temperature: float) -> dict:
    """Per agent and family, from each seat's greedy plan prompt: the policy's probability of each of the 16
    select x browse plans (at temperature 1 and at the rollouts' `temperature`), the greedy plan's, and the chance
    that a plan shows up at all among `draws` independent draws at `temperature` (what a distinct-plan group of K
    rollouts x n draws can offer GRPO)."""
    team = make_team(load_team(team_name, sets).greedy())
    topo = complete([a.name for a in team.policies])
    plans = list(product(SELECT_TOOLS, BROWSE_TOOLS))
    rows: dict[tuple[str, str], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for i in range(0, len(questions), 8):
        chunk = questions[i:i + 8]
        for ep in team.run(chunk, topologies=[topo] * len(chunk)):
            for g in ep.generations:
                if g.phase != "plan" or "##tool use" not in g.completion or not g.completion_ids:
                    continue
                lp = plan_logprobs(team.hub.chat(team.by_name[g.agent].model), g, plans, (1.0, temperature))
                r = rows[(g.agent, family(ep.question))]
                r["greedy"].append(" -> ".join(parse_plan(g.completion).plan.tools))
                for t, vals in lp.items():
                    r[f"p@{t}"].append([math.exp(v) for v in vals])
        print(f"{min(i + 8, len(questions))}/{len(questions)} questions", flush=True)
    out = {}
    for (agent, fam), r in sorted(rows.items()):
        n = len(r["greedy"])
        mean = {t: [sum(col) / n for col in zip(*r[f"p@{t}"])] for t in (1.0, temperature)}
        seen = [sum(1 - (1 - p[j]) ** draws for p in r[f"p@{temperature}"]) / n for j in range(len(plans))]
        out[f"{agent}|{fam}"] = {
            "questions": n, "greedy": Counter(r["greedy"]).most_common(1)[0][0],
            "plans": {" -> ".join(pl): {"p": mean[1.0][j], f"p@{temperature}": mean[temperature][j],
                                        f"in_{draws}_draws": seen[j]} for j, pl in enumerate(plans)},
            "mass_of_16": sum(mean[1.0])}
    return out


def logprobs_table(result: dict, watch: list[str]) -> str:
    """Per agent and family: the greedy plan, the mass the 16 plans hold, and each watched plan's probability
    (temperature 1) and chance of appearing in a group's draws."""
    cols = " | ".join(f"{w}: p / in draws" for w in watch)
    lines = [f"| agent | family | n | greedy plan | mass of the 16 | {cols} |", "|" + "---|" * (5 + len(watch))]
    for key, s in result.items():
        agent, fam = key.split("|")
        cells = []
        for w in watch:
            d = s["plans"][w]
            seen = next(v for k, v in d.items() if k.startswith("in_"))
            cells.append(f"{d['p']:.3g} / {seen:.2f}")
        lines.append(f"| {agent} | {fam} | {s['questions']} | {s['greedy']} | {s['mass_of_16']:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plans_table(result: dict) -> str:
    lines = ["| family | n | own plans | best fixed plan | oracle of the 16 |", "|---|---|---|---|---|"]
    for fam, s in result.items():
        lines.append(f"| {fam} | {s['questions']} | {s['own']:.2f} | {s['best_plan']} ({s['best']:.2f}) "
                     f"| {s['oracle']:.2f} |")
    return "\n".join(lines)


def summarize(r: dict) -> dict:
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    top = Counter(r["greedy_plan"]).most_common(1)
    return {"questions": len(r["plan_entropy"]), "plan_entropy": mean(r["plan_entropy"]),
            "plan_distinct": mean(r["plan_distinct"]), "plan_all_greedy": mean(r["plan_all_greedy"]),
            "greedy_plan": top[0][0] if top else None, "greedy_plan_share": top[0][1] / len(r["greedy_plan"]) if top
            else None, "decision_entropy": mean(r["dec_entropy"]),
            "revision_rate_greedy": mean(r["greedy_revisions"]), "revision_rate_sampled": mean(r["sampled_revisions"]),
            "decisions_greedy": len(r["greedy_revisions"]), "decisions_sampled": len(r["sampled_revisions"]),
            "mixed_questions": len(r["add_right"]), "add_right": mean(r["add_right"]),
            "continue_right": mean(r["continue_right"]),
            "revision_by_round_greedy": {key.rsplit("_", 1)[1]: [sum(v), len(v)] for key, v in sorted(r.items())
                                         if key.startswith("greedy_round_")}}


def table(result: dict) -> str:
    fmt = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = ["| agent | family | n | plan H (bits) | distinct | all greedy | greedy plan (share) | decision H | "
             "revise greedy | revise sampled | mixed | right after add / continue |", "|" + "---|" * 12]
    for key, s in result.items():
        agent, fam = key.split("|")
        lines.append(f"| {agent} | {fam} | {s['questions']} | {fmt(s['plan_entropy'])} | {fmt(s['plan_distinct'], 1)} "
                     f"| {fmt(s['plan_all_greedy'])} | {s['greedy_plan']} ({fmt(s['greedy_plan_share'])}) "
                     f"| {fmt(s['decision_entropy'])} | {fmt(s['revision_rate_greedy'])} of {s['decisions_greedy']} "
                     f"| {fmt(s['revision_rate_sampled'])} of {s['decisions_sampled']} | {s['mixed_questions']} "
                     f"| {fmt(s['add_right'])} / {fmt(s['continue_right'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--team", default="mini_trained")
    p.add_argument("--world", default="runs/mini/dev")
    p.add_argument("--questions", type=int, default=96)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--set", action="append", default=[], help="team override key=value")
    p.add_argument("--plans", action="store_true", help="measure the 16 select x browse plans forced on every seat "
                   "(greedy), instead of the sampled decisions")
    p.add_argument("--logprobs", action="store_true", help="measure the policy's probability of each of the 16 "
                   "plans on its own greedy plan prompts, instead of the sampled decisions")
    p.add_argument("--draws", type=int, default=16, help="--logprobs: the draws a group makes of one agent's plan "
                   "(K rollouts x rollout.distinct_plans)")
    p.add_argument("--families", default="", help="comma-separated families to measure (default: all)")
    p.add_argument("--json")
    args = p.parse_args()
    world = Path(args.world)
    if not (world / "questions.jsonl").is_file():
        from m1.synth.make import make_dataset

        make_dataset(world, 40, 2001, duration=120)
    qs, _ = read_questions(world / "questions.jsonl", world)
    by_family = defaultdict(list)
    for q in qs:
        by_family[family(q)].append(q)
    if args.families:
        by_family = {f: v for f, v in by_family.items() if f in args.families.split(",")}
    picked = []  # the same number of questions of each family, in file order
    while len(picked) < min(args.questions, len(qs)):
        for fam in sorted(by_family):
            if by_family[fam] and len(picked) < args.questions:
                picked.append(by_family[fam].pop(0))
    if args.logprobs:
        result = measure_logprobs(args.team, picked, args.set, args.draws, args.temperature)
        print(logprobs_table(result, ["Global Sampling -> Fine Browser", "Video Retrieval -> Fine Browser"]))
    elif args.plans:
        result = measure_plans(args.team, picked, args.set)
        print(plans_table(result))
    else:
        result = measure(args.team, picked, args.k, args.temperature, args.set)
        print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"team": args.team, "world": str(world), "k": args.k,
                                               "temperature": args.temperature, "rows": result}, indent=1))


if __name__ == "__main__":
    main()

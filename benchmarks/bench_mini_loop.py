"""The mini team's learning loop on the same work, this checkout vs a baseline commit, one torch thread.

SFT: `--sft-steps` steps of configs/sft/mini.yaml as mini_base_recipe runs it (`recipe_sft`: from the mini base,
with the evidence attention loss; `--sft-plain`: the file as it is) on the rule-based teacher's examples for a 20-video
world (built once per side, by that side's code). MARL: `--marl-steps` steps of configs/marl/mini_recipe.yaml with
`rollout.topology=complete`, from the shipped mini weights (assets/mini_team), on the same world. Both come from the
same seeds, so both sides do the same work. Eval: the shipped mini_trained team answers `--eval-questions` questions
of the world, greedily, as `m1 eval` does (both sides must answer the same number right). Each side runs in its own
process: the baseline from a git worktree of `--baseline` (default: the last commit before the sampler work), the
current one from this checkout (benchmarks/tree_worker.py: each side imports its own tree only, and works in its own
runs/ folder, so neither reads what the other's code cached); the sides alternate, `--reps` times, after one untimed
warm-up run per side that fills its on-disk caches (SFT examples, CLIP frame embeddings). A step's seconds and its
parts come from the run's own metrics (time/step, time/rollout, time/update). `--variant NAME=key=value,key=value`
adds a configuration of the current code (e.g. a cheaper estimator) to time beside them.

    python benchmarks/bench_mini_loop.py [--sft-steps 20] [--marl-steps 2] [--reps 3] [--baseline REF]
        [--variant group=grpo.baseline=group] [--sft-set key=value ...] [--sft-plain] [--json out.json]

The figures are ratios of medians measured side by side; the seconds depend on the machine and its load (printed).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, Figure, Result, bench_dir, cli, finish
from tree_worker import AGENTS, tree_command

BASELINE = "070bdb6"  # main before the sampler work: HF generate per phase, no prefix reuse across the K rollouts
WORLD = {"videos": 20, "seed": 1, "duration": 120}
RECIPE = REPO / "configs" / "experiments" / "mini_base_recipe.yaml"  # the experiment the loop serves


def recipe_sft() -> list[str]:
    """The SFT overrides of the recipe (students from the mini base, the evidence attention loss), less its step
    count: the bench sets its own."""
    import yaml

    sets = yaml.safe_load(RECIPE.read_text())["sft"]["overrides"]
    return [s for s in sets if not s.startswith("max_steps=")]


# ------------------------------------------------------------------------------ one side, in its own process
def run_side(tree: Path, workdir: Path, kind: str, steps: int, sets: list[str]) -> list[dict]:
    """`steps` steps of `kind` on the code of `tree` (benchmarks/tree_worker.py: that tree only, never this
    checkout's modules), in `workdir` (that tree's own runs/)."""
    out = tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir / "runs")
    cmd, env = tree_command(sys.executable, tree, kind, steps, out, sets)
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_ROWS ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{kind} run from {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("BENCH_ROWS "):])


# ------------------------------------------------------------------------------ set-up
def baseline_tree(ref: str) -> Path:
    """A worktree of `ref` (kept under the bench cache, reused while it exists)."""
    commit = subprocess.run(["git", "rev-parse", ref], cwd=REPO, capture_output=True, text=True, check=True).stdout
    tree = bench_dir() / f"mini_loop_tree_{commit.strip()[:12]}"
    if not (tree / "m1").is_dir():
        shutil.rmtree(tree, ignore_errors=True)
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), commit.strip()], cwd=REPO,
                       check=True, capture_output=True)
    return tree


def world_dir() -> Path:
    """The 20-video world both sides train on (made once, with this checkout's renderer)."""
    world = bench_dir() / "mini_loop_world"
    if not (world / "questions.jsonl").is_file():
        from m1.synth.make import make_dataset

        make_dataset(world, WORLD["videos"], WORLD["seed"], duration=WORLD["duration"])
    return world


def work_dir(name: str, world: Path) -> Path:
    """runs/ of one side, as the configs expect it: a copy of the world, the shipped weights as SFT output. Each side
    has its own, so what a side caches there (the teacher's SFT examples, CLIP frame embeddings) is written and read
    by its own code only; the untimed warm-up run of each side fills them."""
    d = bench_dir() / f"mini_loop_{name}"
    runs = d / "runs"
    if not (runs / "mini" / "train" / "questions.jsonl").is_file():
        shutil.copytree(world, runs / "mini" / "train", dirs_exist_ok=True)
    for agent in AGENTS:
        dest = runs / "mini" / "sft" / "final" / agent
        if not dest.is_dir():
            shutil.copytree(REPO / "assets" / "mini_team" / agent, dest)
    return d


def per_step(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows)


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=20)
    p.add_argument("--marl-steps", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--baseline", default=BASELINE)
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=key=value,key=value: a MARL configuration of the current code timed beside the two")
    p.add_argument("--sft-set", action="append", default=[],
                   help="key=value for the SFT runs of every side, after the recipe's (`recipe_sft`)")
    p.add_argument("--sft-plain", action="store_true",
                   help="SFT as configs/sft/mini.yaml is (the random mini team, no evidence attention loss)")
    p.add_argument("--eval-questions", type=int, default=100,
                   help="questions the mini_trained team answers in the eval row (greedy, as `m1 eval`)")
    p.add_argument("--only", choices=["sft", "marl", "eval"], help="time one of the three only")
    p.add_argument("--device", help="put the agents' models on this device (e.g. cuda) on every side")
    p.add_argument("--no-baseline", action="store_true",
                   help="time this checkout (and its variants) only, e.g. where git history is absent (a GPU lease)")
    args = p.parse_args()

    if args.device:
        os.environ["M1_BENCH_DEVICE"] = args.device
    world = world_dir()
    sides = {"current": (REPO, [], work_dir("current", world))}
    if not args.no_baseline:
        base = baseline_tree(args.baseline)
        sides["baseline"] = (base, [], work_dir(base.name.removeprefix("mini_loop_tree_"), world))
    for v in args.variant:
        name, _, sets = v.partition("=")
        sides[name] = (REPO, [s for s in sets.split(",") if s], sides["current"][2])
    for _, _, d in sides.values():
        (d / "runs").mkdir(exist_ok=True)
    res = Result("bench_mini_loop.py")
    kinds = [k for k in ("sft", "marl", "eval") if args.only in (None, k)]
    targets = {"sft": 1.5, "marl": 2.5, "eval": 2.0}
    for kind in kinds:
        steps = {"sft": args.sft_steps, "marl": args.marl_steps, "eval": args.eval_questions}[kind]
        both = ([] if args.sft_plain else recipe_sft()) + args.sft_set if kind == "sft" else []  # every side's
        for name in [n for n in ("baseline", "current") if n in sides]:  # fills each side's own caches
            print(f"{kind}: warm-up run of {name}", flush=True)
            run_side(sides[name][0], sides[name][2], kind, 1, both)
        names = list(sides) if kind == "marl" else [n for n in ("baseline", "current") if n in sides]  # variants: MARL
        times: dict[str, list[list[dict]]] = {name: [] for name in names}
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]  # alternate who goes first
            for name in order:
                tree, sets, d = sides[name]
                times[name].append(run_side(tree, d, kind, steps, both + sets))
                print(f"{kind} rep {rep + 1} {name}: {per_step(times[name][-1], 'time/step'):.2f} s "
                      f"for {steps} steps (load {os.getloadavg()[0]:.2f})", flush=True)
        parts = ["time/step", "time/rollout", "time/update"] if kind == "marl" else ["time/step"]
        med = {name: {part: statistics.median(per_step(r, part) for r in runs) / steps for part in parts}
               for name, runs in times.items()}
        for name in names:
            for part in parts:
                res.add(f"{kind} {name} {part} (s per step, median of {args.reps})", med[name][part])
            if kind == "eval":  # greedy answers: the same on every side, or the speed-up is not the same work
                res.add(f"eval {name} correct of {steps}", f"{times[name][-1][0]['correct']}")
            if kind == "marl":
                rows = times[name][-1]
                run = sum(v for r in rows for k, v in r.items() if k.endswith("/samples_run"))
                total = sum(v for r in rows for k, v in r.items() if k.endswith("/samples"))
                if run:
                    res.add(f"marl {name} samples run / built", f"{run:.0f} / {total:.0f}")
        if "baseline" not in med:
            continue
        base = med["baseline"]["time/step"]
        for name in names:
            if name == "baseline":
                continue
            target = f">= {targets[kind]}" if name == "current" else "-"
            ratio = base / med[name]["time/step"]
            what = f"eval, {name} vs {args.baseline} ({steps} questions, s per question" if kind == "eval" else \
                f"{kind} step, {name} vs {args.baseline} ({steps} steps" + (f", sets {both}" if both else "")
            res.figures.append(Figure(
                f"{what}, 1 thread)", f"{base:.2f} s",
                f"{med[name]['time/step']:.2f} s", ratio, "baseline / measured", target,
                (ratio >= targets[kind]) if name == "current" else None,
                " ".join(f"{part.split('/')[1]} {med['baseline'][part]:.2f} -> {med[name][part]:.2f} s"
                         for part in parts[1:]) + (f"; sets {sides[name][1]}" if sides[name][1] else "")))
    finish(res, args.json)


if __name__ == "__main__":
    main()

"""The mini team's learning loop on the same work, this checkout vs a baseline commit, one torch thread.

SFT: `--sft-steps` steps of configs/sft/mini.yaml on a fixed examples file (the rule-based teacher's, built once for
a 20-video world). MARL: `--marl-steps` steps of configs/marl/mini_recipe.yaml with `rollout.topology=complete`,
from the shipped mini weights (assets/mini_team), on the same world. Both come from the same seeds, so both sides do
the same work. Each side runs in its own process: the baseline from a git worktree of `--baseline` (default: the
last commit before the loop's profiling work), the current one from this checkout; the sides alternate, `--reps` times,
after one untimed warm-up run that fills the on-disk caches (CLIP frame embeddings) both sides read. A step's
seconds and its parts come from the run's own metrics (time/step, time/rollout, time/update). `--variant
NAME=key=value,key=value` adds a configuration of the current code (e.g. a cheaper estimator) to time beside them.

    python benchmarks/bench_mini_loop.py [--sft-steps 20] [--marl-steps 2] [--reps 3] [--baseline REF]
        [--variant group=grpo.baseline=group] [--json out.json]

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

BASELINE = "4abe367"  # main before the loop's profiling work: count-based micro-batches in episode order, no caches
AGENTS = ("qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small")
WORLD = {"videos": 20, "seed": 1, "duration": 120}


# ------------------------------------------------------------------------------ one side, in its own process
def worker(kind: str, steps: int, out: str, sets: list[str]) -> None:
    """Train `steps` steps in the current directory's runs/ and print the metrics rows as one JSON line. The code
    comes from M1_BENCH_TREE (_common put this checkout first on sys.path, which would shadow a baseline tree)."""
    tree = os.environ["M1_BENCH_TREE"]
    sys.path[:] = [tree] + [p for p in sys.path if Path(p).resolve() != REPO]
    import m1

    if Path(m1.__file__).resolve().parents[1] != Path(tree).resolve():
        raise RuntimeError(f"bench worker imported {m1.__file__}, not the tree {tree}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    common = [f"out_dir={out}", "log.progress=false", "checkpoint.every=100000"]
    device = os.environ.get("M1_BENCH_DEVICE")  # e.g. cuda: every agent's model (and so its learner) there
    if kind == "sft":
        from m1.marl.config import load_sft_config
        from m1.marl.sft import SFTTrainer

        cfg = load_sft_config("mini", common + [f"max_steps={steps}"] + sets)
    else:
        from m1.marl.config import load_train_config
        from m1.marl.trainer import Trainer

        cfg = load_train_config("mini_recipe", common + [f"steps={steps}", "rollout.topology=complete"] + sets)
    if device:
        cfg.team_overrides = cfg.team_overrides + [f"models.{a}.device={device}" for a in AGENTS]
    trainer = SFTTrainer(cfg) if kind == "sft" else Trainer(cfg)
    try:
        rows = trainer.train()
    finally:
        trainer.close()
    keep = [{k: v for k, v in r.items() if k.startswith("time/") or k.endswith("/samples_run")
             or k.endswith("/samples") or k in ("step", "loss", "reward/mean")} for r in rows]
    print("BENCH_ROWS " + json.dumps(keep), flush=True)


def run_side(tree: Path, workdir: Path, kind: str, steps: int, sets: list[str]) -> list[dict]:
    env = dict(os.environ, M1_BENCH_TREE=str(tree), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    out = tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir / "runs")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--steps", str(steps), "--out", out]
    for s in sets:
        cmd += ["--set", s]
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


def work_dir() -> Path:
    """runs/ as the configs expect it: the 20-video world, the shipped weights as SFT output, the teacher's
    examples for that world (built once with this checkout's code)."""
    d = bench_dir() / "mini_loop"
    runs = d / "runs"
    world = runs / "mini" / "train"
    if not (world / "questions.jsonl").is_file():
        from m1.synth.make import make_dataset

        make_dataset(world, WORLD["videos"], WORLD["seed"], duration=WORLD["duration"])
    for agent in AGENTS:
        dest = runs / "mini" / "sft" / "final" / agent
        if not dest.is_dir():
            shutil.copytree(REPO / "assets" / "mini_team" / agent, dest)
    examples = runs / "mini" / "sft_examples.jsonl"
    if not examples.is_file():
        cwd = os.getcwd()
        os.chdir(d)
        try:
            from m1.marl.config import load_sft_config
            from m1.marl.sft import prepare_examples

            workers = max(1, min(8, (os.cpu_count() or 2) - 1))
            prepare_examples(load_sft_config("mini", [f"data.workers={workers}"]), progress=print)
        finally:
            os.chdir(cwd)
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
    p.add_argument("--only", choices=["sft", "marl"], help="time one loop only")
    p.add_argument("--device", help="put the agents' models on this device (e.g. cuda) on every side")
    p.add_argument("--no-baseline", action="store_true",
                   help="time this checkout (and its variants) only, e.g. where git history is absent (a GPU lease)")
    p.add_argument("--worker", choices=["sft", "marl"], help=argparse_hidden())
    p.add_argument("--steps", type=int, help=argparse_hidden())
    p.add_argument("--out", help=argparse_hidden())
    p.add_argument("--set", action="append", default=[], help=argparse_hidden())
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out, args.set)
        return

    if args.device:
        os.environ["M1_BENCH_DEVICE"] = args.device
    new, d = REPO, work_dir()
    (d / "runs").mkdir(exist_ok=True)
    sides = {"current": (new, [])} if args.no_baseline else {"baseline": (baseline_tree(args.baseline), []),
                                                              "current": (new, [])}
    for v in args.variant:
        name, _, sets = v.partition("=")
        sides[name] = (new, [s for s in sets.split(",") if s])
    res = Result("bench_mini_loop.py")
    kinds = [k for k in ("sft", "marl") if args.only in (None, k)]
    for kind in kinds:
        steps = args.sft_steps if kind == "sft" else args.marl_steps
        print(f"{kind}: warm-up run", flush=True)
        run_side(new, d, kind, 1, [])
        names = list(sides) if kind == "marl" else [n for n in ("baseline", "current") if n in sides]  # variants: MARL
        times: dict[str, list[list[dict]]] = {name: [] for name in names}
        for rep in range(args.reps):
            order = names if rep % 2 == 0 else names[::-1]  # alternate who goes first
            for name in order:
                tree, sets = sides[name]
                times[name].append(run_side(tree, d, kind, steps, sets))
                print(f"{kind} rep {rep + 1} {name}: {per_step(times[name][-1], 'time/step'):.2f} s "
                      f"for {steps} steps (load {os.getloadavg()[0]:.2f})", flush=True)
        parts = ["time/step"] if kind == "sft" else ["time/step", "time/rollout", "time/update"]
        med = {name: {part: statistics.median(per_step(r, part) for r in runs) / steps for part in parts}
               for name, runs in times.items()}
        for name in names:
            for part in parts:
                res.add(f"{kind} {name} {part} (s per step, median of {args.reps})", med[name][part])
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
            target = (">= 1.8" if kind == "sft" else ">= 2.5") if name == "current" else "-"
            ratio = base / med[name]["time/step"]
            res.figures.append(Figure(
                f"{kind} step, {name} vs {args.baseline} ({steps} steps, 1 thread)", f"{base:.2f} s",
                f"{med[name]['time/step']:.2f} s", ratio, "baseline / measured", target,
                (ratio >= (1.8 if kind == "sft" else 2.5)) if name == "current" else None,
                " ".join(f"{part.split('/')[1]} {med['baseline'][part]:.2f} -> {med[name][part]:.2f} s"
                         for part in parts[1:]) + (f"; sets {sides[name][1]}" if sides[name][1] else "")))
    finish(res, args.json)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()

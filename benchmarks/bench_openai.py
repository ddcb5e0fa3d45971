"""A 4-agent episode against a local OpenAI-compatible server that adds 200 ms to every request:
bounded concurrency (8) vs the same calls made one after another (concurrency 1).

The server is a stdlib ThreadingHTTPServer on 127.0.0.1 speaking /v1/chat/completions; it
sleeps, then returns a canned well-formed reply (plan, continue(), answer, or a browser
description). Chat agents and the browser both go through the real OpenAI backend. Two team
layouts are measured:
  * shared: the four agents run on one served model (one batched call per phase);
  * distinct: each agent has its own served model (the paper's heterogeneous team).
ratio = wall time with concurrency 8 / wall time with concurrency 1 (lower is better).

    python benchmarks/bench_openai.py [--delay 0.2] [--episodes 1] [--json out.json]
"""
from __future__ import annotations


from _common import Figure, Result, SlowServer, bench_video, cli, finish, scripted_reply, timed_run

PLAN = "##key info: the colour of the moving square\n##tool use: <Global Sampling>, <Rough Browser>"


def reply(body: dict) -> dict:
    """A canned well-formed chat completion: a browser description for image requests, else the scripted agent."""
    msgs = body.get("messages", [])
    has_images = any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
                     for m in msgs)
    text = ("The frames show a white square moving right. ##Answer: A" if has_images
            else scripted_reply(msgs, PLAN))
    return {"id": "bench", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}}


def team_cfg(url: str, concurrency: int, distinct: bool):
    from m1.config import TeamConfig

    def spec(kind, name):
        return {"kind": kind, "backend": "openai", "path": name, "base_url": url,
                "api_key_env": "M1_BENCH_UNSET_KEY", "concurrency": concurrency, "timeout": 30.0,
                "max_retries": 0}

    names = ["agent_a", "agent_b", "agent_c", "agent_d"]
    models = {f"m{i}": spec("chat", f"served-{i}") for i in range(4 if distinct else 1)}
    models["vlm"] = spec("vision", "served-vlm")
    agents = [{"name": n, "model": f"m{i if distinct else 0}"} for i, n in enumerate(names)]
    return TeamConfig.model_validate({
        "name": "bench-openai", "models": models, "agents": agents,
        "tools": {"browser": "vlm", "global_frames": 16, "rough_frames": 16, "rough_tokens": 64},
        "limits": {"max_turns": 3, "max_tool_calls": 4, "batch_episodes": 16}})


def run_once(server: SlowServer, questions, concurrency: int, distinct: bool, sequential: bool = False):
    """`sequential`: the baseline — one request at a time and one model at a time."""
    from m1.team.cpp import Team
    from m1.video import VideoPool

    cfg = team_cfg(server.url + "/v1", 1 if sequential else concurrency, distinct)
    team = Team(cfg, pool=VideoPool())
    for key, spec in cfg.models.items():  # build the clients before timing, as a server run would
        model = getattr(team.hub, spec.interface)(key)
        if sequential:
            model.remote = False  # the engine then calls the models of a phase one after another
    server.reset()
    wall, eps = timed_run(team, questions)
    return wall, server.requests, server.peak, eps


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--delay", type=float, default=0.2)
    p.add_argument("--episodes", type=int, default=1)
    args = p.parse_args()
    from m1.schema import Question

    video = str(bench_video("openai", seconds=20, fps=4, width=64, height=64)[0])
    questions = [Question(id=f"q{i}", video=video, text="What colour is the moving square?",
                          options=["white", "red", "blue", "green"], task="mcq") for i in range(args.episodes)]
    res = Result("bench_openai.py")
    server = SlowServer(args.delay, reply)
    try:
        run_once(server, questions, 8, True)  # warm-up: imports, client setup, first decode
        res.add("server delay per request", f"{args.delay * 1000:.0f} ms")
        res.add("episodes x agents", f"{len(questions)} x 4")
        for distinct in (False, True):
            layout = "distinct" if distinct else "shared"
            seq = run_once(server, questions, 8, distinct, sequential=True)
            par = run_once(server, questions, 8, distinct)
            for label, (wall, n, peak, eps) in (("sequential", seq), ("engine, concurrency 8", par)):
                llm = sum(e.timings.get("llm", 0.0) for e in eps)
                vis = sum(e.timings.get("vision", 0.0) for e in eps)
                res.add(f"{layout}: {label}", f"{wall:.2f} s wall, {n} requests, peak {peak} in flight; "
                                              f"llm {llm:.2f} s, vision {vis:.2f} s")
            ratio = par[0] / seq[0]
            res.figures.append(Figure(
                figure=f"4-agent episode, OpenAI server +{args.delay * 1000:.0f} ms, "
                       f"{'one model per agent' if distinct else 'agents share one model'}",
                baseline=f"{seq[0]:.2f} s", measured=f"{par[0]:.2f} s", ratio=ratio,
                ratio_def="engine / sequential", target="<= 0.35", met=ratio <= 0.35, note=""))
    finally:
        server.close()
    finish(res, args.json)


if __name__ == "__main__":
    main()

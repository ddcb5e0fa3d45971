"""One training step's generation for 4 agents on rollout engines that add 200 ms to every request: every agent's
engine called at once in each phase (the trainer's way) vs one agent after another.

Each agent talks to its own local stdlib server speaking the vLLM completions API that `EngineChat`
(m1/models/engine.py) uses: token-id prompts in, token ids and log-probs out. A server decodes the prompt with the
agents' tiny tokenizer, sleeps, and answers with a well-formed reply (plan, continue(), answer), so the team runs
every phase. The step is the trainer's: 2 questions x K=4 rollouts = 8 episodes in one batch, the browser the
pixel-reading synth vision model. ratio = wall time concurrent / wall time one agent after another (lower is
better).

    python benchmarks/bench_rollout.py [--delay 0.2] [--questions 2] [--k 4] [--json out.json]
"""
from __future__ import annotations


from _common import Figure, Result, SlowServer, bench_video, cli, finish, scripted_reply, timed_run

PLAN = "##key info: the colour of the moving square\n##tool use: <Global Sampling>, <Rough Browser>"
AGENTS = ["agent_a", "agent_b", "agent_c", "agent_d"]


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


def make_team(engines: dict[str, SlowServer], tokenizer, sequential: bool):
    from m1.config import TeamConfig
    from m1.models.engine import EngineChat
    from m1.team.cpp import Team
    from m1.video import VideoPool

    cfg = TeamConfig.model_validate({
        "name": "bench-rollout",
        "models": {**{f"m_{a}": {"kind": "chat", "backend": "openai", "path": a, "base_url": "http://unused"}
                      for a in AGENTS}, "vlm": {"kind": "vision", "backend": "synth"}},
        "agents": [{"name": a, "model": f"m_{a}"} for a in AGENTS],
        "tools": {"enabled": ["Global Sampling", "Rough Browser"], "browser": "vlm", "global_frames": 8,
                  "rough_frames": 8},
        "limits": {"max_turns": 2, "max_tool_calls": 3, "batch_episodes": 64}})
    team = Team(cfg, pool=VideoPool())
    for a in AGENTS:  # the trainer registers its engines in the hub the same way
        chat = EngineChat(f"m_{a}", engines[a].url, tokenizer, agent=a, served_model="base", timeout=60.0)
        if sequential:
            chat.remote = False  # the team then calls the agents' engines of a phase one after another
        team.hub.register(f"m_{a}", chat, kind="chat")
    return team


def run_once(engines, tokenizer, questions, sequential: bool):
    team = make_team(engines, tokenizer, sequential)
    team.run(questions[:1])  # warm-up: the video decoded, the synth vision ready
    for e in engines.values():
        e.reset()
    wall, eps = timed_run(team, questions)
    return wall, sum(e.requests for e in engines.values()), max(e.peak for e in engines.values()), eps


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--delay", type=float, default=0.2)
    p.add_argument("--questions", type=int, default=2)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    from m1.models.tiny import build_tokenizer
    from m1.schema import Question

    tok = build_tokenizer()
    video = str(bench_video("openai", seconds=20, fps=4, width=64, height=64)[0])
    questions = [Question(id=f"q{i}-{k}", video=video, text="What colour is the moving square?",
                          options=["white", "red", "blue", "green"], task="mcq")
                 for i in range(args.questions) for k in range(args.k)]
    res = Result("bench_rollout.py")
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
    finish(res, args.json)


if __name__ == "__main__":
    main()

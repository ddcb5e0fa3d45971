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

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from _common import Figure, Result, bench_video, cli, finish, scripted_reply

PLAN = "##key info: the colour of the moving square\n##tool use: <Global Sampling>, <Rough Browser>"
AGENTS = ["agent_a", "agent_b", "agent_c", "agent_d"]


class SlowEngine:
    """A completions server that sleeps `delay` per request; counts requests and peak parallelism."""

    def __init__(self, delay: float, tokenizer):
        self.delay, self.tok, self.requests, self.active, self.peak = delay, tokenizer, 0, 0, 0
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send({"object": "list", "data": [{"id": "base", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with engine.lock:
                    engine.requests += 1
                    engine.active += 1
                    engine.peak = max(engine.peak, engine.active)
                try:
                    time.sleep(engine.delay)
                    self._send(engine.reply(body))
                finally:
                    with engine.lock:
                        engine.active -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def reply(self, body: dict) -> dict:
        prompt = [int(x) for x in body["prompt"]]
        text = scripted_reply([{"role": "user", "content": self.tok.decode(prompt)}], PLAN)
        ids = self.tok(text, add_special_tokens=False)["input_ids"][: int(body.get("max_tokens", 256))]
        return {"id": "bench", "object": "text_completion", "model": body.get("model", "base"),
                "choices": [{"index": 0, "text": self.tok.decode(ids), "finish_reason": "stop", "token_ids": ids,
                             "prompt_token_ids": prompt, "logprobs": {"token_logprobs": [-1.0] * len(ids)}}]}

    def reset(self) -> None:
        with self.lock:
            self.requests = self.peak = 0

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def make_team(engines: dict[str, SlowEngine], tokenizer, sequential: bool):
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
    t0 = time.perf_counter()
    eps = team.run(questions)
    wall = time.perf_counter() - t0
    bad = [e.error for e in eps if e.error]
    if bad:
        raise RuntimeError(f"episode failed: {bad[0]}")
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
    engines = {a: SlowEngine(args.delay, tok) for a in AGENTS}
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

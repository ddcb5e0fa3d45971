"""`m1 serve` under load vs `m1 infer` on the same questions, in one process run.

16 client threads (the official openai client, one request at a time each) share 64 M1-Synth questions and send
them to a served `mini_trained` team (uvicorn in this process, each question a `video_url` part plus its lettered
options); the baseline answers the same 64 questions with `run_questions`, the code path of `m1 infer`, on the same
loaded team. Four rounds, infer, serve, serve, infer, each from cold caches, so that a load drifting over the run
weighs on both sides. Reported: p50/p95 request latency, errors, how many answers equal m1 infer's, the batches the
server formed, throughput served / infer (goal >= 1.0), and p95 / p50 of the requests that met a full queue (each
client's after its first; goal <= 1.5).

By default the team's CLIP is a tiny random one (the world's CLIP trains for ~4 CPU minutes on first use; it
changes what Image Retrieval returns, not the serving path); `--synth-clip` uses the shipped config unchanged.

    python benchmarks/bench_serve.py [--clients 16] [--questions 64] [--synth-clip] [--json out.json]

`--soak`: does the server's memory stay flat? `--clients` (default 4) clients send requests for `--minutes`
(default 10; at most `--max-requests`) to 127.0.0.1 only, cycling over the questions, every fourth one sending its
video inline as a `data:` URL (an upload, removed after its answer) and the rest as `file://` URLs. The process's
RSS is sampled every 5 s; reported: RSS at 0, 10, 25, 50, 75 and 100 % of the run (0/60/150/300/450/600 s for 10
minutes), p50/p95 latency, errors, and what the server holds at the end. Target: RSS grows by at most 10 % from the
first minute (or the first tenth of a shorter run) to the end.

    python benchmarks/bench_serve.py --soak [--clients 4] [--minutes 10] [--json out.json]
"""
from __future__ import annotations

import base64
import itertools
import json
import queue
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import Figure, Result, bench_dir, cli, finish

TINY_CLIP = ("models.clip={interface: clip, backend: open_clip, device: cpu, "
             "tiny: {arch: open_clip, hidden_size: 64, layers: 2, image_size: 64, seed: 6}}")


def world(n: int):
    """The first n questions of a cached M1-Synth world (up to 4 per 40-second video)."""
    from m1.data.questions import read_questions
    from m1.synth.make import make_dataset

    videos = n // 4 + 4  # a video may get fewer than 4 questions; the spare videos make up for it
    folder = bench_dir() / f"serve_world_{videos}"
    path = folder / "questions.jsonl"
    if not path.is_file():
        make_dataset(folder, videos=videos, seed=42, duration=40, questions_per_video=4, progress=False)
    qs, issues = read_questions(path, folder)
    assert not issues and len(qs) >= n, (issues, len(qs))
    return folder, qs[:n]


def text_of(q) -> str:
    return q.text + "".join(f"\n{chr(65 + i)}. {o}" for i, o in enumerate(q.options)) + \
        ("\nAnswer with the option's letter from the given choices directly." if q.options else "")


def main() -> None:
    p = cli(__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=None, help="default 16 (--soak: 4)")
    p.add_argument("--questions", type=int, default=64)
    p.add_argument("--synth-clip", action="store_true", help="the team's own CLIP (trained on first use)")
    p.add_argument("--soak", action="store_true", help="memory over a long run (see the module docstring)")
    p.add_argument("--minutes", type=float, default=10.0, help="--soak: how long the clients send requests")
    p.add_argument("--max-requests", type=int, default=100_000, help="--soak: stop after this many requests")
    args = p.parse_args()
    args.clients = args.clients or (4 if args.soak else 16)
    if args.soak:
        return soak(args)

    from m1.config import load_team
    from m1.team.engines_registry import make_team

    folder, qs = world(args.questions)
    cfg = load_team("mini_trained", [] if args.synth_clip else [TINY_CLIP])
    team = make_team(cfg)
    team.run(qs[:2])  # loads the models
    # A B B A: a load that drifts over the run (another job on the machine) weighs on both sides alike
    first = infer_round(cfg, team, qs)
    served = [serve_round(cfg, team, folder, qs, args.clients, first["rows"]) for _ in range(2)]
    last = infer_round(cfg, team, qs)
    infer_s, serve_s = first["wall"] + last["wall"], sum(r["wall"] for r in served)
    latencies = [x for r in served for x in r["latencies"]]
    steady = [x for r in served for x in r["steady"]]
    errors = [e for r in served for e in r["errors"]]
    p50, p95 = percentiles(latencies)
    s50, s95 = percentiles(steady)
    ratio = infer_s / serve_s  # throughput served / throughput of m1 infer, same questions
    res = Result("bench_serve.py")
    res.add("questions, clients", f"{len(qs)}, {args.clients}")
    res.add("m1 infer (run_questions) wall, rounds 1 and 4",
            f"{first['wall']:.2f} s + {last['wall']:.2f} s ({2 * len(qs) / infer_s:.2f} q/s, "
            f"{first['errors'] + last['errors']} errors)")
    res.add("m1 serve wall, rounds 2 and 3", " + ".join(f"{r['wall']:.2f} s" for r in served) +
            f" ({2 * len(qs) / serve_s:.2f} q/s)")
    res.add("latency p50 / p95", f"{p50:.2f} s / {p95:.2f} s")
    res.add("latency p50 / p95 once the queue is full", f"{s50:.2f} s / {s95:.2f} s ({len(steady)} requests: "
            f"each client's after its first; goal p95 <= 1.5 x p50)")
    res.add("errors", str(len(errors)) + (f" (first: {errors[0]})" if errors else ""))
    res.add("answers equal to m1 infer's", " and ".join(f"{r['same']}/{len(qs)}" for r in served) +
            f"; infer's rounds agree on {sum(last['rows'][k]['answer'] == v['answer'] for k, v in first['rows'].items())}")
    res.add("batches formed by the server", str(served[0]["batches"]))
    res.add("CLIP", "the team's own" if args.synth_clip else "tiny random (see --synth-clip)")
    res.figures.append(Figure(
        f"m1 serve, {args.clients} clients x {len(qs)} questions on mini_trained vs m1 infer", f"{infer_s:.2f} s",
        f"{serve_s:.2f} s", ratio, "throughput served / infer", ">= 1.0", ratio >= 1.0 and not errors,
        note=f"p50 {p50:.2f} s, p95 {p95:.2f} s, errors {len(errors)}; rounds infer, serve, serve, infer"))
    res.figures.append(Figure(
        f"m1 serve latency once the queue is full, {args.clients} clients", f"p50 {s50:.2f} s", f"p95 {s95:.2f} s",
        s95 / s50, "p95 / p50", "<= 1.5", s95 <= 1.5 * s50, note=f"{len(steady)} requests"))
    finish(res, args.json)


def infer_round(cfg, team, qs) -> dict:
    """`m1 infer`'s code path (run_questions) over the questions from cold caches: wall, rows by id, errors."""
    from m1.run import run_questions

    cold(team, qs)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = run_questions(cfg, qs, Path(tmp) / "r.jsonl", team=team, progress=False)
        wall = time.perf_counter() - t0
        rows = {json.loads(x)["id"]: json.loads(x) for x in (Path(tmp) / "r.jsonl").read_text().splitlines()}
    return {"wall": wall, "rows": rows, "errors": len(summary.errors)}


def serve_round(cfg, team, folder: Path, qs, clients: int, rows: dict) -> dict:
    """The same questions through a server on the same team from cold caches, `clients` clients sharing them, each
    one request at a time: wall, latencies (all; those that met a full queue), errors, answers equal to `rows`."""
    from openai import OpenAI

    from m1.serve import Limits, create_app

    cold(team, qs)
    app = create_app(team, Limits(allowed_roots=[folder.resolve()], max_queue=4 * clients, timeout_s=600))
    server, th, port = start_server(app)
    todo: queue.Queue = queue.Queue()
    for q in qs:
        todo.put(q)
    out: dict = {"latencies": [], "steady": [], "errors": [], "same": 0}
    lock = threading.Lock()

    def client():
        c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        for sent in itertools.count():
            try:
                q = todo.get_nowait()
            except queue.Empty:
                return
            extra = {} if q.options else {"m1": {"question": q.text, "options": q.options, "task": q.task}}
            t = time.perf_counter()
            try:
                r = c.chat.completions.create(model=cfg.name, messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": Path(q.video).resolve().as_uri()}},
                    {"type": "text", "text": text_of(q)}]}], max_tokens=16, temperature=0.0, extra_body=extra)
                with lock:
                    out["latencies"].append(time.perf_counter() - t)
                    if sent:  # each client's first request rides the ramp; the later ones meet a full queue
                        out["steady"].append(out["latencies"][-1])
                    out["same"] += int(r.choices[0].message.content == rows[q.id]["answer"])
            except Exception as exc:  # counted and reported: the benchmark's error figure
                with lock:
                    out["errors"].append(f"{q.id}: {type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    out["wall"] = time.perf_counter() - t0
    server.should_exit = True
    th.join(30)
    out["batches"] = list(app.state.batcher.batches)
    return out


def cold(team, qs) -> None:
    """Drop every reader, frame and CLIP row of the questions' videos: each side starts from the same caches."""
    for video in {q.video for q in qs}:
        team.forget_video(video)


def percentiles(values: list[float]) -> tuple[float, float]:
    """(p50, p95); NaN for none."""
    if not values:
        return float("nan"), float("nan")
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def start_server(app):
    """uvicorn on 127.0.0.1 (a free port) in a thread of this process; returns (server, thread, port)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    return server, th, port


def soak(args) -> None:
    from openai import OpenAI

    from m1.config import load_team
    from m1.serve import Limits, create_app
    from m1.team.engines_registry import make_team

    clients = args.clients
    folder, qs = world(args.questions)
    cfg = load_team("mini_trained", [] if args.synth_clip else [TINY_CLIP])
    team = make_team(cfg)
    team.run(qs[:2])  # loads the models
    app = create_app(team, Limits(allowed_roots=[folder.resolve()], max_queue=4 * clients, timeout_s=600))
    server, th, port = start_server(app)

    inline = {q.video: "data:video/mp4;base64," + base64.b64encode(Path(q.video).read_bytes()).decode()
              for q in qs}
    counter, lock = itertools.count(), threading.Lock()
    latencies, errors, samples = [], [], []
    duration = args.minutes * 60
    t0 = time.perf_counter()
    deadline = t0 + duration

    def sampler():
        while True:
            samples.append((time.perf_counter() - t0, rss_mb()))
            if time.perf_counter() >= deadline:
                return
            time.sleep(min(5.0, max(0.0, deadline - time.perf_counter())))

    def client():
        c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        while time.perf_counter() < deadline:
            k = next(counter)
            if k >= args.max_requests:
                return
            q = qs[k % len(qs)]
            url = inline[q.video] if k % 4 == 3 else Path(q.video).resolve().as_uri()
            extra = {} if q.options else {"m1": {"question": q.text, "options": q.options, "task": q.task}}
            t = time.perf_counter()
            try:
                c.chat.completions.create(model=cfg.name, messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text_of(q)}]}],
                    max_tokens=16, temperature=0.0, extra_body=extra)
                with lock:
                    latencies.append(time.perf_counter() - t)
            except Exception as exc:  # counted and reported
                with lock:
                    errors.append(f"{q.id}: {type(exc).__name__}: {exc}")

    sampling = threading.Thread(target=sampler, daemon=True)
    sampling.start()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    [c.start() for c in threads]
    [c.join() for c in threads]
    wall = time.perf_counter() - t0
    sampling.join(10)
    samples.append((wall, rss_mb()))
    server.should_exit = True
    th.join(30)

    def at(frac: float) -> tuple[float, float]:
        """The sample nearest to a fraction of the run."""
        return min(samples, key=lambda s: abs(s[0] - frac * duration))

    marks = [at(f) for f in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)]
    first, last = marks[1][1], samples[-1][1]
    growth = last / first - 1
    p50, p95 = percentiles(latencies)
    pool = team.pool
    res = Result("bench_serve.py --soak")
    res.add("clients, minutes", f"{clients}, {args.minutes:g} (wall {wall:.0f} s)")
    res.add("requests (every 4th an inline upload)", f"{len(latencies) + len(errors)} ({len(latencies) / wall:.2f}/s)")
    res.add("RSS MB at " + " / ".join(f"{t:.0f}" for t, _ in marks) + " s", " / ".join(f"{m:.0f}" for _, m in marks))
    res.add("RSS samples (s: MB)", ", ".join(f"{t:.0f}: {m:.0f}" for t, m in samples[::6]))
    res.add("latency p50 / p95", f"{p50:.2f} s / {p95:.2f} s")
    res.add("errors", str(len(errors)) + (f" (first: {errors[0]})" if errors else ""))
    res.add("held at the end", f"{len(app.state.traces)} traces ({app.state.traces.nbytes / 2**20:.1f} MB), "
                               f"{len(pool.readers)} video readers, frame cache {pool.cache.nbytes / 2**20:.0f} MB")
    res.figures.append(Figure(
        f"m1 serve soak, {clients} clients x {args.minutes:g} min on mini_trained: RSS growth after the first "
        f"tenth", f"{first:.0f} MB", f"{last:.0f} MB", growth, "RSS end / RSS at 10 % - 1", "<= 0.10",
        growth <= 0.10 and not errors, note=f"p50 {p50:.2f} s, p95 {p95:.2f} s, {len(latencies)} requests, "
                                           f"errors {len(errors)}"))
    finish(res, args.json)


if __name__ == "__main__":
    main()

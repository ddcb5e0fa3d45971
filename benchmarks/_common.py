"""Shared pieces of the speed benchmarks: machine facts, cached test videos, scripted models,
result records and the printed table.

Every benchmark measures its baseline and its candidate in the same process run and reports
the ratio of the two, so the figure does not depend on how fast the machine happens to be.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/x.py` from anywhere
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class Figure:
    """One README row: `ratio` = measured / baseline or baseline / measured as `ratio_def` says."""

    figure: str
    baseline: str
    measured: str
    ratio: float
    ratio_def: str
    target: str
    met: bool | None  # None: informational row without a target
    note: str = ""


@dataclass
class Result:
    script: str
    figures: list[Figure] = field(default_factory=list)
    rows: list[tuple[str, str]] = field(default_factory=list)  # (what, value) details
    machine: dict = field(default_factory=dict)

    def add(self, what: str, value) -> None:
        self.rows.append((what, value if isinstance(value, str) else _fmt(value)))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def machine_info() -> dict:
    info = {"date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "host_cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(terse=True)}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                               platform.processor() or "unknown")
    except OSError:
        info["cpu"] = platform.processor() or "unknown"
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["usable_cpus"] = os.cpu_count()
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
    except ImportError:
        info["torch"] = "not installed"
    try:
        with open("/proc/loadavg") as f:
            info["load_avg_1m"] = float(f.read().split()[0])
    except OSError:
        pass
    return info


def machine_line(m: dict) -> str:
    return (f"{m.get('date')} | {m.get('cpu')} | {m.get('usable_cpus')} usable CPUs | "
            f"torch {m.get('torch')} (threads {m.get('torch_threads')}, cuda {m.get('cuda')}) | "
            f"Python {m.get('python')} | load {m.get('load_avg_1m')}")


def print_result(res: Result) -> None:
    print(f"\n== {res.script} ==")
    print("machine:", machine_line(res.machine))
    width = max((len(w) for w, _ in res.rows), default=10)
    for what, value in res.rows:
        print(f"  {what:<{width}}  {value}")
    print()
    head = ("figure", "baseline", "measured", "ratio", "target", "met")
    table = [head] + [(f.figure, f.baseline, f.measured, f"{f.ratio:.3g} ({f.ratio_def})", f.target,
                       {True: "yes", False: "NO", None: "-"}[f.met]) for f in res.figures]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for k, row in enumerate(table):
        print("  " + " | ".join(c.ljust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  " + "-+-".join("-" * w for w in widths))
    for f in res.figures:
        if f.note:
            print(f"  note ({f.figure}): {f.note}")


def cli(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", help="also write the result as JSON to this file (used by run_all.py)")
    return p


def finish(res: Result, json_path: str | None) -> None:
    res.machine = machine_info()
    print_result(res)
    if json_path:
        payload = {"script": res.script, "machine": res.machine, "rows": res.rows,
                   "figures": [asdict(f) for f in res.figures]}
        Path(json_path).write_text(json.dumps(payload, indent=2))


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


# ------------------------------------------------------------------------------ videos
def bench_dir() -> Path:
    root = Path(os.environ.get("M1_CACHE") or Path.home() / ".cache" / "m1")
    d = root / "bench"
    d.mkdir(parents=True, exist_ok=True)
    return d


def scene_frames(seconds: float, fps: int, width: int, height: int):
    """Frames of a simple scene: the background colour changes every 10 s, a white square moves
    left to right, a red bar bounces vertically. Cheap to draw (slices only)."""
    n = int(round(seconds * fps))
    sq = max(4, height // 6)
    for i in range(n):
        t = i / fps
        scene = int(t // 10)
        img = np.empty((height, width, 3), np.uint8)
        img[:] = ((scene * 47) % 200 + 20, (scene * 91) % 200 + 20, (scene * 23) % 200 + 20)
        x = int((width - sq) * ((t % 10) / 10))
        img[height // 3: height // 3 + sq, x: x + sq] = 255
        y = int((height - sq) * (0.5 + 0.5 * np.sin(t)))
        img[y: y + sq // 2, width // 8: width // 8 + sq * 2] = (230, 30, 30)
        yield img


def bench_video(name: str, seconds: float, fps: int, width: int, height: int) -> tuple[Path, float | None]:
    """A generated mp4 cached under $M1_CACHE/bench; returns (path, seconds spent generating or
    None when it was already there)."""
    from m1.video import write_video

    path = bench_dir() / f"{name}-{int(seconds)}s-{fps}fps-{width}x{height}.mp4"
    if path.exists() and path.stat().st_size > 0:
        return path, None
    tmp = path.with_suffix(".part.mp4")
    t0 = time.perf_counter()
    write_video(tmp, scene_frames(seconds, fps, width, height), fps, width, height)
    os.replace(tmp, path)
    return path, time.perf_counter() - t0


# ------------------------------------------------------------------------------ scripted models
def text_of(messages) -> str:
    parts = []
    for m in messages:
        c = m["content"]
        parts.append(c if isinstance(c, str) else " ".join(p.get("text", "") for p in c if isinstance(p, dict)))
    return "\n".join(parts)


def scripted_reply(messages, plan: str) -> str:
    """A well-formed agent: the given plan, then continue(), then answer A."""
    text = text_of(messages)
    if "##Final Answer" in text:
        return "##Final Answer: A ##Reason Summary: the agents agreed"
    if "##tool call" in text:
        return "##tool call: continue()"
    if "##Answer" in text:
        return "##Answer: A ##Reason: the browser saw the white square"
    return plan


class ScriptedChat:
    """A chat model that answers from a script at no cost (for counting frames, not timing LLMs)."""

    def __init__(self, name: str, plan: str):
        self.name, self.plan, self.requests = name, plan, 0

    def generate(self, requests, params):
        from m1.models.base import Completion

        self.requests += len(requests)
        return [Completion(text=scripted_reply(r.messages, self.plan)) for r in requests]


class CannedVision:
    def __init__(self, name: str = "browser"):
        self.name, self.requests = name, 0

    def describe(self, requests, params):
        from m1.models.base import Completion

        self.requests += len(requests)
        return [Completion(text=f"{len(r.frames)} frames from {r.timestamps[0]:.1f}s: a white square "
                                "moves right. ##Answer: A") for r in requests]


class SlowServer:
    """A local stdlib HTTP server that sleeps `delay` seconds per POST, then answers `reply(body)` as JSON (GET:
    `get()`); counts requests and the peak number in flight. The latency every remote-model benchmark adds."""

    def __init__(self, delay: float, reply, get=None):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.delay, self.reply, self.get = delay, reply, get
        self.requests = self.active = self.peak = 0
        self.lock = threading.Lock()
        server = self

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
                self._send(server.get() if server.get else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with server.lock:
                    server.requests += 1
                    server.active += 1
                    server.peak = max(server.peak, server.active)
                try:
                    time.sleep(server.delay)
                    self._send(server.reply(body))
                finally:
                    with server.lock:
                        server.active -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def reset(self) -> None:
        with self.lock:
            self.requests = self.peak = 0

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def timed_run(team, questions) -> tuple[float, list]:
    """Wall seconds of `team.run(questions)` and its episodes; a failed episode fails the benchmark."""
    t0 = time.perf_counter()
    eps = team.run(questions)
    wall = time.perf_counter() - t0
    bad = [e.error for e in eps if e.error]
    if bad:
        raise RuntimeError(f"episode failed: {bad[0]}")
    return wall, eps

"""Does `m1 serve` let go of files? A soak over many distinct `file://` videos under a low `ulimit -n`.

`m1 serve` runs as its own process (the command a user runs) with its file limit lowered to `--nofile`, serving
`--team` (default `synth_teacher` with a tiny CLIP, which needs no training; issue 74 used `--team mini_trained`) with
`limits.max_open_videos` set to `--max-open`. `--clients` client threads in this process ask about `--videos`
distinct small videos (made once under `--folder`), cycling over them, for `--seconds`. Every `--every` seconds the
server's RSS and open files (/proc/PID/fd) are sampled. Reported: the samples, requests, errors (any status but
200), and the growth of RSS and open files from the first sample at or after one minute (or a tenth of a shorter
run) to the end. Issue 74's bar: 10 minutes over 200 videos, both flat within 10 % after the first minute, no errors.

    python benchmarks/serve_soak.py [--videos 200] [--seconds 600] [--nofile 64] [--max-open 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_CLIP = ["models.clip.clip_name=null", "models.clip.tiny={arch: open_clip}"]


def make_videos(folder: Path, n: int) -> list[Path]:
    """n short videos of distinct content (each its own colour steps), made once and reused."""
    import numpy as np

    from m1.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(n):
        path = folder / f"soak_{k:04d}.mp4"
        if not path.is_file():
            def frames(k=k):
                for i in range(12):
                    img = np.zeros((64, 64, 3), np.uint8)
                    img[:] = ((k * 37 + i * 20) % 256, (k * 91) % 256, (k * 53 + (i // 4) * 60) % 256)
                    img[16:32, 16:32] = 255
                    yield img
            tmp = path.with_suffix(".part.mp4")
            write_video(tmp, frames(), 4, 64, 64)
            tmp.replace(path)
        out.append(path)
    return out


def sample(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    return {"rss_mb": round(rss, 1), "open_files": len(os.listdir(f"/proc/{pid}/fd"))}


def ask(port: int, model: str, video: Path, timeout: float) -> int:
    body = {"model": model, "max_tokens": 16, "temperature": 0.0, "media_io_kwargs": {"video": {"num_frames": 8}},
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video.as_uri()}},
                                                       {"type": "text", "text": "What happens in the video?"}]}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def growth(samples: list[dict], after: float, key: str) -> float:
    """Relative change of `key` from the first sample at or after `after` seconds to the last one."""
    base = next((s for s in samples if s["t"] >= after), samples[0])
    return (samples[-1][key] - base[key]) / max(base[key], 1e-9)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--videos", type=int, default=200)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--nofile", type=int, default=64, help="the server's `ulimit -n`")
    p.add_argument("--max-open", type=int, default=16, help="limits.max_open_videos")
    p.add_argument("--every", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--team", default="synth_teacher")
    p.add_argument("--set", action="append", default=None, help="more config overrides (default: a tiny CLIP)")
    p.add_argument("--folder", type=Path, default=None, help="where the videos are made (default: under M1_CACHE)")
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args()

    cache = Path(os.environ.get("M1_CACHE") or Path.home() / ".cache" / "m1")
    folder = (args.folder or cache / "bench" / f"soak_{args.videos}").resolve()
    videos = make_videos(folder, args.videos)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = [*(TINY_CLIP if args.set is None else args.set), f"limits.max_open_videos={args.max_open}"]
    cmd = [sys.executable, "-m", "m1", "serve", "--team", args.team, "--port", str(port),
           "--allowed-media-root", str(folder), *itertools.chain.from_iterable(("--set", o) for o in overrides)]

    def low_limit():
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))

    log = open(folder / "serve.log", "w")
    tmp = folder / "tmp"  # the server's own TMPDIR: what it leaves behind is counted there
    tmp.mkdir(exist_ok=True)
    server = subprocess.Popen(cmd, preexec_fn=low_limit, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "TMPDIR": str(tmp)})
    try:
        for _ in range(1200):  # the models load first
            if server.poll() is not None:
                raise SystemExit(f"m1 serve exited with {server.returncode}; see {folder / 'serve.log'}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        statuses: dict[int, int] = {}
        counter, lock = itertools.count(), threading.Lock()
        t0 = time.monotonic()
        deadline = t0 + args.seconds
        samples = [{"t": 0.0, "requests": 0, **sample(server.pid)}]

        def client():
            while time.monotonic() < deadline:
                k = next(counter)
                status = ask(port, model, videos[k % len(videos)], timeout=600)
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1

        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
        for th in threads:
            th.start()
        while time.monotonic() < deadline:
            time.sleep(min(args.every, max(0.0, deadline - time.monotonic())))
            with lock:
                done = sum(statuses.values())
            samples.append({"t": round(time.monotonic() - t0, 1), "requests": done, **sample(server.pid)})
            print(f"{samples[-1]['t']:7.1f} s  {done:6d} requests  RSS {samples[-1]['rss_mb']:8.1f} MB  "
                  f"open files {samples[-1]['open_files']:4d}", flush=True)
        for th in threads:
            th.join()
        samples.append({"t": round(time.monotonic() - t0, 1), "requests": sum(statuses.values()),
                        **sample(server.pid)})
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    after = min(60.0, args.seconds / 10)
    errors = sum(n for status, n in statuses.items() if status != 200)
    report = {"videos": args.videos, "seconds": args.seconds, "clients": args.clients, "nofile": args.nofile,
              "max_open_videos": args.max_open, "team": args.team, "requests": sum(statuses.values()),
              "statuses": {str(k): v for k, v in sorted(statuses.items())}, "errors": errors, "samples": samples,
              "rss_growth": round(growth(samples, after, "rss_mb"), 4),
              "open_files_growth": round(growth(samples, after, "open_files"), 4),
              "leftover_temp_folders": len(list(tmp.glob("m1-serve-*")))}
    print(f"{report['requests']} requests, {errors} errors (statuses {report['statuses']}); after {after:g} s: RSS "
          f"{report['rss_growth']:+.1%}, open files {report['open_files_growth']:+.1%}; "
          f"m1-serve-* folders left: {report['leftover_temp_folders']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if errors == 0 and not report["leftover_temp_folders"] else 1


if __name__ == "__main__":
    sys.exit(main())

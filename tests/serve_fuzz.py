"""Fuzz `m1 serve` with what careless or hostile clients send: random JSON, wrong types, over-long prompts, questions
that fail validation, truncated bodies, clients that hang up mid-body and, with `big`, 10-60 MB bodies and bodies
over the limit. Every reply must be a 4xx (or a 200 for the few valid questions), never a 5xx; a server that runs
with a prompt budget (`limits.max_prompt_tokens`) must name it in the 400 of an over-long prompt.

tests/serve/test_serve.py runs a few hundred bodies against a server in the test process. By hand, it starts `m1 serve`
as a process of its own, so that the peak memory it reports (VmHWM) is the server's alone (docs/serving.md):

    HF_HUB_OFFLINE=1 .venv/bin/python tests/serve_fuzz.py --bodies 2000 --big
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import string
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TEAM = "synth_teacher"
BUDGET = 4000
# the world's CLIP trains for minutes: a tiny random one; a prompt budget, so over-long prompts meet a limit
SETS = ["models.clip.clip_name=null", "models.clip.tiny={arch: open_clip}", f"limits.max_prompt_tokens={BUDGET}"]
MAX_TEXT = 1 << 20  # the server's default --max-text-kb 1024
MAX_BODY = 64 << 20  # the server's default --max-body-mb 64
JUNK = [None, 0, -1, 1.5, True, "", "x" * 50, [], {}, [1, 2], {"a": 1}, "\x00", "💥", 10 ** 30, ["text"], -1e308]


def post(port: int, body: bytes, length: int | None = None, hang_up: bool = False,
         timeout: float = 300) -> tuple[int | None, str]:
    """(status, reply) of POST /v1/chat/completions over a raw socket. `length`: the Content-Length claimed (default
    len(body)); `hang_up`: close the socket once `body` is sent, without reading (a client gone mid-body): (None, "").
    A server that answers a body over its limit before reading it may reset the connection while the rest is sent:
    its answer is still read when it came, else (None, "reset")."""
    length = len(body) if length is None else length
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(head)
            view = memoryview(body)
            for i in range(0, len(view), 1 << 20):
                s.sendall(view[i:i + (1 << 20)])
        except (BrokenPipeError, ConnectionResetError):
            pass
        if hang_up:
            return None, ""
        data = b""
        try:
            while chunk := s.recv(1 << 16):
                data += chunk
        except ConnectionResetError:
            if not data:
                return None, "reset"
    head, _, reply = data.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), reply.decode("utf-8", "replace")
    except (IndexError, ValueError):
        return None, data[:200].decode("utf-8", "replace")


def health(port: int) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    return json.loads(data.partition(b"\r\n\r\n")[2])


def _random_json(rng: random.Random, depth: int = 0):
    k = rng.randrange(7 if depth < 4 else 4)
    if k == 0:
        return rng.choice(JUNK)
    if k == 1:
        return "".join(rng.choice(string.printable + "éß💥\x00") for _ in range(rng.randrange(40)))
    if k == 2:
        return rng.uniform(-1e9, 1e9)
    if k == 3:
        return rng.randrange(-10 ** 6, 10 ** 6)
    if k in (4, 5):
        keys = ["model", "messages", "m1", "role", "content", "type", "text", "video_url", "url", "stream", "n", "x"]
        return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}
    return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]


def _good(video: str, text: str = "What colour is the square?\nA. red\nB. green\nC. blue", **extra) -> dict:
    return {"model": TEAM, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video}}, {"type": "text", "text": text}]}], **extra}


def _words(rng: random.Random, chars: int) -> str:
    words = ["red", "square", "left", "of", "the", "blue", "circle", "moves", "when", "at", "00:12", "which", "first"]
    out, n = [], 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def bodies(rng: random.Random, video: str, n: int, big: bool = False):
    """`n` cases (kind, body bytes, post() keywords, statuses allowed, words the reply must hold)."""
    small = ["random_json", "wrong_type", "bad_url", "random_bytes", "truncated", "hang_up", "invalid_question",
             "over_long", "over_text_limit", "lying_length"]
    for i in range(n):
        kind = "valid" if i % 50 == 0 else ("big" if big and i % 100 == 7 else rng.choice(small))
        if kind == "valid":
            yield kind, json.dumps(_good(video)).encode(), {}, {200}, []
        elif kind == "random_json":
            yield kind, json.dumps(_random_json(rng)).encode(), {}, {400, 404}, []
        elif kind == "wrong_type":
            b = _good(video)
            where = rng.randrange(4)
            if where == 0:
                key = rng.choice(["messages", "model", "stream", "n", "m1", "max_tokens", "temperature"])
                b[key] = rng.choice(JUNK)
            elif where == 1:
                b["messages"][0][rng.choice(["role", "content"])] = rng.choice(JUNK)
            elif where == 2:
                b["messages"][0]["content"][rng.randrange(2)][rng.choice(["type", "video_url", "text"])] = \
                    rng.choice(JUNK)
            else:
                b["m1"] = {rng.choice(["question", "options", "task", "id"]): rng.choice(JUNK)}
            # a wrong type can still leave a valid request (e.g. max_tokens=1): 200 is allowed, 5xx never
            yield kind, json.dumps(b).encode(), {}, {200, 400, 404}, []
        elif kind == "bad_url":
            url = rng.choice(["http://[::1", "file://[x/v.mp4", "data:video/mp4;base64,%%%", "data:", "file://",
                              "file:///", "ftp://x/y.mp4", "\\\\server\\share", "file:///%00", "/" * 300,
                              "file:///proc/self/environ", "file:///" + "a" * 5000 + ".mp4", "data:video/mp4;base64,"])
            yield kind, json.dumps(_good(url)).encode(), {}, {400}, []
        elif kind == "random_bytes":
            yield kind, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), {}, {400}, []
        elif kind == "truncated":  # a valid body cut short, its Content-Length telling the truth
            raw = json.dumps(_good(video)).encode()
            yield kind, raw[:rng.randrange(1, len(raw))], {}, {400}, ["not valid JSON"]
        elif kind == "hang_up":  # Content-Length claims more than is sent, then the client is gone
            raw = json.dumps(_good(video)).encode()
            yield kind, raw[:rng.randrange(0, len(raw))], {"length": len(raw) + 1000, "hang_up": True}, {None}, []
        elif kind == "invalid_question":
            m1 = rng.choice([{"options": ["only one"], "task": "mcq"}, {"options": [""] * 3},
                             {"options": [str(k) for k in range(27)]}, {"task": "essay"}, {"question": ""},
                             {"task": "mcq", "options": []}])
            yield kind, json.dumps(_good(video, m1=m1)).encode(), {}, {400}, []
        elif kind == "over_long":  # under the text limit, over the prompt budget: the team refuses it alone
            text = _words(rng, rng.randrange(25_000, 200_000)) + "\nA. yes\nB. no"
            yield kind, json.dumps(_good(video, text)).encode(), {}, {400}, ["prompt too long", "tokens"]
        elif kind == "over_text_limit":
            text = _words(rng, MAX_TEXT + rng.randrange(1, 200_000))
            yield kind, json.dumps(_good(video, text)).encode(), {}, {413}, ["--max-text-kb"]
        elif kind == "lying_length":  # claims a body over the limit: refused from the headers alone
            yield kind, b"{}", {"length": MAX_BODY + rng.randrange(1, 10 ** 9), "hang_up": False}, {413, None}, []
        else:  # 10-60 MB: a question text, a junk data: video, or a body over the limit sent whole
            size = rng.randrange(10, 61) << 20
            which = rng.randrange(3)
            if which == 0:
                yield "big_text", json.dumps(_good(video, "x " * (size // 2))).encode(), {}, {413}, []
            elif which == 1:
                junk = "A" * (size - size % 4)
                yield "big_video", json.dumps(_good("data:video/mp4;base64," + junk)).encode(), {}, {400, 413}, []
            else:
                yield "big_over_limit", b"{" + b" " * (MAX_BODY + size), {}, {413, None}, []


def fuzz(port: int, video: str, n: int, seed: int = 0, big: bool = False, progress=None) -> dict:
    """Send `n` bodies; {"statuses": {kind: {status: count}}, "failures": [...], "seconds": s}."""
    rng = random.Random(seed)
    statuses: dict[str, Counter] = {}
    failures = []
    t0 = time.perf_counter()
    for i, (kind, body, kw, allowed, words) in enumerate(bodies(rng, video, n, big)):
        status, reply = post(port, body, **kw)
        statuses.setdefault(kind, Counter())[str(status)] += 1
        ok = status in allowed and all(w in reply for w in words) and "Traceback" not in reply
        if status is not None and status >= 500 or not ok:
            failures.append({"i": i, "kind": kind, "status": status, "reply": reply[:300], "body": body[:200].decode(
                "utf-8", "replace")})
        if progress and i % 100 == 99:
            progress(f"{i + 1}/{n} bodies, {len(failures)} failures, {time.perf_counter() - t0:.0f} s")
    return {"statuses": {k: dict(v) for k, v in sorted(statuses.items())}, "failures": failures,
            "seconds": round(time.perf_counter() - t0, 1), "health": health(port)}


def memory_kb(pid: int) -> dict:
    """VmHWM (peak resident) and VmRSS of a process, in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            out[line.split(":")[0]] = int(line.split()[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bodies", type=int, default=2000)
    ap.add_argument("--big", action="store_true", help="also 10-60 MB bodies and bodies over the 64 MB limit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=None, help="the server's log (default: a temporary file)")
    args = ap.parse_args()
    from m1.synth.make import make_dataset

    work = Path(tempfile.mkdtemp(prefix="m1-fuzz-"))
    qpath = make_dataset(work / "world", videos=1, seed=7, duration=40, questions_per_video=1, progress=False)
    video = json.loads(qpath.read_text().splitlines()[0])["video"]
    video = (work / "world" / video).resolve() if not Path(video).is_absolute() else Path(video).resolve()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = args.log or work / "serve.log"
    cmd = [sys.executable, "-m", "m1", "serve", "--team", TEAM, "--port", str(port), "--allowed-media-root",
           str(work / "world"), *sum((["--set", o] for o in SETS), [])]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        for _ in range(1200):
            try:
                health(port)
                break
            except (OSError, ValueError):
                time.sleep(0.1)
        else:
            print(log.read_text(), file=sys.stderr)
            return 2
        start = memory_kb(proc.pid)
        result = fuzz(port, video.as_uri(), args.bodies, args.seed, args.big,
                      progress=lambda m: print(m, file=sys.stderr, flush=True))
        result["memory_kb"] = {"at_start": start, "at_end": memory_kb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(120)
    text = log.read_text(errors="replace")
    result["log"] = {"tracebacks": text.count("Traceback"), "internal_errors": text.count("internal error"),
                     "hang_up_lines": text.count("hung up after"), "5xx_lines": sum(
                         1 for ln in text.splitlines() if '" 5' in ln and "HTTP/1.1" in ln)}
    result["command"] = " ".join(cmd)
    print(json.dumps(result, indent=1))
    bad = result["failures"] or result["log"]["tracebacks"] or result["log"]["internal_errors"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

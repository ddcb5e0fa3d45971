"""OpenAI-compatible backend against a scripted local server, and end to end against
`transformers serve` running a tiny random Qwen2 on 127.0.0.1."""
from __future__ import annotations

import base64
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from m1.config import ModelSpec, TinySpec
from m1.models.base import ChatRequest, Completion, ModelError, SamplingParams, VisionRequest, mix_seed
from m1.models.openai import OpenAIChatModel, OpenAIVisionModel, parse_retry_after

KEY_ENV = "M1_TEST_OPENAI_KEY"
SECRET = "sk-test-0123456789abcdef-SECRET"


# ---------------------------------------------------------------------------------------------
# A scripted /v1/chat/completions server
# ---------------------------------------------------------------------------------------------
class _BadMedia(Exception):
    """A video_url the stand-in refuses, answered with HTTP 400 as vLLM does."""


class FakeServer:
    """Answers chat completions; `script` gives per-attempt behaviour before normal answers.

    A script step is ("hang",), or (status, headers, message). `per_request` (optional) maps the
    JSON body to such a step, for behaviour that depends on the request instead of its order.
    `video_url` parts are decoded like vLLM does: a `data:video/mp4;base64,` URL, or a `file://` path
    only under `media_root` (vLLM's --allowed-local-media-path); anything else is a 400.
    GET /models lists `served`; with `key` set, a request whose bearer token differs gets a 401.
    """

    def __init__(self, script=(), delay: float = 0.0, per_request=None, logprobs=True, media_root=None,
                 served=("served-model",), key=None):
        self.served = list(served)
        self.key = key
        self.media_root = Path(media_root).resolve() if media_root is not None else None
        self.videos: list[dict] = []  # what each decoded video_url part held
        self.script = list(script)
        self.delay = delay
        self.per_request = per_request
        self.logprobs = logprobs
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()
        self.release = threading.Event()  # lets hanging handlers go at teardown
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _key_rejected(self) -> bool:
                if fake.key is None or self.headers.get("Authorization") == f"Bearer {fake.key}":
                    return False
                self._send(401, {"error": {"message": "Incorrect API key provided", "type": "auth"}}, {})
                return True

            def do_GET(self):
                if self._key_rejected():
                    return
                if self.path.rstrip("/").endswith("/models"):
                    data = [{"id": m, "object": "model", "created": 0, "owned_by": "test"} for m in fake.served]
                    self._send(200, {"object": "list", "data": data}, {})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}}, {})

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                if self._key_rejected():
                    return
                with fake.lock:
                    fake.bodies.append(body)
                    fake.auth.append(self.headers.get("Authorization"))
                    step = fake.script.pop(0) if fake.script else None
                    fake.active += 1
                    fake.max_active = max(fake.max_active, fake.active)
                try:
                    if step is None and fake.per_request is not None:
                        step = fake.per_request(body)
                    if step is not None and step[0] == "hang":
                        fake.release.wait(10.0)
                        return
                    if step is not None:
                        status, headers, message = step
                        self._send(status, {"error": {"message": message, "type": "test_error"}},
                                   headers)
                        return
                    time.sleep(fake.delay)
                    try:
                        payload = fake.answer(body)
                    except _BadMedia as exc:
                        self._send(400, {"error": {"message": str(exc), "type": "BadRequestError"}}, {})
                        return
                    self._send(200, payload, {})
                finally:
                    with fake.lock:
                        fake.active -= 1

            def _send(self, status, payload, headers):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, body: dict) -> dict:
        last = body["messages"][-1]["content"]
        if isinstance(last, str):
            reply = f"echo:{last}"
        elif any(p["type"] == "video_url" for p in last):
            reply = json.dumps([self.read_video(p["video_url"]["url"])
                                for p in last if p["type"] == "video_url"])
        else:
            n_img = sum(1 for p in last if p["type"] == "image_url")
            reply = f"images:{n_img}"
        choice = {"index": 0, "message": {"role": "assistant", "content": reply},
                  "finish_reason": "length"}
        if body.get("logprobs") and self.logprobs:
            choice["logprobs"] = {"content": [
                {"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": []},
                {"token": "b", "logprob": -1.5, "bytes": [98], "top_logprobs": []}]}
        return {"id": "cmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}

    def read_video(self, url: str) -> dict:
        """Decode one video_url: frame count, declared rate, each frame's time and mean RGB."""
        import av

        if url.startswith("data:video/mp4;base64,"):
            source = io.BytesIO(base64.b64decode(url.split(",", 1)[1]))
        elif url.startswith("file://"):
            path = Path(urllib.request.url2pathname(url[len("file://"):])).resolve()
            if self.media_root is None or not path.is_relative_to(self.media_root):
                raise _BadMedia(f"Cannot load local files without --allowed-local-media-path "
                                f"covering {path}")
            if not path.is_file():
                raise _BadMedia(f"no such file: {path}")
            source = str(path)
        else:
            raise _BadMedia(f"unsupported video URL: {url[:40]}")
        with av.open(source) as container:
            stream = container.streams.video[0]
            frames = list(container.decode(stream))
            info = {"frames": len(frames), "fps": str(stream.guessed_rate),  # what OpenCV reads
                    "times": [round(float(f.time), 4) for f in frames],
                    "size": [stream.height, stream.width],
                    "means": [f.to_ndarray(format="rgb24").reshape(-1, 3).mean(0).round(1).tolist()
                              for f in frames]}
        with self.lock:
            self.videos.append({"url": url[:40], **info})
        return info

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(**kw) -> FakeServer:
        s = FakeServer(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    return KEY_ENV


def spec(url, **kw) -> ModelSpec:
    base = dict(interface="chat", backend="openai", path="served-model", base_url=url,
                api_key_env=KEY_ENV, concurrency=3, timeout=5.0, max_retries=3)
    base.update(kw)
    return ModelSpec(**base)


def fast(model):
    """Keep backoff sleeps tiny so retry tests stay fast."""
    model.backoff_base = 0.01
    model.backoff_cap = 0.05
    return model


def chats(n: int) -> list[ChatRequest]:
    return [ChatRequest(messages=[{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": f"q{i}"}]) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# (a) normal answers: order, concurrency, parameter mapping, vision
# ---------------------------------------------------------------------------------------------
def test_order_concurrency_and_param_mapping(servers, key_env):
    srv = servers(delay=0.25)
    model = OpenAIChatModel(spec(srv.url, concurrency=3), "agent")
    params = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, seed=11, logprobs=True)
    out = model.generate(chats(7), params)

    assert [c.text for c in out] == [f"echo:q{i}" for i in range(7)]
    assert all(isinstance(c, Completion) for c in out)
    assert 1 < srv.max_active <= 3
    assert model.calls == 1 and model.requests_sent == 7
    by_q = {b["messages"][-1]["content"]: b for b in srv.bodies}
    for i in range(7):
        b = by_q[f"q{i}"]
        assert b["model"] == "served-model"
        assert b["max_tokens"] == 7 and b["temperature"] == 0.7 and b["top_p"] == 0.9
        assert b["seed"] == mix_seed(11, i)  # distinct seeds: K rollouts of one prompt still differ
        assert b["logprobs"] is True
        assert b["messages"][0] == {"role": "system", "content": "be brief"}
    assert set(srv.auth) == {f"Bearer {SECRET}"}
    c = out[0]
    assert c.logprobs == [-0.25, -1.5]
    assert c.prompt_ids is None and c.completion_ids is None
    assert c.finish_reason == "length"
    assert c.meta["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}
    assert model.generate([], params) == [] and model.calls == 2


def test_no_logprobs_requested_or_returned(servers, key_env):
    srv = servers(logprobs=False)
    model = OpenAIChatModel(spec(srv.url), "agent")
    out = model.generate(chats(2), SamplingParams(logprobs=False, seed=None))
    assert "logprobs" not in srv.bodies[0] and "seed" not in srv.bodies[0]
    assert [c.logprobs for c in out] == [None, None]
    out = model.generate(chats(1), SamplingParams(logprobs=True))
    assert srv.bodies[-1]["logprobs"] is True
    assert out[0].logprobs is None  # asked, but this server does not return them


def test_vision_frames_as_jpeg_data_urls(servers, key_env):
    from PIL import Image

    srv = servers()
    model = OpenAIVisionModel(spec(srv.url, interface="vision"), "browser")
    frames = np.zeros((3, 32, 48, 3), dtype=np.uint8)
    frames[:, :, :24, 0] = 255  # left half red
    req = VisionRequest(frames=frames, timestamps=[0.0, 1.5, 3.0], prompt="What is red?",
                        system="You describe frames.")
    out = model.describe([req, req], SamplingParams(max_new_tokens=5))
    assert [c.text for c in out] == ["images:3", "images:3"]
    msgs = srv.bodies[0]["messages"]
    assert msgs[0] == {"role": "system", "content": "You describe frames."}
    parts = msgs[1]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url"] * 3 + ["text"]
    assert [p["text"] for p in parts if p["type"] == "text"] == [
        "Frame at 0.00 s:", "Frame at 1.50 s:", "Frame at 3.00 s:", "What is red?"]
    url = parts[1]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    assert img.shape == (32, 48, 3)
    assert img[:, :20, 0].mean() > 200 and img[:, 28:, 0].mean() < 50

    with pytest.raises(ModelError, match="3 frames but 2 timestamps"):
        model.describe([VisionRequest(frames=frames, timestamps=[0.0, 1.0], prompt="x")],
                       SamplingParams())


def _colour_clip(n: int, h: int = 32, w: int = 48) -> np.ndarray:
    """Frame i is one flat colour, distinct per frame, so decoded frames can be matched to sent ones."""
    frames = np.zeros((n, h, w, 3), dtype=np.uint8)
    for i in range(n):
        frames[i] = (40 + 50 * i, 200 - 40 * i, 120)
    return frames


def _decoded(out: list[Completion]) -> list[dict]:
    return [json.loads(c.text)[0] for c in out]


def test_video_url_sends_one_mp4_with_its_timing(servers, key_env):
    srv = servers()
    model = OpenAIVisionModel(spec(srv.url, interface="vision", video_input="video_url"), "browser")
    frames = _colour_clip(4)
    steady = VisionRequest(frames=frames, timestamps=[4.0, 4.5, 5.0, 5.5], prompt="What changes?",
                           system="You watch clips.")
    # sampled from a 10 fps video: steps of 0.6 or 0.7 s land on a 5/3 fps grid
    sampled = VisionRequest(frames=_colour_clip(5), timestamps=[0.0, 0.6, 1.2, 1.9, 2.5], prompt="q")
    # two moments of the video: the gap survives as time without frames
    gappy = VisionRequest(frames=_colour_clip(4), timestamps=[10.0, 10.5, 30.0, 30.5], prompt="q")
    odd = VisionRequest(frames=_colour_clip(2, h=33, w=47), timestamps=[1.0, 2.0], prompt="q")
    out = model.describe([steady, sampled, gappy, odd], SamplingParams(max_new_tokens=5))

    msgs = next(b["messages"] for b in srv.bodies if len(b["messages"]) == 2)  # sent concurrently
    assert msgs[0] == {"role": "system", "content": "You watch clips."}
    parts = msgs[1]["content"]
    assert [p["type"] for p in parts] == ["video_url", "text"]  # the question after the video
    assert parts[0]["video_url"]["url"].startswith("data:video/mp4;base64,")
    assert parts[1]["text"] == ("The video shows 4 frames from 4.00 s to 5.50 s of the source video.\n"
                                "What changes?")
    got = _decoded(out)
    assert got[0]["frames"] == 4 and got[0]["fps"] == "2" and got[0]["times"] == [0.0, 0.5, 1.0, 1.5]
    assert got[0]["size"] == [32, 48]
    sent = frames.reshape(4, -1, 3).mean(1)
    assert np.abs(np.array(got[0]["means"]) - sent).max() < 6  # each frame arrives in order (lossy codec)
    assert got[1]["frames"] == 5 and got[1]["fps"] == "5/3"
    assert got[1]["times"] == [0.0, 0.6, 1.2, 1.8, 2.4]
    assert got[2]["frames"] == 4 and got[2]["fps"] == "2" and got[2]["times"] == [0.0, 0.5, 20.0, 20.5]
    assert got[3]["size"] == [34, 48]  # odd sides padded by one repeated row / column for H.264
    assert model.requests_sent == 4


def test_video_url_file_transport_writes_under_the_root_and_cleans_up(servers, key_env, tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    srv = servers(media_root=root)
    model = OpenAIVisionModel(spec(srv.url, interface="vision", video_input="video_url", video_transport="file",
                                   video_root=str(root)), "browser")
    req = VisionRequest(frames=_colour_clip(3), timestamps=[0.0, 1.0, 2.0], prompt="q")
    out = model.describe([req, req], SamplingParams(max_new_tokens=5))
    urls = [b["messages"][-1]["content"][0]["video_url"]["url"] for b in srv.bodies]
    assert all(u.startswith(f"file://{root}/m1-clip-") and u.endswith(".mp4") for u in urls)
    assert len(set(urls)) == 2
    assert [d["frames"] for d in _decoded(out)] == [3, 3] and _decoded(out)[0]["times"] == [0.0, 1.0, 2.0]
    assert list(root.iterdir()) == []  # each file lives only while its batch is answered

    # a root the server does not allow: its 400 names the file; the file is still removed
    other = tmp_path / "elsewhere"
    other.mkdir()
    outside = OpenAIVisionModel(spec(srv.url, interface="vision", video_input="video_url", video_transport="file",
                                     video_root=str(other)), "browser")
    with pytest.raises(ModelError, match=r"'browser'.*HTTP 400.*allowed-local-media-path"):
        outside.describe([req], SamplingParams(max_new_tokens=5))
    assert list(other.iterdir()) == []

    missing = tmp_path / "missing"
    with pytest.raises(ModelError, match=rf"'browser'.*video_root {missing} is not an existing folder"):
        OpenAIVisionModel(spec(srv.url, interface="vision", video_input="video_url", video_transport="file",
                               video_root=str(missing)), "browser")


def test_video_url_request_errors(servers, key_env):
    srv = servers()
    model = OpenAIVisionModel(spec(srv.url, interface="vision", video_input="video_url"), "browser")
    frames = _colour_clip(3)
    with pytest.raises(ModelError, match="3 frames but 2 timestamps"):
        model.describe([VisionRequest(frames=frames, timestamps=[0.0, 1.0], prompt="x")], SamplingParams())
    with pytest.raises(ModelError, match="timestamps must not decrease"):
        model.describe([VisionRequest(frames=frames, timestamps=[0.0, 2.0, 1.0], prompt="x")], SamplingParams())
    with pytest.raises(ModelError, match="'browser'.*at least one frame"):
        model.describe([VisionRequest(frames=frames[:0], timestamps=[], prompt="x")], SamplingParams())
    assert srv.bodies == []


def test_video_settings_are_checked_with_the_config(tmp_path):
    from m1.config import load_team
    from m1.config_files import ConfigError

    base = spec("http://127.0.0.1:9/v1", interface="vision")
    assert not {"video_input", "video_transport", "video_root"} & set(base.recorded())  # defaults: not recorded
    with pytest.raises(ValueError, match="video_input: video_url applies to a vision model of backend openai"):
        spec("http://127.0.0.1:9/v1", interface="chat", video_input="video_url")
    with pytest.raises(ValueError, match="video_transport: file writes each clip under `video_root`, which is not"):
        spec("http://127.0.0.1:9/v1", interface="vision", video_input="video_url", video_transport="file")
    with pytest.raises(ValueError, match="video_root: applies only with video_input: video_url"):
        spec("http://127.0.0.1:9/v1", interface="vision", video_root="/tmp")
    with pytest.raises(ValueError, match="video_root: is used only with video_transport: file"):
        spec("http://127.0.0.1:9/v1", interface="vision", video_input="video_url", video_root="/tmp")

    team = load_team("tiny")
    data = team.model_dump()
    data["models"]["served"] = {"interface": "vision", "backend": "openai", "path": "m", "base_url": "http://x/v1",
                                "video_input": "video_url", "video_transport": "file"}
    import yaml

    cfg = tmp_path / "team.yaml"
    cfg.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"team.yaml: models.served: .*video_transport: file .*video_root"):
        load_team(cfg)
    data["models"]["served"]["video_root"] = "./clips"  # relative to the YAML file, like `path`
    cfg.write_text(yaml.safe_dump(data))
    assert load_team(cfg).models["served"].video_root == str(tmp_path / "clips")


# ---------------------------------------------------------------------------------------------
# (b) transient errors are retried; Retry-After is honoured
# ---------------------------------------------------------------------------------------------
def test_429_then_500_then_success(servers, key_env):
    srv = servers(script=[(429, {"Retry-After": "0"}, "slow down"), (500, {}, "boom")])
    model = fast(OpenAIChatModel(spec(srv.url, max_retries=3), "agent"))
    out = model.generate(chats(1), SamplingParams())
    assert out[0].text == "echo:q0"
    assert model.requests_sent == 3 and len(srv.bodies) == 3 and model.calls == 1


def test_retry_after_is_waited_for(servers, key_env):
    srv = servers(script=[(503, {"Retry-After": "0.4"}, "busy")])
    model = OpenAIChatModel(spec(srv.url, max_retries=2), "agent")
    model.backoff_base = model.backoff_cap = 0.0  # any wait must come from Retry-After
    t0 = time.monotonic()
    assert model.generate(chats(1), SamplingParams())[0].text == "echo:q0"
    assert 0.4 <= time.monotonic() - t0 < 3.0
    assert model.requests_sent == 2


def test_parse_retry_after_forms():
    import email.utils

    assert parse_retry_after({"retry-after": "2"}) == 2.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    date = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= parse_retry_after({"retry-after": date}) <= 31
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None


def test_retries_exhausted_on_5xx(servers, key_env):
    srv = servers(per_request=lambda body: (502, {}, "bad gateway"))
    model = fast(OpenAIChatModel(spec(srv.url, max_retries=2), "agent"))
    with pytest.raises(ModelError, match=r"failed after 3 attempt\(s\).*HTTP 502"):
        model.generate(chats(1), SamplingParams())
    assert model.requests_sent == 3 and len(srv.bodies) == 3


def test_connection_refused_is_retried_then_fails(key_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    model = fast(OpenAIChatModel(spec(f"http://127.0.0.1:{port}/v1", max_retries=2), "agent"))
    with pytest.raises(ModelError, match="connection error"):
        model.generate(chats(1), SamplingParams())
    assert model.requests_sent == 3


# ---------------------------------------------------------------------------------------------
# (c) client errors fail at once, naming model, URL and status, never the key
# ---------------------------------------------------------------------------------------------
def test_401_fails_immediately_without_key(servers, key_env):
    # A careless server that echoes the key back in its error message.
    srv = servers(per_request=lambda body: (401, {}, f"Incorrect API key provided: {SECRET}"))
    model = fast(OpenAIChatModel(spec(srv.url, max_retries=5), "agent"))
    with pytest.raises(ModelError) as info:
        model.generate(chats(1), SamplingParams())
    msg = str(info.value)
    assert "HTTP 401" in msg and "served-model" in msg and srv.url in msg and KEY_ENV in msg
    assert SECRET not in msg and "***" in msg
    assert model.requests_sent == 1 and len(srv.bodies) == 1


@pytest.mark.parametrize("status", [403, 404, 422])
def test_other_4xx_fail_immediately(servers, key_env, status):
    srv = servers(per_request=lambda body: (status, {}, "nope"))
    model = fast(OpenAIChatModel(spec(srv.url), "agent"))
    with pytest.raises(ModelError, match=f"HTTP {status}"):
        model.generate(chats(1), SamplingParams())
    assert model.requests_sent == 1


def test_batch_failure_reports_root_cause_and_stops_siblings(servers, key_env):
    def behave(body):
        if body["messages"][-1]["content"] == "q0":
            return (401, {}, "bad key")
        return (500, {}, "flaky")

    srv = servers(per_request=behave)
    model = OpenAIChatModel(spec(srv.url, concurrency=4, max_retries=50), "agent")
    model.backoff_base, model.backoff_cap = 0.2, 0.2
    t0 = time.monotonic()
    with pytest.raises(ModelError, match="HTTP 401"):
        model.generate(chats(4), SamplingParams())
    assert time.monotonic() - t0 < 5.0
    assert model.requests_sent < 20  # siblings stopped instead of running 50 retries each


def test_rejected_fields_are_adapted_once(servers, key_env):
    def behave(body):
        if "max_tokens" in body:
            return (400, {}, "Unsupported parameter: 'max_tokens'. Use 'max_completion_tokens'.")
        if "logprobs" in body:
            return (400, {}, "logprobs are not supported with this model")
        return None

    srv = servers(per_request=behave)
    model = OpenAIChatModel(spec(srv.url), "agent")
    out = model.generate(chats(1), SamplingParams(max_new_tokens=9, logprobs=True))
    assert out[0].text == "echo:q0" and out[0].logprobs is None
    assert srv.bodies[-1]["max_completion_tokens"] == 9 and "logprobs" not in srv.bodies[-1]
    n = len(srv.bodies)
    model.generate(chats(1), SamplingParams(max_new_tokens=9))
    assert len(srv.bodies) == n + 1  # remembered: no more rejected attempts


# ---------------------------------------------------------------------------------------------
# (d) a hanging server times out within a bounded time
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)  # a client that never gives up fails here instead of hanging the suite
def test_hanging_server_times_out(servers, key_env):
    srv = servers(per_request=lambda body: ("hang",))
    model = fast(OpenAIChatModel(spec(srv.url, timeout=0.5, max_retries=1), "agent"))
    with pytest.raises(ModelError, match=r"failed after 2 attempt\(s\).*timed out"):
        model.generate(chats(1), SamplingParams())
    assert model.requests_sent == 2


# ---------------------------------------------------------------------------------------------
# (e) the key never leaks
# ---------------------------------------------------------------------------------------------
def test_key_never_in_repr_errors_results_or_logs(servers, key_env, caplog):
    caplog.set_level(logging.DEBUG)
    srv = servers(script=[(500, {}, f"upstream said {SECRET}")])
    model = fast(OpenAIChatModel(spec(srv.url), "agent"))
    vision = OpenAIVisionModel(spec(srv.url, interface="vision"), "browser")
    assert SECRET not in repr(model) and SECRET not in repr(vision)
    assert SECRET not in repr(vars(model)) and SECRET not in str(vars(model))
    out = model.generate(chats(1), SamplingParams())
    assert SECRET not in repr(out)
    bad = servers(per_request=lambda body: (403, {}, f"key {SECRET} has no access"))
    other = OpenAIChatModel(spec(bad.url), "agent")
    with pytest.raises(ModelError) as info:
        other.generate(chats(1), SamplingParams())
    assert SECRET not in str(info.value) and SECRET not in repr(info.value)
    assert info.value.__cause__ is None and info.value.__context__ is None
    assert SECRET not in caplog.text
    assert "upstream said ***" in caplog.text  # the retry warning was logged, scrubbed


def test_missing_key_without_base_url(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ModelError, match=KEY_ENV):
        OpenAIChatModel(spec(None), "agent")


def test_local_server_needs_no_key(servers, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    srv = servers()
    model = OpenAIChatModel(spec(srv.url), "agent")
    assert model.generate(chats(1), SamplingParams())[0].text == "echo:q0"
    assert srv.auth == ["Bearer EMPTY"]


def test_base_url_from_environment(servers, key_env, monkeypatch):
    srv = servers()
    monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
    model = OpenAIChatModel(spec(None), "agent")
    assert model.base_url == srv.url
    assert model.generate(chats(1), SamplingParams())[0].text == "echo:q0"


# ---------------------------------------------------------------------------------------------
# End to end: `transformers serve` with a tiny random Qwen2 from a local folder
# ---------------------------------------------------------------------------------------------
def test_transformers_serve_end_to_end(tmp_path, monkeypatch):
    from m1.models.tiny import ensure_tiny

    exe = Path(sys.executable).parent / "transformers"
    if not exe.is_file():
        pytest.skip(f"the `transformers` CLI is not installed next to {sys.executable}")
    model_dir = ensure_tiny(TinySpec(arch="qwen2"), cache_dir=tmp_path / "cache")
    served = tmp_path / "served-qwen2"
    shutil.copytree(model_dir, served)
    # The server keeps do_sample from generation_config.json and only turns it off for
    # temperature 0; a random tiny model decodes greedily to whitespace, which it strips.
    gen_cfg = served / "generation_config.json"
    gen_cfg.write_text(json.dumps({**json.loads(gen_cfg.read_text()), "do_sample": True}))

    from m1.models.vllm_server import free_port

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [str(exe), "serve", str(served), "--host", "127.0.0.1", "--port", str(port),
             "--device", "cpu", "--dtype", "float32"],
            stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    ready = r.status == 200
            except OSError:
                pass
            if ready:
                break
            time.sleep(0.5)
        assert ready, f"transformers serve did not become ready:\n{log_path.read_text()[-3000:]}"

        monkeypatch.delenv(KEY_ENV, raising=False)
        model = OpenAIChatModel(spec(f"http://127.0.0.1:{port}/v1", path=str(served),
                                     concurrency=2, timeout=60.0, max_retries=1), "tiny")
        reqs = [ChatRequest(messages=[{"role": "user", "content": "What colour is the square?"}]),
                ChatRequest(messages=[{"role": "user", "content": "How many circles?"}])]
        out = model.generate(reqs, SamplingParams(max_new_tokens=12, temperature=1.0, seed=0))
        assert len(out) == 2
        for c in out:
            assert c.text.strip(), f"empty completion: {c}"
            assert c.finish_reason in ("length", "stop")
            assert 1 <= c.meta["usage"]["completion_tokens"] <= 12
            assert c.logprobs is None  # transformers serve ignores the logprobs field
        assert model.requests_sent == 2
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

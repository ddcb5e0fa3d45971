"""`m1 serve` (m1/serve/): the official openai client gets m1 infer's answers, requests are batched, and bad
requests get one JSON error each (never a 500, never a path outside the allowed roots)."""
from __future__ import annotations

import base64
import io
import json
import os
import random
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import make_synth_world

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from m1.config import load_team  # noqa: E402
from m1.run import run_questions  # noqa: E402
from m1.serve import ApiError, ChatCompletionRequest, Limits, create_app, split_options  # noqa: E402
from m1.serve.protocol import FIELD_ERRORS, IGNORED_FIELDS, FieldError, fields  # noqa: E402
from m1.team.engines_registry import make_team  # noqa: E402

NO_CLIP = ["models.clip.clip_name=null", "models.clip.tiny={arch: open_clip}"]  # the world's CLIP takes minutes
LETTERS = "ABCDEFGHIJ"


@pytest.fixture(scope="module")
def world(tmp_path_factory, m1_cache):
    return make_synth_world(tmp_path_factory.mktemp("synth"), videos=2, seed=7, duration=40, questions_per_video=3)


@pytest.fixture(scope="module")
def cfg(m1_cache):
    return load_team("synth_teacher", NO_CLIP)


@pytest.fixture(scope="module")
def team(cfg):
    return make_team(cfg)


def _text(q) -> str:
    return q.text + "".join(f"\n{LETTERS[i]}. {o}" for i, o in enumerate(q.options)) + \
        ("\nAnswer with the option's letter from the given choices directly." if q.options else "")


def _body(q, url=None, **extra) -> dict:
    url = url or Path(q.video).resolve().as_uri()
    return {"model": "synth_teacher", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": _text(q)}]}],
        "max_tokens": 16, "temperature": 0.0, "media_io_kwargs": {"video": {"num_frames": 10}}, **extra}


def _extra(q) -> dict:
    """The question as structured fields, for tasks whose text has no lettered options (open, numeric, grounding)."""
    return {"m1": {"question": q.text, "options": q.options, "task": q.task}} if not q.options else {}


class _Server:
    """uvicorn on a free port in a thread: the openai client needs a real socket."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def test_split_options_reads_lettered_lines_and_drops_the_instruction():
    q, opts = split_options("What is red?\nA. a circle\nB) a square\nC. a star\nAnswer with the option's letter.")
    assert (q, opts) == ("What is red?", ["a circle", "a square", "a star"])
    assert split_options("I. am a sentence.\nNothing else") == ("I. am a sentence.\nNothing else", [])


def _refusal(body) -> tuple:
    try:
        ChatCompletionRequest.from_body(body, "synth_teacher").question(1000)
    except ApiError as exc:
        return exc.status, exc.message, exc.param
    return 200, None, None


def test_request_model_tolerates_what_openai_clients_send_and_names_each_fault():
    """The request model tolerates every field an OpenAI client sends, names an unknown one (the first by name),
    and gives each fault its own message and param, whatever pydantic's own error is."""
    video = {"type": "video_url", "video_url": {"url": "file:///v.mp4"}}
    ok = {"model": "synth_teacher", "messages": [{"role": "system", "content": 5}, {"role": "user", "name": "u",
          "content": [video, {"type": "text", "text": "Which?\nA. x\nB. y"}]}]}
    sent = {"max_tokens": 16, "max_completion_tokens": 16, "temperature": 0, "top_p": 1, "n": 1, "stream": False,
            "media_io_kwargs": {}, "mm_processor_kwargs": {}, "chat_template_kwargs": {}, "m1": {"task": "mcq"},
            "extra_body": 3, "user": "u", "seed": 1, "stop": ["x"], "stream_options": {}, "frequency_penalty": 0,
            "presence_penalty": 0, "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}}
    assert _refusal({**ok, **sent}) == (200, None, None)
    req = ChatCompletionRequest.from_body({**ok, "m1": None, "extra_body": {"m1": {"task": "open"}}}, "synth_teacher")
    assert req.question(1000).task == "open"
    text = {"type": "text", "text": "Which?"}
    for body, want in [
        ([], (400, "the body must be a JSON object", None)),
        ({**ok, "zz": 1, "logit_bias": {}}, (400, "unsupported field 'logit_bias'", "logit_bias")),
        ({**ok, "stream": True}, (400, "stream: true is not supported; send stream: false (or leave it out)",
                                  "stream")),
        ({**ok, "model": "gpt-4o", "n": 2}, (404, "model 'gpt-4o' is not served here; this server serves "
                                                 "'synth_teacher'", "model")),
        ({**ok, "n": 2}, (400, "n = 2: one answer per request", "n")),
        ({**ok, "max_tokens": True}, (400, "max_tokens must be a positive integer, got True", "max_tokens")),
        ({**ok, "max_completion_tokens": 0}, (400, "max_completion_tokens must be a positive integer, got 0",
                                              "max_completion_tokens")),
        ({**ok, "temperature": "0"}, (400, "temperature must be a number, got '0'", "temperature")),
        ({**ok, "mm_processor_kwargs": []}, (400, "mm_processor_kwargs must be an object", "mm_processor_kwargs")),
        ({**ok, "m1": "x"}, (400, "m1 must be an object {question, options, task}", "m1")),
        ({**ok, "messages": []}, (400, "messages must be a non-empty list", "messages")),
        ({**ok, "messages": [1]}, (400, "each message must be an object", "messages[0]")),
        ({**ok, "messages": [{"content": "x"}]}, (400, "role None: expected user, system, developer or assistant",
                                                  "messages[0].role")),
        ({**ok, "messages": [{"role": "user", "content": 3}]},
         (400, "content must be a string or a list of parts", "messages[0].content")),
        ({**ok, "messages": [{"role": "user", "content": [video, 3]}]},
         (400, "each content part must be an object", "messages[0].content[1]")),
        ({**ok, "messages": [{"role": "user", "content": [video, {"type": "audio"}]}]},
         (400, "unsupported content part type 'audio': text, video_url and image_url are served",
          "messages[0].content[1].type")),
        ({**ok, "messages": [{"role": "user", "content": [video, {"type": "text"}]}]},
         (400, "a text part needs a text string", "messages[0].content[1].text")),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": ""}}]}]},
         (400, "video_url needs a url string", "messages[0].content[0].video_url.url")),
        ({**ok, "messages": [{"role": "user", "content": [text]}]},
         (400, "no video: add a video_url part or image_url frames", "messages")),
        ({**ok, "messages": [{"role": "user", "content": [video, video, text]}]},
         (400, "2 video_url parts: one video per request", "messages")),
        ({**ok, "m1": {"question": "x" * 999}}, (413, "the question text is 1001 characters: at most 1000 "
                                                  "(--max-text-kb); a prompt that long does not fit the team's "
                                                  "models", "messages")),
        ({**ok, "m1": {"question": None}}, (400, "m1.question must be a string", "m1.question")),
        ({**ok, "m1": {"options": ["a", " "]}}, (400, "m1.options must be a list of at most 26 non-empty strings",
                                                 "m1.options")),
        ({**ok, "m1": {"task": "essay"}}, (400, "m1.task 'essay': one of mcq, open, grounding, numeric", "m1.task")),
        ({**ok, "m1": {"question": " "}}, (400, "no question: add a text part (or m1.question)", "messages")),
        ({**ok, "m1": {"options": [], "task": "mcq"}},
         (400, "an mcq question needs options (lettered lines A. ... or m1.options)", "m1.options")),
        ({**ok, "m1": {"options": ["one"]}}, (400, "invalid question: field 'options': an mcq question needs at "
                                                   "least 2 options, got 1", "m1")),
    ]:
        assert _refusal(body) == want, body


# A body with every request model in it: each path of `fields(ChatCompletionRequest)` reaches a place in it.
FULL = {"model": "synth_teacher", "extra_body": {},
        "m1": {"question": "Which?", "options": ["x", "y"], "task": "mcq", "id": "q1"},
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "file:///v.mp4"}},
            {"type": "image_url", "image_url": {"url": "file:///f.png"}, "fps": 2},
            {"type": "text", "text": "Which?"}]}]}
WRONG = [None, "x", 7, 1.5, True, [], {}, ["x"], {"x": 1}]  # each JSON type, empty or not


def _put(node, keys: list, value):
    """`node` with `value` at each place the path `keys` reaches ("*": every item of a list)."""
    if not keys:
        return value
    if keys[0] == "*":
        return [_put(x, keys[1:], value) for x in node] if isinstance(node, list) else node
    if isinstance(node, dict) and (keys[0] in node or len(keys) == 1):
        return {**node, keys[0]: _put(node.get(keys[0]), keys[1:], value)}
    return node


def test_every_request_field_names_itself_in_its_error():
    """Every field of the request models, nested ones and list items included, gets a value of each JSON type; a
    value it refuses must give a message of its own whose param is that field's place, never the body's error nor
    its parent's. A field added without its FieldError fails here."""
    assert isinstance(ChatCompletionRequest.from_body(FULL, "synth_teacher"), ChatCompletionRequest)
    paths = sorted({path for path, _ in fields(ChatCompletionRequest)})
    assert {"max_tokens", "messages.*", "messages.*.content.*.video_url", "m1.task"} <= set(paths)
    for path in paths:
        keys = path.split(".")
        assert _put(FULL, keys, "sentinel") != FULL, f"FULL has no place for {path}: add one"
        named = keys[:-1] if keys[-1] == "*" and path not in FIELD_ERRORS else keys  # m1.options speaks for its items
        place = re.compile("".join(r"\[\d+\]" if k == "*" else ("." if i else "") + re.escape(k)
                                   for i, k in enumerate(named)) + r"([.\[].*)?")
        refused = []
        for value in WRONG:
            try:
                ChatCompletionRequest.from_body(_put(FULL, keys, value), "synth_teacher")
            except ApiError as exc:
                refused.append(value)
                assert exc.message not in ("the body must be a JSON object", "malformed request"), (path, value)
                assert place.fullmatch(exc.param or ""), (path, value, exc.message, exc.param)
        if path in FIELD_ERRORS:  # a declared message some wrong type reaches
            assert refused, path
    assert all(isinstance(e, FieldError) for e in FIELD_ERRORS.values())


def test_ignored_fields_are_declared_once_documented_and_named_in_the_reply(world, team):
    assert {"max_tokens", "max_completion_tokens", "temperature", "mm_processor_kwargs",
            "chat_template_kwargs"} <= set(IGNORED_FIELDS)
    assert not {"model", "stream", "n", "media_io_kwargs", "extra_body", "m1", "messages"} & set(IGNORED_FIELDS)
    doc = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    listed = doc.split("Accepted and ignored", 1)[1].split("): ", 1)[1].split(". ", 1)[0]
    assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(IGNORED_FIELDS)
    folder, _, qs = world
    q = qs[0]
    with _client(team, allowed_roots=[Path(folder).resolve()]) as c:
        r = c.post("/v1/chat/completions", json={**_body(q, **_extra(q)), "top_p": None, "seed": 3})
        assert r.status_code == 200, r.text
        assert r.json()["m1"]["ignored"] == ["max_tokens", "temperature", "seed"]  # set and not null
        bare = {k: v for k, v in _body(q, **_extra(q)).items() if k not in IGNORED_FIELDS}
        r = c.post("/v1/chat/completions", json=bare)
        assert r.status_code == 200 and r.json()["m1"]["ignored"] == []
        # requests sharing an m1.id each get their own reply id
        same = {**bare, "m1": {**(bare.get("m1") or {}), "id": "same-id"}}
        replies = [c.post("/v1/chat/completions", json=same).json() for _ in range(3)]
        assert len({x["id"] for x in replies}) == 3 and all(x["id"].startswith("chatcmpl-") for x in replies)
        assert [x["m1"]["question_id"] for x in replies] == ["same-id"] * 3
        assert all(x["m1"]["trace_url"].endswith(x["id"].removeprefix("chatcmpl-")) for x in replies)


def test_openai_client_with_video_url_and_image_frames_gets_m1_infers_answers(world, cfg, team, tmp_path):
    import av
    import numpy as np
    from openai import OpenAI
    from PIL import Image

    folder, path, qs = world
    summary = run_questions(cfg, qs, tmp_path / "r.jsonl", team=team, progress=False)
    assert not summary.errors
    rows = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()}
    app = create_app(team, Limits(allowed_roots=[Path(folder).resolve()], gather_s=0.2))
    with _Server(app) as srv:
        client = OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["synth_teacher"]
        got: dict[str, object] = {}

        def ask(q):
            b = _body(q, **_extra(q))
            got[q.id] = client.chat.completions.create(
                model=b["model"], messages=b["messages"], max_tokens=16, temperature=0.0,
                extra_body={"media_io_kwargs": b["media_io_kwargs"], **_extra(q)})

        threads = [threading.Thread(target=ask, args=(q,)) for q in qs]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for q in qs:
            r = got[q.id]
            assert r.choices[0].message.content == rows[q.id]["answer"], q.id
            m1 = r.model_extra["m1"]
            assert {a: v["answer"] for a, v in m1["agents"].items()} == \
                {a: v["answer"] for a, v in rows[q.id]["agents"].items()}
            assert m1["frames_used"] == rows[q.id]["frames_used"] and r.usage.total_tokens > 0
            assert m1["ignored"] == ["max_tokens", "temperature"]  # the openai client takes the extra key
        assert max(app.state.batcher.batches) > 1  # concurrent requests ran together
        page = __import__("httpx").get(got[qs[0].id].model_extra["m1"]["trace_url"])
        assert page.status_code == 200 and qs[0].text[:20] in page.text

        # the same video as image_url frames (every frame, at the video's own rate)
        q = qs[0]
        with av.open(q.video) as c:
            fps = float(c.streams.video[0].average_rate)
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]

        def png(a):
            buf = io.BytesIO()
            Image.fromarray(np.asarray(a)).save(buf, format="PNG")
            return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

        parts = [{"type": "image_url", "image_url": {"url": png(f)}} for f in frames]
        r = client.chat.completions.create(
            model="synth_teacher", messages=[{"role": "user", "content": parts + [{"type": "text", "text": _text(q)}]}],
            extra_body={"media_io_kwargs": {"video": {"fps": fps}}, **_extra(q)})
        assert r.choices[0].message.content == rows[q.id]["answer"]

        # a data: URL of the mp4 itself
        data = "data:video/mp4;base64," + base64.b64encode(Path(q.video).read_bytes()).decode()
        r = client.chat.completions.create(model="synth_teacher", messages=_body(q, url=data)["messages"],
                                           extra_body=_extra(q))
        assert r.choices[0].message.content == rows[q.id]["answer"]


def _client(team, **limits) -> TestClient:
    return TestClient(create_app(team, Limits(**limits)), raise_server_exceptions=False)


def test_path_escapes_are_refused(world, team, tmp_path):
    folder, _, qs = world
    root = tmp_path / "root"
    root.mkdir()
    (root / "link.mp4").symlink_to(Path(qs[0].video).resolve())  # a link out of the root
    inside = root / "v.mp4"
    inside.write_bytes(Path(qs[0].video).read_bytes())
    q = qs[0]
    with _client(team, allowed_roots=[root.resolve()]) as c:
        for url in [f"file://{root}/../{Path(q.video).name}", f"file://{root}/%2e%2e/x.mp4",
                    f"file://{root}/%252e%252e/x.mp4", f"file://{root}/link.mp4", Path(q.video).resolve().as_uri(),
                    "file://otherhost/etc/passwd", "file:///etc/passwd", "v.mp4", f"file://{root}/nope.mp4",
                    f"{root}/..%2fv.mp4", "http://example.com/v.mp4"]:
            r = c.post("/v1/chat/completions", json=_body(q, url=url, **_extra(q)))
            assert r.status_code == 400, (url, r.text)
            assert "Traceback" not in r.text and r.json()["error"]["message"]
        ok = c.post("/v1/chat/completions", json=_body(q, url=inside.as_uri(), **_extra(q)))
        assert ok.status_code == 200, ok.text
    with _client(team) as c:  # no roots: no local files at all
        r = c.post("/v1/chat/completions", json=_body(q, url=inside.as_uri(), **_extra(q)))
        assert r.status_code == 400 and "--allowed-media-root" in r.json()["error"]["message"]


def test_api_key_body_size_stream_and_unreadable_video(world, team, tmp_path, capfd):
    folder, _, qs = world
    q = qs[0]
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video at all")
    app = create_app(team, Limits(allowed_roots=[Path(folder).resolve(), tmp_path.resolve()], max_body_bytes=4096),
                     api_key="s3cret-key")
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/v1/chat/completions", json=_body(q)).status_code == 401
        assert c.post("/v1/chat/completions", json=_body(q), headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/models").status_code == 401
        auth = {"Authorization": "Bearer s3cret-key"}
        assert c.post("/v1/chat/completions", json=_body(q, **_extra(q)), headers=auth).status_code == 200
        big = _body(q, url="data:video/mp4;base64," + "A" * 8000)
        r = c.post("/v1/chat/completions", json=big, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        r = c.post("/v1/chat/completions", json=_body(q, stream=True), headers=auth)
        assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json=_body(q, url=bad.as_uri()), headers=auth)
        assert r.status_code == 400 and "unreadable video" in r.json()["error"]["message"]
    out = capfd.readouterr()
    assert "s3cret-key" not in out.out + out.err


class _GatedTeam:
    """The real team behind a gate: the test decides when a batch may run (queue and timeout tests); `ran` lists
    the ids of the questions it ran."""

    def __init__(self, team):
        self.team, self.cfg, self.gate, self.ran = team, team.cfg, threading.Event(), []

    def run(self, questions):
        self.gate.wait(30)
        self.ran += [q.id for q in questions]
        return self.team.run(questions)


def test_full_queue_is_429_with_retry_after_and_a_slow_answer_is_504(world, team):
    folder, _, qs = world
    q = qs[0]
    gated = _GatedTeam(team)
    lim = Limits(allowed_roots=[Path(folder).resolve()], max_queue=2, timeout_s=1.0, gather_s=0.0)
    with TestClient(create_app(gated, lim), raise_server_exceptions=False) as c:
        codes = []
        threads = [threading.Thread(target=lambda: codes.append(
            c.post("/v1/chat/completions", json=_body(q, **_extra(q))).status_code)) for _ in range(2)]
        [t.start() for t in threads]
        time.sleep(0.5)
        r = c.post("/v1/chat/completions", json=_body(q, **_extra(q)))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        [t.join() for t in threads]
        assert codes == [504, 504]
        gated.gate.set()  # the two timed-out episodes now run and are discarded; then the queue is free again
        for _ in range(600):
            if c.app.state.batcher.pending == 0:
                break
            time.sleep(0.1)
        ok = c.post("/v1/chat/completions", json=_body(q, **_extra(q)))
        assert ok.status_code == 200


class _AnswersTeam:
    """The real team, the final answer of each question named in `answers` replaced by the one given there (None: the
    agents all wrote garbage and the team has no answer)."""

    def __init__(self, team, answers: dict):
        self.team, self.cfg, self.answers = team, team.cfg, answers

    def run(self, questions):
        return [ep.model_copy(update={"final_answer": self.answers[ep.id]}) if ep.id in self.answers else ep
                for ep in self.team.run(questions)]


def test_an_answer_not_in_form_for_its_task_is_flagged_counted_and_logged(world, team, caplog):
    """An open question answered "D" and an mcq with no answer are not in form for their task. Each reply says
    `m1.answer_ok` (the rule of a results row's `answer_ok`), /health counts the answers and those not in form, and
    each one not in form is one warning naming its request and task; a null answer's content is empty."""
    import logging

    folder, _, qs = world
    q = qs[0]
    opts = q.options or ["red", "green", "blue", "yellow"]
    asks = {"open-d": ({"question": q.text, "options": [], "task": "open"}, "D"),
            "mcq-null": ({"question": q.text, "options": opts, "task": "mcq"}, None),
            "mcq-good": ({"question": q.text, "options": opts, "task": "mcq"}, "B")}
    app = create_app(_AnswersTeam(team, {k: a for k, (_, a) in asks.items()}),
                     Limits(allowed_roots=[Path(folder).resolve()], gather_s=0.0))
    with TestClient(app, raise_server_exceptions=False) as c, caplog.at_level(logging.WARNING, "m1.serve"):
        assert c.get("/health").json() == {"status": "ok", "pending": 0, "answered": 0, "not_in_form": 0}
        got = {}
        for qid, (m1, _) in asks.items():
            r = c.post("/v1/chat/completions", json=_body(q, m1={**m1, "id": qid}))
            assert r.status_code == 200, r.text
            got[qid] = r.json()
        assert {k: v["m1"]["answer_ok"] for k, v in got.items()} == \
            {"open-d": False, "mcq-null": False, "mcq-good": True}
        assert [got[k]["choices"][0]["message"]["content"] for k in asks] == ["D", "", "B"]
        assert got["mcq-null"]["m1"]["answer"] == ""
        assert c.get("/health").json() == {"status": "ok", "pending": 0, "answered": 3, "not_in_form": 2}
    lines = [r.getMessage() for r in caplog.records if r.name == "m1.serve" and r.levelno == logging.WARNING]
    assert len(lines) == 2, lines
    assert "request open-d (task open, reply " + got["open-d"]["id"] in lines[0] and "'D'" in lines[0], lines
    assert "request mcq-null (task mcq, reply " + got["mcq-null"]["id"] in lines[1] and "null" in lines[1], lines


def _until(check, timeout: float = 20.0) -> bool:
    """Whether `check()` became true within `timeout` seconds (polled)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return check()


def _hold(port: int, body: bytes) -> socket.socket:
    """A client that sends a whole request and waits for its answer, until the test closes its socket."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def test_a_client_gone_before_its_answer_is_not_run_and_is_one_log_line(world, team, caplog):
    """A client that hangs up after sending its whole body leaves no work behind: a queued request is dropped before
    it runs, one whose batch already runs is discarded when it ends, /health's pending goes back to 0, and each is
    one warning naming the request."""
    import logging

    from tests import serve_fuzz

    folder, _, qs = world
    q = qs[0]
    gated = _GatedTeam(team)
    app = create_app(gated, Limits(allowed_roots=[Path(folder).resolve()], gather_s=0.0))

    def body(qid: str) -> bytes:
        return json.dumps(_body(q, m1={**_extra(q).get("m1", {}), "id": qid})).encode()

    def pending() -> int:
        return serve_fuzz.health(srv.port)["pending"]

    with _Server(app) as srv, caplog.at_level(logging.WARNING, "m1.serve"):
        running = _hold(srv.port, body("gone-running"))
        assert _until(lambda: pending() == 1 and not app.state.batcher._queue)  # its batch waits at the gate
        queued = _hold(srv.port, body("gone-queued"))
        assert _until(lambda: pending() == 2)
        queued.close()
        assert _until(lambda: pending() == 1, 5), "the request of a client gone stayed in the queue"
        running.close()
        assert _until(lambda: any("gone-running" in r.getMessage() for r in caplog.records), 5)
        gated.gate.set()
        assert _until(lambda: pending() == 0)
        status, reply = serve_fuzz.post(srv.port, body("stayed"))
        assert status == 200, reply
    assert gated.ran == ["gone-running", "stayed"]
    lines = [r.getMessage() for r in caplog.records if r.name == "m1.serve"]
    assert lines == ["client 127.0.0.1 went away before the answer to request gone-queued: dropped before it ran",
                     "client 127.0.0.1 went away before the answer to request gone-running: its batch runs on, the "
                     "answer discarded"], lines


def test_every_get_route_answers_head_as_it_answers_get(world, team):
    """Every GET route of the app (read off its routes, so one added later
    is held to it too) answers HEAD with GET's status and headers and no body, over a real socket."""
    import httpx

    folder, _, qs = world
    q = qs[0]
    app = create_app(team, Limits(allowed_roots=[Path(folder).resolve()], gather_s=0.0))
    gets = sorted(r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ()))
    assert {"/v1/models", "/health", "/traces/{trace_id}"} <= set(gets), gets
    with _Server(app) as srv:
        base = f"http://127.0.0.1:{srv.port}"
        r = httpx.post(f"{base}/v1/chat/completions", json=_body(q, **_extra(q)), timeout=120)
        assert r.status_code == 200, r.text
        values = {"trace_id": [r.json()["id"].removeprefix("chatcmpl-"), "no-such-trace"]}
        for route in gets:
            names = re.findall(r"\{(\w+)\}", route)
            paths = [route] if not names else [route.replace(f"{{{names[0]}}}", v) for v in values[names[0]]]
            for path in paths:
                got, head = httpx.get(base + path), httpx.head(base + path)
                assert head.status_code == got.status_code != 405, (path, head.status_code, got.status_code)
                assert head.content == b"", path
                for h in ("content-type", "content-length"):
                    assert head.headers.get(h) == got.headers.get(h), (path, h)
        assert {httpx.head(f"{base}{p}").status_code for p in ("/v1/models", "/health")} == {200}


def _malformed(rng: random.Random, q) -> object:
    """One bad body: a wrong type, a missing or odd field, a broken URL, or random bytes."""
    good = _body(q, url="file:///nonexistent/x.mp4")
    junk = [None, 0, -1, 1.5, True, "", "x" * 50, [], {}, [1, 2], {"a": 1}, "\x00", "💥", 10 ** 30, ["text"]]
    kind = rng.randrange(8)
    if kind == 0:
        return rng.choice(junk)
    if kind == 1:
        b = json.loads(json.dumps(good))
        b[rng.choice(list(b) + ["messages", "model", "stream", "n", "m1", "extra"])] = rng.choice(junk)
        return b
    if kind == 2:
        b = json.loads(json.dumps(good))
        b["messages"][0][rng.choice(["role", "content", "name"])] = rng.choice(junk)
        return b
    if kind == 3:
        b = json.loads(json.dumps(good))
        part = rng.choice(b["messages"][0]["content"])
        part[rng.choice(["type", "video_url", "text", "image_url"])] = rng.choice(junk)
        return b
    if kind == 4:
        b = json.loads(json.dumps(good))
        b["messages"][0]["content"][0]["video_url"]["url"] = rng.choice(
            ["data:video/mp4;base64,%%%", "data:image/png;base64,AAAA", "data:video/mp4,abc", "data:", "file://",
             "file:///", "ftp://x/y.mp4", "\\\\server\\share", "file:///%00", "/" * 300, "file:///proc/self/environ"])
        return b
    if kind == 5:
        b = json.loads(json.dumps(good))
        b["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": rng.choice(
            ["data:image/png;base64,AAAA", "data:image/png;base64,", "data:text/plain;base64,aGk="])}},
            {"type": "text", "text": "What?\nA. x\nB. y"}]
        return b
    if kind == 6:
        b = json.loads(json.dumps(good))
        b["m1"] = {rng.choice(["question", "options", "task", "id"]): rng.choice(junk)}
        return b
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))


def test_fuzz_a_thousand_malformed_bodies_never_give_a_500(world, team):
    folder, _, qs = world
    rng = random.Random(0)
    with _client(team, allowed_roots=[Path(folder).resolve()]) as c:
        statuses = {}
        for i in range(1200):
            body = _malformed(rng, qs[0])
            if isinstance(body, bytes):
                r = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            else:
                r = c.post("/v1/chat/completions", content=json.dumps(body).encode(),
                           headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body if not isinstance(body, bytes) else "bytes", r.text)
            err = r.json()["error"]
            assert err["message"] and "Traceback" not in r.text
        assert c.get("/health").json()["status"] == "ok"
    assert sum(statuses.values()) == 1200 and statuses.get(400, 0) > 1000


@pytest.fixture(scope="module")
def budget_team(m1_cache):
    """The fuzz's team: synth_teacher with a prompt budget (limits.max_prompt_tokens), so long prompts meet a limit."""
    from tests import serve_fuzz

    return make_team(load_team(serve_fuzz.TEAM, serve_fuzz.SETS))


def test_an_overlong_or_invalid_question_is_a_4xx_and_its_batch_mates_are_answered(world, budget_team):
    """A prompt over a limit does not fail its whole batch: it is a 400 naming the tokens needed and the
    limit, and the question batched with it is answered; a text over --max-text-kb is a 413 before any model
    tokenizes it; a question that `check_question` (m1 infer's validation) rejects is a 400 naming the field."""
    from tests import serve_fuzz

    folder, _, qs = world
    app = create_app(budget_team, Limits(allowed_roots=[Path(folder).resolve()], gather_s=0.5,
                                         max_text_chars=300_000))
    long = {"question": "Is the red square left of the blue circle at the start? " * 600, "options": ["yes", "no"],
            "task": "mcq"}
    with TestClient(app, raise_server_exceptions=False) as c:
        got = {}
        threads = [threading.Thread(target=lambda k=k, b=b: got.__setitem__(k, c.post("/v1/chat/completions", json=b)))
                   for k, b in (("ok", _body(qs[0], **_extra(qs[0]))), ("long", _body(qs[1], m1=long)))]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert got["ok"].status_code == 200, got["ok"].text
        assert got["long"].status_code == 400, got["long"].text
        msg = got["long"].json()["error"]["message"]
        assert re.match(r"prompt too long: agent '\w+', phase plan, question '\w+': the prompt is \d+ tokens, over "
                        rf"limits.max_prompt_tokens={serve_fuzz.BUDGET} ", msg), msg
        assert max(app.state.batcher.batches) == 2  # the two ran as one batch
        r = c.post("/v1/chat/completions", json=_body(qs[0], m1={**long, "question": "x" * 300_001}))
        assert r.status_code == 413 and "the question text is 300006 characters: at most 300000 (--max-text-kb)" \
            in r.json()["error"]["message"], r.text
        r = c.post("/v1/chat/completions", json=_body(qs[0], m1={"question": "Which?", "options": ["one"]}))
        assert r.status_code == 400 and r.json()["error"]["message"] == \
            "invalid question: field 'options': an mcq question needs at least 2 options, got 1", r.text


def test_a_client_that_hangs_up_mid_body_is_one_log_line(world, team, caplog, capfd):
    """A client gone before its body is complete is one warning line, not an internal error with a traceback (nor
    counted as a 500), and the server goes on answering."""
    from tests import serve_fuzz

    folder, _, qs = world
    body = json.dumps(_body(qs[0], **_extra(qs[0]))).encode()
    with _Server(create_app(team, Limits(allowed_roots=[Path(folder).resolve()]))) as srv:
        assert serve_fuzz.post(srv.port, body[:40], length=len(body), hang_up=True) == (None, "")
        for _ in range(100):
            if any("hung up" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.05)
        assert serve_fuzz.post(srv.port, body)[0] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "m1.serve"]
    assert len(lines) == 1 and re.fullmatch(r"client 127.0.0.1 hung up after \d+ bytes of its body; request dropped",
                                            lines[0]), lines
    out = capfd.readouterr()
    assert "Traceback" not in out.err + out.out and "Exception in ASGI" not in out.err + out.out


def test_fuzz_bodies_over_a_socket_never_give_a_5xx(world, budget_team, caplog, capfd):
    """Random JSON, wrong types, over-long prompts (a 400 naming the budget), texts over the limit (413), invalid
    questions, truncated bodies, lying Content-Lengths and clients that hang up mid-body, over a real socket: never
    a 5xx, never a traceback, and the server still healthy. M1_FUZZ_BODIES (default 300) sets the count and
    M1_FUZZ_BIG=1 adds 10-60 MB bodies; `python tests/serve_fuzz.py --bodies 2000 --big` runs it against `m1 serve`
    in its own process and reports the server's peak memory (docs/serving.md)."""
    from tests import serve_fuzz

    folder, _, qs = world
    n = int(os.environ.get("M1_FUZZ_BODIES", "300"))
    app = create_app(budget_team, Limits(allowed_roots=[Path(folder).resolve()], gather_s=0.0))
    with _Server(app) as srv:
        result = serve_fuzz.fuzz(srv.port, Path(qs[0].video).resolve().as_uri(), n,
                                 big=os.environ.get("M1_FUZZ_BIG") == "1")
    assert not result["failures"], result["failures"][:5]
    assert result["health"]["status"] == "ok" and sum(sum(v.values()) for v in result["statuses"].values()) == n
    assert {"over_long", "over_text_limit", "hang_up", "truncated", "invalid_question", "valid"} <= \
        set(result["statuses"]), result["statuses"]
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
    out = capfd.readouterr()
    assert "Traceback" not in out.err + out.out


@pytest.mark.slow
def test_sigterm_finishes_the_request_in_flight_then_exits_and_the_key_is_never_logged(world, tmp_path):
    import signal
    import subprocess
    import sys

    import httpx

    folder, _, qs = world
    q = qs[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, M1_TEST_KEY="k3y-never-logged")
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "m1", "serve", "--team", "synth_teacher", "--port", str(port),
                                 "--allowed-media-root", str(folder), "--api-key-env", "M1_TEST_KEY",
                                 "--gather-ms", "1500", *sum((["--set", o] for o in NO_CLIP), [])],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": "Bearer k3y-never-logged"}
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            raise AssertionError(log.read_text())
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("r", httpx.post(
            f"{url}/v1/chat/completions", json=_body(q, **_extra(q)), headers=auth, timeout=60)))
        t.start()
        time.sleep(0.5)  # the request waits in the gather window
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert got["r"].status_code == 200, got["r"].text
        assert proc.wait(60) in (-signal.SIGTERM, 143)  # uvicorn re-raises the signal once drained: $? = 143
        with pytest.raises(httpx.TransportError):
            httpx.post(f"{url}/v1/chat/completions", json=_body(q), headers=auth, timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "k3y-never-logged" not in log.read_text()


def test_uploads_leave_nothing_behind_and_traces_are_bounded(world, cfg, tmp_path):
    """Memory does not grow with each request: an uploaded video's reader, frames and CLIP rows are
    dropped once it is answered, and the trace pages are kept compressed, without token ids, within a byte bound."""
    from m1.serve.app import TraceStore

    folder, _, qs = world
    team = make_team(cfg)
    client = _client(team, allowed_roots=[Path(folder).resolve()])
    data = "data:video/mp4;base64," + base64.b64encode(Path(qs[0].video).read_bytes()).decode()
    for q in qs[:3]:
        r = client.post("/v1/chat/completions", json=_body(q, url=data, **_extra(q)))
        assert r.status_code == 200, r.text
        assert client.get(r.json()["m1"]["trace_url"].split("testserver", 1)[1]).status_code == 200
    r = client.post("/v1/chat/completions", json=_body(qs[0], **_extra(qs[0])))  # a file:// video stays cached
    assert r.status_code == 200, r.text
    assert list(team.pool.readers) == [str(Path(qs[0].video).resolve())]
    assert {path for path, _ in team.pool.cache._items} == {str(Path(qs[0].video).resolve())}
    store = client.app.state.traces
    assert len(store) == 4 and store.nbytes < 200_000
    episode = store.get(next(iter(store._items)))
    assert all(g.prompt_ids is None and g.logprobs is None for g in episode.generations)

    small = TraceStore(count=10, max_bytes=3 * len(zlib_size(episode)))
    for k in range(6):
        small.add(str(k), episode)
    assert len(small) == 3 and small.nbytes <= small.max_bytes and small.get("0") is None and small.get("5")


def zlib_size(episode) -> bytes:
    import zlib

    lean = {"generations": {"__all__": {"prompt_ids", "completion_ids", "logprobs"}}}
    return zlib.compress(episode.model_dump_json(exclude=lean).encode(), 6)


@pytest.mark.slow
def test_sigint_answers_what_is_in_flight_and_exits_130(world, tmp_path):
    """SIGINT (Ctrl-C) stops the server with exit 130, as docs/serving.md says, and the log says so."""
    import signal
    import subprocess
    import sys

    import httpx

    folder, _, _ = world
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "m1", "serve", "--team", "synth_teacher", "--port", str(port),
                                 "--allowed-media-root", str(folder), *sum((["--set", o] for o in NO_CLIP), [])],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            raise AssertionError(log.read_text())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped by SIGINT" in log.read_text()


def test_an_upload_onto_a_full_temp_folder_is_a_507_and_one_log_line(world, team, tmp_path, monkeypatch, caplog):
    """A `data:` upload when the server's TMPDIR is full is no 500 and no ASGI traceback in the log: the client
    gets 507 (nothing of the server's paths), the log one line naming the folder and TMPDIR, and no temp folder is
    left behind; once there is room the same request is answered."""
    import logging
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a full file system is a tmpfs mount, which needs root (as in CI)")
    full = tmp_path / "tmp"
    full.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(full)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        import tempfile

        folder, _, qs = world
        with open(full / "filler", "wb", buffering=0) as f:  # the temp folder's disk filled by someone else
            try:
                while True:
                    f.write(b"x" * 1024)
                    f.flush()
            except OSError:
                pass
        monkeypatch.setattr(tempfile, "tempdir", str(full))
        data = "data:video/mp4;base64," + base64.b64encode(Path(qs[0].video).read_bytes()).decode()
        with _client(team, allowed_roots=[Path(folder).resolve()]) as c, caplog.at_level(logging.ERROR, "m1.serve"):
            r = c.post("/v1/chat/completions", json=_body(qs[0], url=data, **_extra(qs[0])))
            assert r.status_code == 507, r.text
            assert r.json()["error"]["message"] == "the server has no room to store the upload; try again later"
            lines = [x.getMessage() for x in caplog.records]
            assert len(lines) == 1 and str(full) in lines[0] and "TMPDIR" in lines[0], lines
            assert not any(x.exc_info for x in caplog.records) and [p.name for p in full.iterdir()] == ["filler"]
            monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # room again
            r = c.post("/v1/chat/completions", json=_body(qs[0], url=data, **_extra(qs[0])))
            assert r.status_code == 200, r.text
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)

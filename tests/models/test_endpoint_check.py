"""The start-up check of a team's OpenAI-compatible endpoints (m1/models/preflight.py `check_endpoints`): a wrong URL,
a rejected key, a model the server does not serve or a text-only model in a vision role is named, one line per
problem with the role, URL and model and never the key, before `m1 infer` asks any question. Against the scripted
stand-in server of tests/models/test_openai_backend.py."""
import pytest
import yaml

from m1.config import TeamConfig
from m1.models.preflight import check_endpoints
from m1.models.vllm_server import free_port
from tests.models.test_openai_backend import KEY_ENV, SECRET, key_env, servers  # noqa: F401 - fixtures

BROWSE_TOOLS = ["Global Sampling", "Rough Browser", "Fine Browser", "Grounding Tool"]


def _team(chat_url, vision_url=None, chat="served-model", vision="served-vlm", **vision_kw) -> dict:
    """Two cpp agents on one chat model and a browse model, both of backend openai."""
    models = {"agent": {"interface": "chat", "backend": "openai", "path": chat, "base_url": chat_url,
                        "api_key_env": KEY_ENV, "timeout": 5.0},
              "browser": {"interface": "vision", "backend": "openai", "path": vision, "base_url": vision_url or chat_url,
                          "api_key_env": KEY_ENV, "timeout": 5.0, **vision_kw}}
    return {"name": "t", "models": models,
            "agents": [{"name": "a1", "model": "agent"}, {"name": "a2", "model": "agent"}],
            "tools": {"browser": "browser", "enabled": BROWSE_TOOLS}}


def _problems(team: dict) -> list[str]:
    checks = check_endpoints(TeamConfig(**team))
    lines = [c.line() for c in checks]
    assert all(SECRET not in line for line in lines), lines
    return [c.line() for c in checks if c.status != "ok"]


def _no_images(body):
    """A text-only model: any image part is refused, as vLLM does."""
    parts = body["messages"][-1]["content"]
    if not isinstance(parts, str) and any(p["type"] == "image_url" for p in parts):
        return 400, {}, f"{body['model']} is not a multimodal model; image input is not supported"
    return None


def test_all_good_gives_ok_rows_and_one_listing_per_endpoint(servers, key_env):
    srv = servers(served=["served-model", "served-vlm"], key=SECRET)
    checks = check_endpoints(TeamConfig(**_team(srv.url)))
    assert [(c.key, c.status) for c in checks] == [("agent", "ok"), ("browser", "ok")]
    assert checks[0].roles == ("agent a1", "agent a2")
    assert checks[1].roles == ("Rough Browser", "Fine Browser", "Grounding Tool")
    assert checks[1].why == "served; takes images"
    assert f"served-vlm at {srv.url}" in checks[1].line()
    [probe] = srv.bodies  # the chat model is only listed; the vision model gets one image and one token
    assert probe["model"] == "served-vlm" and probe["max_tokens"] == 1
    assert [p["type"] for p in probe["messages"][-1]["content"]] == ["text", "image_url", "text"]
    assert set(srv.auth) == {f"Bearer {SECRET}"}


def test_video_url_model_gets_an_mp4_too(servers, key_env):
    srv = servers(served=["served-model", "served-vlm"])
    checks = check_endpoints(TeamConfig(**_team(srv.url, video_input="video_url")))
    assert [(c.key, c.status, c.why) for c in checks][1] == ("browser", "ok", "served; takes images and video")
    assert [v["frames"] for v in srv.videos] == [4]  # the stand-in decoded the probe clip

    refusing = servers(served=["served-model", "served-vlm"],
                       per_request=lambda b: (400, {}, "video input is not supported by this model")
                       if any(p["type"] == "video_url" for p in b["messages"][-1]["content"]) else None)
    [line] = _problems(_team(refusing.url, video_input="video_url"))
    assert "does not accept video (video_input: video_url, video_transport: data): HTTP 400: video input is not " \
           "supported" in line


def test_video_file_transport_outside_the_servers_media_root(servers, key_env, tmp_path):
    """The probe clip goes the way the run's clips go: a file under video_root the server must be allowed to read."""
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    srv = servers(served=["served-model", "served-vlm"], media_root=allowed)
    kw = dict(video_input="video_url", video_transport="file")
    assert _problems(_team(srv.url, video_root=str(allowed), **kw)) == []
    [line] = _problems(_team(srv.url, video_root=str(other), **kw))
    assert "does not accept video (video_input: video_url, video_transport: file): HTTP 400: Cannot load local " \
           "files without --allowed-local-media-path" in line
    assert list(allowed.iterdir()) == [] and list(other.iterdir()) == []  # probe clips removed


def test_nothing_listening_is_unreachable_for_each_model(key_env):
    url = f"http://127.0.0.1:{free_port()}/v1"
    lines = _problems(_team(url))
    assert len(lines) == 2
    assert lines[0].startswith(f"model 'agent' (served-model at {url}, agent a1 + agent a2): unreachable (")
    assert lines[1].startswith(f"model 'browser' (served-vlm at {url}, Rough Browser + Fine Browser + Grounding "
                               f"Tool): unreachable (")
    assert all("Connection refused" in line and "is base_url right?" in line for line in lines)


def test_unknown_model_names_what_is_served(servers, key_env):
    srv = servers(served=["served-model", "Qwen/Qwen2.5-VL-7B-Instruct", "other"])
    [line] = _problems(_team(srv.url, vision="Qwen/Qwen2.5-VL-7b-instruct"))
    assert line == (f"model 'browser' (Qwen/Qwen2.5-VL-7b-instruct at {srv.url}, Rough Browser + Fine Browser + "
                    "Grounding Tool): model 'Qwen/Qwen2.5-VL-7b-instruct' is not served there; served: served-model, "
                    "Qwen/Qwen2.5-VL-7B-Instruct, other")
    assert srv.bodies == []  # a model not served is not probed


def test_bad_key_is_named_by_its_variable_never_shown(servers, key_env, monkeypatch):
    srv = servers(served=["served-model", "served-vlm"], key="sk-the-right-one")
    lines = _problems(_team(srv.url))
    assert len(lines) == 2
    assert all(f"key rejected (env {KEY_ENV}): HTTP 401: Incorrect API key provided" in line for line in lines)
    assert srv.auth == []  # POST never reached: only GET /models was asked (and refused)

    # a server that quotes the key back: scrubbed
    echo = servers(served=["served-model", "served-vlm"], per_request=lambda b: (403, {}, f"key {SECRET} revoked"))
    [line] = _problems(_team(echo.url))
    assert "does not accept images" in line and "key *** revoked" in line

    # no key in the environment for a local URL: the placeholder goes, and the server wants a real one
    monkeypatch.delenv(KEY_ENV)
    lines = _problems(_team(srv.url))
    assert all(f"key rejected (env {KEY_ENV} is not set, and the server asks for a key): HTTP 401" in line
               for line in lines)
    # ... and without a base_url at all the backend's own refusal is kept, with nothing asked
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    team = _team(srv.url)
    del team["models"]["agent"]["base_url"]
    [line, _] = _problems(team)
    assert line.startswith("model 'agent' (served-model at https://api.openai.com/v1, agent a1 + agent a2): no API "
                           f"key: the environment variable {KEY_ENV} is not set")


def test_text_only_model_in_the_vision_role(servers, key_env):
    srv = servers(served=["served-model", "served-vlm"], per_request=_no_images)
    [line] = _problems(_team(srv.url, vision="served-model"))  # the browse tool given the chat model
    assert line == (f"model 'browser' (served-model at {srv.url}, Rough Browser + Fine Browser + Grounding Tool): "
                    "does not accept images (a text-only model in the vision role?): HTTP 400: served-model is not a "
                    "multimodal model; image input is not supported")


def test_probes_are_shared_and_a_busy_server_only_warns(servers, key_env):
    srv = servers(served=["served-model", "served-vlm"], per_request=lambda b: (503, {}, "loading"))
    team = _team(srv.url)
    team["models"]["grounder"] = dict(team["models"]["browser"])
    team["tools"]["grounding"] = "grounder"
    checks = check_endpoints(TeamConfig(**team))
    assert [(c.key, c.status) for c in checks] == [("agent", "ok"), ("browser", "unchecked"),
                                                   ("browser", "ok"), ("grounder", "unchecked"), ("grounder", "ok")]
    assert "not checked whether it takes images: HTTP 503: loading" in checks[1].why
    assert checks[2].why == "served"  # not "takes images": that was not checked
    assert checks[3].roles == ("Grounding Tool",)
    assert len(srv.bodies) == 1  # one served model, one endpoint: asked once


def test_a_team_without_api_models_asks_nothing(monkeypatch):
    from m1.config import load_team

    def refuse(*a, **k):
        raise AssertionError("no client may be built")

    import openai
    monkeypatch.setattr(openai, "OpenAI", refuse)
    assert check_endpoints(load_team("tiny")) == []


def test_infer_stops_before_any_question_on_a_wrong_url(tmp_path, video_factory, key_env, servers):
    from typer.testing import CliRunner

    from m1.cli import app

    srv = servers(served=["served-model", "served-vlm"])
    dead = f"http://127.0.0.1:{free_port()}/v1"
    team = tmp_path / "team.yaml"
    team.write_text(yaml.safe_dump(_team(srv.url, vision_url=dead)))
    video_factory("v.mp4", seconds=2)
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(app, ["infer", str(tmp_path), "-q", "What happens?", "--team", str(team),
                                      "--out", str(out)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith(f"error: model 'browser' (served-vlm at {dead}, ")
    assert "unreachable (" in lines[0] and SECRET not in result.output
    assert not out.exists() and srv.bodies == []  # no question was asked of the good endpoint either


def test_a_server_that_never_answers_is_unreachable_within_the_timeout(key_env):
    import socket
    import time

    with socket.socket() as silent:  # accepts connections (the backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        team = _team(url)
        team["models"]["agent"]["timeout"] = 0.5
        t0 = time.monotonic()
        lines = _problems(team)
        assert time.monotonic() - t0 < 5
    assert len(lines) == 2 and all("unreachable (no answer within 0.5 s)" in line for line in lines)


def test_serve_stops_before_listening_on_a_wrong_url(tmp_path, key_env, servers, monkeypatch):
    """`m1 serve` runs the same start-up check: a hosted team with a dead endpoint never opens its port."""
    pytest.importorskip("fastapi")
    import uvicorn
    from typer.testing import CliRunner

    from m1.cli import app

    srv = servers(served=["served-model", "served-vlm"])
    dead = f"http://127.0.0.1:{free_port()}/v1"
    team = tmp_path / "team.yaml"
    team.write_text(yaml.safe_dump(_team(srv.url, vision_url=dead)))
    started = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: started.append(a))
    result = CliRunner().invoke(app, ["serve", "--team", str(team), "--port", str(free_port())])
    assert result.exit_code == 2 and started == [], result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: model 'browser' (served-vlm at {dead}, ")
    assert SECRET not in result.output

"""A served M1 team as one agent of another team (m1/team/member.py, m1/models/served_team.py: teams
of teams): an in-process `m1 serve` of the rule-based synth team answers for agent `panel` of a team with two local
agents; its answers are the served team's own, counted in the vote and the summarizer's notes, traced and metered; a
refused question or an unreadable reply is the agent's format failure, a dead endpoint error rows."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.conftest import make_synth_world

pytest.importorskip("fastapi")
from tests.fakes import FakeChat, content, scripted_reply  # noqa: E402
from tests.serve.test_serve import NO_CLIP, _Server  # noqa: E402

from m1.config import TeamConfig, load_team  # noqa: E402
from m1.models.base import Completion  # noqa: E402
from m1.run import run_questions  # noqa: E402
from m1.schema import AgentAnswer  # noqa: E402
from m1.serve import Limits, create_app  # noqa: E402
from m1.team import aggregate  # noqa: E402
from m1.team.engines_registry import make_team  # noqa: E402

SECRET = "sk-test-member-key-do-not-print"

TEAM_YAML = """
name: with_panel
models:
  q3: {{interface: chat, backend: hf, device: cpu,
        tiny: {{arch: qwen3, hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, seed: 2}}}}
  q2: {{interface: chat, backend: hf, device: cpu,
        tiny: {{arch: qwen2, hidden_size: 32, layers: 1, heads: 2, kv_heads: 1, seed: 4}}}}
  vision: {{interface: vision, backend: synth}}
  clip: {{interface: clip, backend: open_clip, tiny: {{arch: open_clip}}, device: cpu}}
  # the served team: m1 serve's model name, its URL; each question's video sent as a file:// URL it may read
  panel: {{interface: team, backend: openai, path: synth_teacher, base_url: "{url}", api_key_env: M1_TEST_PANEL_KEY,
          video_input: video_url, video_transport: {transport}, max_retries: 0, timeout: 60}}
agents:
  - {{name: local_a, model: q3}}
  - {{name: local_b, model: q2}}
  - {{name: panel, model: panel}}
tools: {{clip: clip, browser: vision}}
limits: {{max_turns: 2, max_tool_calls: 2, plan_tokens: 24, comm_tokens: 12, answer_tokens: 16, summary_tokens: 16,
         batch_episodes: 16}}
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, m1_cache):
    return make_synth_world(tmp_path_factory.mktemp("synth"), videos=2, seed=7, duration=40, questions_per_video=7)


@pytest.fixture(scope="module")
def served(world):
    """(base_url, {question id: the served team's own episode}): m1 serve of the synth team, on a real socket."""
    folder, _, qs = world
    team = make_team(load_team("synth_teacher", NO_CLIP))
    own = {ep.id: ep for ep in team.run(qs)}  # what the team answers on its own, before it serves
    assert all(ep.final_answer for ep in own.values())
    with _Server(create_app(team, Limits(allowed_roots=[Path(folder).resolve()], gather_s=0.05))) as srv:
        yield f"http://127.0.0.1:{srv.port}/v1", own


def _cfg(tmp_path, url, transport="file") -> TeamConfig:
    path = tmp_path / "with_panel.yaml"
    path.write_text(TEAM_YAML.format(url=url, transport=transport))
    return load_team(str(path))


def _rows(path) -> dict:
    return {r["id"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def _by_question(qs, answer_for):
    """A scripted local agent: plans like `scripted_reply`, answers `answer_for(question)` for the question it sees."""
    def reply(messages):
        text = content(messages)
        if "##Answer" in text and "##Final Answer" not in text:
            q = next(q for q in qs if q.text in text and q.options_block() in text)
            return f"##Answer: {answer_for(q)} ##Reason: scripted"
        return scripted_reply(messages)
    return reply


def test_served_team_is_one_agent_of_a_team_with_local_agents(world, served, tmp_path, monkeypatch):
    monkeypatch.setenv("M1_TEST_PANEL_KEY", SECRET)
    url, own = served
    _, _, qs = world
    cfg = _cfg(tmp_path, url)
    assert cfg.served_teams == ["panel"] and cfg.summarizer == "local_a"
    summary = run_questions(cfg, qs, tmp_path / "r.jsonl", trace_dir=tmp_path / "traces", progress=False)
    assert not summary.errors and summary.answered == len(qs)
    rows = _rows(tmp_path / "r.jsonl")
    for q in qs:
        row, ep = rows[q.id], own[q.id]
        panel = row["agents"]["panel"]
        assert (panel["answer"], panel["reason"], panel["parse_ok"]) == (ep.final_answer, ep.final_reason, True), q.id
        assert "plan" not in panel and "plan" in row["agents"]["local_a"]  # it plans nothing here
        assert row["usage"]["panel"]["model"] == "synth_teacher" and row["usage"]["panel"]["calls"] == 1
        assert row["usage"]["panel"]["prompt_tokens"] > 0
        trace = json.loads((tmp_path / "traces" / f"{q.id}.json").read_text())
        gens = [g for g in trace["generations"] if g["agent"] == "panel"]
        assert [g["phase"] for g in gens] == ["answer"] and gens[0]["completion"] == ep.final_answer
        assert gens[0]["prompt"][0]["content"][0]["video_url"]["url"] == Path(q.video).resolve().as_uri()
        if row["aggregation"] == "vote":  # the team's vote is over all three agents' answers, the panel's included
            answers = [AgentAnswer(agent=a, answer=v["answer"]) for a, v in row["agents"].items()]
            assert row["answer"] == aggregate.vote(answers, ["local_a", "local_b", "panel"]).answer
    assert SECRET not in (tmp_path / "r.jsonl").read_text()


def test_the_vote_counts_the_served_team_and_the_summarizer_reads_it(world, served, tmp_path, monkeypatch):
    """Local agents scripted to split 1-1 on every question: the served team's answer breaks the tie."""
    monkeypatch.setenv("M1_TEST_PANEL_KEY", SECRET)
    url, own = served
    _, _, qs = world
    team = make_team(_cfg(tmp_path, url, transport="data"))  # the video inlined as a data URL this time
    closed = [q for q in qs if q.task in ("mcq", "numeric")]
    other = {q.id: ("A" if own[q.id].final_answer != "A" else "B") if q.task == "mcq" else
             str(int(float(own[q.id].final_answer)) + 1) for q in closed}
    team.hub.register("q3", FakeChat("q3", _by_question(qs, lambda q: own[q.id].final_answer)))
    team.hub.register("q2", FakeChat("q2", _by_question(qs, lambda q: other.get(q.id, "something else"))))
    eps = {ep.id: ep for ep in team.run(qs)}
    assert closed, "the synth world has closed questions"
    for q in closed:
        ep = eps[q.id]
        assert ep.aggregation == "vote" and ep.final_answer == own[q.id].final_answer, q.id
        assert aggregate.vote(ep.answers, team.order).counts == {own[q.id].final_answer: 2, other[q.id]: 1}
    for q in [q for q in qs if q.task in ("open", "grounding")]:  # the summarizer (local_a) reads the panel's answer
        summary = next(g for g in eps[q.id].generations if g.phase == "summary")
        assert summary.agent == "local_a" and own[q.id].final_answer in content(summary.prompt)
    sent = next(g for g in eps[qs[0].id].generations if g.agent == "panel").prompt[0]["content"][0]
    assert sent["video_url"]["url"].startswith("data:video/...;base64 (")  # traced without the bytes


def test_a_refused_question_or_unreadable_reply_is_a_format_failure(world, served, tmp_path, monkeypatch):
    monkeypatch.setenv("M1_TEST_PANEL_KEY", SECRET)
    url, own = served
    _, _, qs = world
    outside = tmp_path / "elsewhere" / "v.mp4"  # a copy the server may not read: a 400 for that question only
    outside.parent.mkdir()
    shutil.copy(qs[0].video, outside)
    asked = [qs[0].model_copy(update={"id": "outside", "video": str(outside)}), qs[1]]
    team = make_team(_cfg(tmp_path, url))
    for key in ("q3", "q2"):
        team.hub.register(key, FakeChat(key, scripted_reply))
    eps = {ep.id: ep for ep in team.run(asked)}
    bad, good = eps["outside"], eps[qs[1].id]
    panel = next(a for a in bad.answers if a.agent == "panel")
    assert bad.error is None and bad.final_answer and not panel.parse_ok and panel.answer == ""
    assert "HTTP 400" in panel.reason and "outside the allowed media roots" in panel.reason
    assert next(g for g in bad.generations if g.agent == "panel").parse_ok is False
    assert next(a for a in good.answers if a.agent == "panel").answer == own[qs[1].id].final_answer

    class Garbled:  # a server whose replies are no answer to the question
        def ask(self, questions, params):
            return [Completion(text="a shrug", meta={"prompt": [], "reason": "?"}) for _ in questions]

    team.hub.register("panel", Garbled(), interface="team")
    ep = team.run([q for q in qs if q.task == "mcq"][:1])[0]
    panel = next(a for a in ep.answers if a.agent == "panel")
    assert ep.error is None and not panel.parse_ok and panel.answer == ""
    gen = next(g for g in ep.generations if g.agent == "panel")
    assert gen.completion == "a shrug" and gen.parse_error


def test_a_dead_endpoint_gives_error_rows_naming_the_agent_and_url_not_the_key(world, tmp_path, monkeypatch):
    import socket

    monkeypatch.setenv("M1_TEST_PANEL_KEY", SECRET)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, _, qs = world
    cfg = _cfg(tmp_path, f"http://127.0.0.1:{port}/v1")
    team = make_team(cfg)
    for key in ("q3", "q2"):
        team.hub.register(key, FakeChat(key, scripted_reply))
    summary = run_questions(cfg, qs, tmp_path / "r.jsonl", team=team, progress=False)  # no exception
    rows = _rows(tmp_path / "r.jsonl")
    assert len(summary.errors) == len(qs) and set(rows) == {q.id for q in qs}
    for row in rows.values():
        assert row["answer"] is None and "agent 'panel' (a served team)" in row["error"]
        assert f"127.0.0.1:{port}/v1" in row["error"] and "failed after 1 attempt(s)" in row["error"]
    assert SECRET not in (tmp_path / "r.jsonl").read_text()


def test_team_model_config():
    base = {"name": "t", "models": {"c": {"interface": "chat", "backend": "synth"},
                                    "v": {"interface": "vision", "backend": "synth"},
                                    "p": {"interface": "team", "backend": "openai", "path": "mini",
                                          "base_url": "http://h/v1", "video_input": "video_url"}},
            "agents": [{"name": "panel", "model": "p"}, {"name": "a", "model": "c"}],
            "tools": {"browser": "v", "enabled": ["Global Sampling", "Rough Browser"]}}
    cfg = TeamConfig.model_validate(base)
    assert cfg.served_teams == ["panel"] and cfg.summarizer == "a"  # the first agent that can summarize

    def refused(change: dict, models: dict | None = None) -> str:
        data = {**base, **change, "models": {**base["models"], **(models or {})}}
        with pytest.raises(ValidationError) as err:
            TeamConfig.model_validate(data)
        return str(err.value)

    assert "video_input: video_url" in refused({}, {"p": {"interface": "team", "backend": "openai", "path": "mini"}})
    assert "backend openai" in refused({}, {"p": {"interface": "team", "backend": "hf", "path": "x",
                                                  "video_input": "video_url"}})
    assert "video_root" in refused({}, {"p": {**base["models"]["p"], "video_transport": "file", "video_root": "/x"}})
    assert "writes no summaries" in refused({"aggregation": {"summarizer": "panel"}})
    assert "team model, vision needed" in refused({"tools": {**base["tools"], "browser": "p"}})
    TeamConfig.model_validate({**base, "models": {**base["models"], "p": {**base["models"]["p"],
                                                                        "video_transport": "file"}}})
    from m1.marl.rollout.episodes import training_team_config

    with pytest.raises(ValueError, match="agent 'panel' is a served team"):  # nothing here could train it
        training_team_config(cfg, 1.0)


def test_a_team_of_served_teams_only_needs_no_summarizer(world):
    """Nobody local writes summaries: open and grounding answers fall back to the vote rule / median span."""
    _, _, qs = world
    cfg = TeamConfig.model_validate({
        "name": "panels", "models": {"v": {"interface": "vision", "backend": "synth"},
                                     **{k: {"interface": "team", "backend": "openai", "path": "t", "base_url": "http://h/v1",
                                            "video_input": "video_url"} for k in ("p1", "p2")}},
        "agents": [{"name": "one", "model": "p1"}, {"name": "two", "model": "p2"}],
        "tools": {"browser": "v", "enabled": ["Global Sampling", "Rough Browser"]}})

    class Served:
        def __init__(self, tag):
            self.tag, self.model_name = tag, "t"

        def ask(self, questions, params):
            used = {"prompt_tokens": 3, "completion_tokens": 1}
            return [Completion(text={"mcq": "B", "grounding": f"[1 - {self.tag}]"}.get(q.task, f"thing {self.tag}"),
                               meta={"prompt": [], "reason": "r", "usage": used}) for q in questions]

    team = make_team(cfg)
    team.hub.register("p1", Served(3), interface="team")
    team.hub.register("p2", Served(5), interface="team")
    for q, ep in zip(qs, team.run(qs)):
        assert ep.error is None and not [g for g in ep.generations if g.phase != "answer"]
        assert ep.usage == {a: {"model": "t", "calls": 1, "prompt_tokens": 3, "completion_tokens": 1}
                            for a in ("one", "two")}
        want = {"mcq": "B", "grounding": "[1 - 4]", "open": "thing 3"}[q.task]
        assert ep.final_answer == want, (q.task, ep.aggregation)

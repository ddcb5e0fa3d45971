"""End to end on generated videos with the real tiny team: random Qwen2/Qwen3 agents, a tiny
Qwen2.5-VL browser and a tiny open_clip, all built offline. Answers are meaningless; the
pipeline, the records and the batching are what is checked."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_video
from m1.config import load_team
from m1.schema import Episode, Question

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    for i in range(3):
        make_video(d / f"clip{i}.mp4", seconds=10 + 5 * i, fps=4, size=64)
    good = (d / "clip0.mp4").read_bytes()
    (d / "truncated.mp4").write_bytes(good[: len(good) // 2])
    (d / "notes.mp4").write_text("these are my notes, not a video\n" * 20)
    return d


def test_tiny_team_full_episode(folder, m1_cache):
    from m1.team.cpp import Team

    cfg = load_team("tiny")
    team = Team(cfg)
    qs = [Question(id="a", video=str(folder / "clip1.mp4"), text="What colour is the square?",
                   options=["white", "red", "blue", "green"], task="mcq"),
          Question(id="b", video=str(folder / "clip2.mp4"), text="When does the square appear?", task="grounding")]
    eps = team.run(qs)
    chat_models = {team.hub.chat(a.model) for a in cfg.agents}
    assert len(chat_models) == 4
    for e in eps:
        assert e.error is None
        assert set(e.memory) == {a.name for a in cfg.agents}
        for name, rec in e.memory.items():
            assert len(rec.plan) >= 2 and rec.turns and rec.answer is not None
            assert rec.turns[0].tool in ("Global Sampling", "Video Retrieval", "Time Stamp Retrieval",
                                         "Image Retrieval")
        for g in e.generations:
            assert g.prompt_ids and g.completion_ids is not None and len(g.logprobs) == len(g.completion_ids)
        back = Episode.model_validate(json.loads(e.model_dump_json()))
        assert back == e
    # every phase: one generate call per distinct chat model for both episodes
    plan_calls = {m.name: m.calls for m in chat_models}
    assert all(c >= 2 for c in plan_calls.values())


def _infer(folder, out, extra=(), env_extra=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "m1", "infer", str(folder), *extra, "--out", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_infer_folder_reports_bad_files(folder, tmp_path, m1_cache):
    out = tmp_path / "res.jsonl"
    p = _infer(folder, out, ["--question", "What colour is the square?", "--options", "white",
                             "--options", "red", "--team", "tiny", "--trace-dir", str(tmp_path / "traces")])
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 1, stderr  # two error rows: exit 1 (docs/cli.md)
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == ["clip0", "clip1", "clip2", "notes", "truncated"]
    for i in range(3):
        r = by_id[f"clip{i}"]
        assert r["error"] is None and set(r["agents"]) == {"qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small"}
        assert r["frames_used"] > 0 and r["seconds"] > 0
    for bad in ("notes", "truncated"):
        assert by_id[bad]["error"] and f"{bad}.mp4" in by_id[bad]["error"]
    assert "3 answered" in stdout and "2 errors" in stdout
    traces = tmp_path / "traces"
    assert (traces / "clip0.json").exists() and (traces / "clip0.html").exists()


def test_sigkill_then_resume_lists_each_id_once(folder, tmp_path, m1_cache):
    qfile = tmp_path / "q.jsonl"
    ids = [f"q{i:02d}" for i in range(10)]
    qfile.write_text("".join(json.dumps({"id": i, "video": f"clip{n % 3}.mp4", "text": "Which colour?",
                                         "options": ["white", "red"], "task": "mcq"}) + "\n"
                             for n, i in enumerate(ids)))
    out = tmp_path / "res.jsonl"
    args = ["--questions", str(qfile), "--team", "tiny", "--set", "limits.batch_episodes=2"]
    p = _infer(folder, out, args)
    deadline = time.time() + 400
    while time.time() < deadline and p.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert p.poll() is None, "run finished before it could be killed; make it longer"
    p.send_signal(signal.SIGKILL)
    p.wait()
    partial = out.read_text().splitlines()
    assert 2 <= len(partial) < 10
    p = _infer(folder, out, args)
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    got = [json.loads(l)["id"] for l in out.read_text().splitlines()]
    assert sorted(got) == ids  # each exactly once
    # resuming into the same file with another team would mix two teams' answers: refused, naming what differs
    p = _infer(folder, out, [*args[:-1], "limits.batch_episodes=3"])
    _, stderr = p.communicate(timeout=300)
    assert p.returncode == 2 and "another team" in stderr and "limits.batch_episodes" in stderr, stderr
    assert [json.loads(l)["id"] for l in out.read_text().splitlines()] == got


def test_results_record_their_team_and_weights(tmp_path):
    from m1.data.questions import InputError
    from m1.results import check_team

    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"x" * 10)
    cfg = load_team("tiny", ["models.q3_big.tiny=null", f"models.q3_big.path={weights}"])
    out = tmp_path / "res.jsonl"
    check_team(out, cfg)
    out.write_text('{"id": "a"}\n')
    check_team(out, cfg)  # the same team resumes
    (weights / "model.safetensors").write_bytes(b"y" * 11)  # retrained weights, same config
    with pytest.raises(InputError, match="weights.q3_big"):
        check_team(out, cfg)
    assert out.read_text() == '{"id": "a"}\n'  # nothing lost
    check_team(out, cfg, restart=True)  # the demo starts over instead
    assert not out.exists()
    # a LoRA adapter on top: a retrained adapter is another team too
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"a" * 10)
    with_adapter = load_team("tiny", ["models.q3_big.tiny=null", f"models.q3_big.path={weights}",
                                      f"models.q3_big.adapter={adapter}"])
    check_team(out, with_adapter)
    out.write_text('{"id": "a"}\n')
    (adapter / "adapter_model.safetensors").write_bytes(b"b" * 11)
    with pytest.raises(InputError, match="adapters.q3_big"):
        check_team(out, with_adapter)
    # a stamp cut short (a crash of an older version, a hand edit) is named, and the answers kept
    stamp = out.with_name(out.name + ".team.json")
    stamp.write_text('{"models": ')
    with pytest.raises(InputError, match=r"res\.jsonl\.team\.json: not the JSON team record"):
        check_team(out, with_adapter)
    assert out.read_text() == '{"id": "a"}\n'


def test_results_record_the_recipe_of_tiny_models(tmp_path, monkeypatch):
    """A model built from a tiny spec changes with the build recipe (or synth tokenizer) though its config does not."""
    from m1.models import tiny
    from m1.data.questions import InputError
    from m1.results import check_team

    cfg = load_team("tiny")
    out = tmp_path / "res.jsonl"
    check_team(out, cfg)
    out.write_text('{"id": "a"}\n')
    check_team(out, cfg)
    monkeypatch.setattr(tiny, "RECIPE_VERSION", tiny.RECIPE_VERSION + 1)
    with pytest.raises(InputError, match="tiny.q3_big"):
        check_team(out, cfg)
    assert out.read_text() == '{"id": "a"}\n'


def test_infer_clear_errors(folder, tmp_path):
    p = _infer(folder, tmp_path / "o.jsonl", ["--question", "x", "--team", "tiny", "--set", "limits.max_turnz=1"])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "max_turnz" in err and "tiny.yaml" in err
    p = _infer(tmp_path / "nowhere", tmp_path / "o.jsonl", ["--question", "x"])
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "nowhere" in err
    # a model that cannot be loaded is a clear error naming it, not a traceback
    p = _infer(folder, tmp_path / "o.jsonl", ["--question", "x", "--team", "tiny", "--set", "models.q3_big.tiny=null",
                                              "--set", f"models.q3_big.path={tmp_path / 'no-such-model'}"])
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2 and "q3_big" in err and "no-such-model" in err and "Traceback" not in err

"""`m1 serve` over many local files: it answers from what a file holds at the time of the request, holds a bounded
number of files open, and running out of file handles is a 503 and one log line, never a 400 that blames the video."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import holds_file_open, make_video

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from m1.config import load_team  # noqa: E402
from m1.serve import Limits, create_app  # noqa: E402
from m1.team.engines_registry import make_team  # noqa: E402
from m1.video import probe  # noqa: E402
from tests.serve.test_serve import NO_CLIP  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def team(m1_cache):
    return make_team(load_team("synth_teacher", NO_CLIP))


@pytest.fixture(scope="module")
def bounded_team(m1_cache):
    return make_team(load_team("synth_teacher", [*NO_CLIP, "limits.max_open_videos=3"]))


def _ask(client, path: Path):
    body = {"model": "synth_teacher", "max_tokens": 16, "temperature": 0.0,
            "media_io_kwargs": {"video": {"num_frames": 8}},
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": path.as_uri()}},
                                                       {"type": "text", "text": "What happens in the video?"}]}]}
    return client.post("/v1/chat/completions", json=body)


def _seen(client, reply) -> float:
    """The latest time on the video any agent looked at, from the request's trace."""
    ep = client.app.state.traces.get(reply.json()["m1"]["trace_url"].rsplit("/", 1)[1])
    return max(t for rec in ep.memory.values() for turn in rec.turns for t in turn.timestamps)


def test_a_file_replaced_under_its_name_is_answered_from_its_new_content(team, tmp_path):
    """After `cp` of a 40 s video over a 4 s one, the server answers from the 40 s video's frames, not the 4 s one's."""
    short, long = make_video(tmp_path / "short.mp4", seconds=4), make_video(tmp_path / "long.mp4", seconds=40)
    root = tmp_path / "root"
    root.mkdir()
    v = root / "v.mp4"
    shutil.copy(short, v)
    client = TestClient(create_app(team, Limits(allowed_roots=[root.resolve()])), raise_server_exceptions=False)
    first = _ask(client, v)
    assert first.status_code == 200, first.text
    assert _seen(client, first) < probe(short).duration
    shutil.copy(long, v)
    second = _ask(client, v)
    assert second.status_code == 200, second.text
    assert _seen(client, second) > probe(short).duration  # frames the 4 s video does not have


def test_many_videos_keep_open_files_bounded_and_no_handles_is_a_503(bounded_team, tmp_path, monkeypatch, caplog):
    """Readers are not kept open one per distinct video: at most limits.max_open_videos (3 here) stay open. Out of
    handles (a low `ulimit -n`), opening the video in the team or probing it is a 503 with Retry-After and one log
    line naming the setting, never `400 no such video file` or a traceback; no m1-serve-* folder is left."""
    import av

    team = bounded_team
    root = tmp_path / "root"
    root.mkdir()
    videos = [make_video(root / f"v{i}.mp4", seconds=2, fps=2, size=32) for i in range(6)]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    client = TestClient(create_app(team, Limits(allowed_roots=[root.resolve()])), raise_server_exceptions=False)
    for v in videos:
        assert _ask(client, v).status_code == 200
        assert team.pool.open_files() <= 3
    assert len(team.pool.readers) == 6 and sum(holds_file_open(r) for r in team.pool.readers.values()) <= 3

    def no_handles(*a, **k):
        raise av.error.OSError(errno.EMFILE, "Too many open files")

    fresh = make_video(root / "fresh.mp4", seconds=2, fps=2, size=32)
    with caplog.at_level(logging.WARNING, "m1.serve"):
        monkeypatch.setattr(av, "open", no_handles)  # while the request is read: its probe
        r = _ask(client, fresh)
        monkeypatch.undo()
        monkeypatch.setattr(tempfile, "tempdir", str(scratch))
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        opened = team.pool.open

        def pool_without_handles(path):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(team.pool, "open", pool_without_handles)  # while the team opens it
        r = _ask(client, fresh)
        monkeypatch.setattr(team.pool, "open", opened)
        assert r.status_code == 503 and "file handles" in r.json()["error"]["message"], r.text
    ours = [x for x in caplog.records if x.name.startswith("m1")]  # not a library's (open_clip's random-init note)
    lines = [x.getMessage() for x in ours]
    assert len(lines) == 2 and all("max_open_videos" in x for x in lines), lines
    assert not any(x.exc_info for x in ours)
    assert _ask(client, fresh).status_code == 200
    assert list(scratch.glob("m1-serve-*")) == []  # (torch may keep its own compile cache there)


@pytest.mark.slow
def test_a_short_soak_keeps_open_files_within_the_setting(tmp_path, m1_cache):
    """The soak script (benchmarks/serve_soak.py) for 40 s over 24 videos under `ulimit -n 64` with
    limits.max_open_videos=8: no request fails and the server's open files stay bounded."""
    import json
    import subprocess

    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_soak.py"), "--videos", "24", "--seconds",
                        "40", "--max-open", "8", "--nofile", "64", "--every", "10", "--json", str(out),
                        "--folder", str(tmp_path / "videos")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["requests"] >= 24
    # bounded by the pool's 8 readers plus, per client, both ends of its connection (the clients run in the server's
    # process) and the handle its request's probe holds for a moment before the team runs it (m1/serve/media.py
    # video_file); a leak grows past any such bound. Measured 19 = base 7 + 12; a CI sample can go over base + 12
    # (by a transient handle not identified), so the bound leaves room for it
    base, clients = report["samples"][0]["open_files"], report["clients"]
    assert all(s["open_files"] <= base + 8 + 3 * clients for s in report["samples"]), report["samples"]

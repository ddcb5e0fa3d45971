"""Where questions come from and which setting an error names: questions read from a pipe or standard input, ids
of videos sharing a stem, and the advice for a read-only HOME or trace folder and a full model cache."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from m1.data.questions import InputError, build_questions, read_questions
from tests.conftest import make_video
from tests.core.test_faults import intact, invoke, mount, one_error  # noqa: F401  (mount: a fixture)


def _rows(n: int, video: str) -> bytes:
    return "".join(json.dumps({"id": f"q{i}", "video": video, "text": "What colour?", "options": ["red", "blue"],
                               "task": "mcq"}) + "\n" for i in range(n)).encode()


def test_questions_from_a_fifo_are_read_once(tmp_path):
    """`<(...)` hands the run a pipe: its questions are read once; only a missing file is "questions file not found"."""
    fifo = tmp_path / "q.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(_rows(3, "v.mp4")))
    writer.start()
    qs, issues = read_questions(fifo, tmp_path)
    writer.join()
    assert [q.id for q in qs] == ["q0", "q1", "q2"] and not issues
    assert qs[0].video == str(tmp_path / "v.mp4")
    with pytest.raises(InputError, match="questions file not found"):
        read_questions(tmp_path / "missing.jsonl", tmp_path)


def test_questions_on_standard_input(tmp_path, monkeypatch):
    """`--questions -` reads standard input."""
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(_rows(2, "v.mp4"))))
    qs, _ = read_questions(Path("-"), tmp_path)
    assert [q.id for q in qs] == ["q0", "q1"]


def test_videos_sharing_a_stem_get_distinct_ids(tmp_path):
    """`synth_000.mp4` beside `synth_000.mov` get distinct ids, each its file's name; a lone video keeps its stem."""
    for name in ("synth_000.mp4", "synth_000.mov", "other.mp4"):
        (tmp_path / name).write_bytes(b"")
    qs, _ = build_questions(tmp_path, question="What colour?")
    assert sorted(q.id for q in qs) == ["other", "synth_000.mov", "synth_000.mp4"]
    assert {q.id: Path(q.video).name for q in qs}["synth_000.mov"] == "synth_000.mov"


def test_a_duplicate_id_in_a_questions_file_names_both_videos(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(_rows(1, "a.mp4") + _rows(1, "b.mp4"))
    with pytest.raises(InputError, match=r"duplicate question id 'q0' \(videos .*a\.mp4 and .*b\.mp4\)"):
        read_questions(path, tmp_path)


@pytest.mark.slow
def test_m1_infer_answers_questions_piped_on_stdin(tmp_path, m1_cache):
    """End to end: `m1 infer --questions -` or `/dev/stdin` with the file piped in answers every question."""
    make_video(tmp_path / "v.mp4", seconds=4, fps=2)
    out = tmp_path / "r.jsonl"
    for source in ("-", "/dev/stdin"):
        r = subprocess.run([sys.executable, "-m", "m1", "infer", str(tmp_path), "--questions", source, "--team",
                            "tiny", "--out", str(out)], input=_rows(2, "v.mp4"), capture_output=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(x["id"] for x in rows) == ["q0", "q1"] and all(x["error"] is None for x in rows)
        out.unlink()


def test_read_only_home_trace_dir_and_a_full_model_cache_name_their_setting(tmp_path, monkeypatch, mount):
    """A read-only HOME (no M1_CACHE) advises M1_CACHE, not "another --out"; a read-only --trace-dir advises
    another --trace-dir; a model cache on a full disk is one error line naming M1_CACHE, no traceback, exit 2.
    Nothing is written to the results file in any of them."""
    video = tmp_path / "vids"
    video.mkdir()
    make_video(video / "clip0.mp4", seconds=4, fps=2, size=64)
    out = tmp_path / "res.jsonl"
    home = mount("home", "1m", ro=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("M1_CACHE", raising=False)
    line = one_error(invoke("infer", video, "-q", "Which?", "--out", out), home, "read-only file system",
                     "M1_CACHE environment variable")
    assert "--out" not in line and intact(out) == []

    monkeypatch.setenv("M1_CACHE", str(tmp_path / "cache"))
    ro = mount("ro", "1m", ro=True)
    line = one_error(invoke("infer", video, "-q", "Which?", "--out", out, "--trace-dir", ro / "traces"),
                     ro / "traces", "read-only file system", "another --trace-dir")
    assert "--out)" not in line and intact(out) == []

    full = mount("full", "64k")
    monkeypatch.setenv("M1_CACHE", str(full / "cache"))
    one_error(invoke("infer", video, "-q", "Which?", "--out", out), "disk full while writing", full / "cache",
              "M1_CACHE environment variable")
    assert intact(out) == [] and not [p for p in (full / "cache").rglob(".*") if p.is_dir()]  # no half build

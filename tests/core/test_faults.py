"""Faults a user can cause, on purpose, against every command: each ends in exit 2 with one `error:` line
naming the culprit and no traceback (or, for a bad line or a bad video, a named skip or an error row), the output
files stay intact (every id once, no torn line, every checkpoint verifiable), and the rerun once the fault is
mended finishes.

The corpus is tests/fixtures/faults/: questions and benchmark lines that are not UTF-8, an empty questions file, a
questions file whose videos are missing or not videos, team and experiment YAMLs with bad bytes or bad YAML. The
videos are generated small. Read-only and full file systems are tmpfs mounts (root only; skipped with the reason
otherwise: root ignores chmod, so a chmod-ed folder would prove nothing for it)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from m1.results import FINGERPRINT_PREFIX
from tests.conftest import fragmented_mp4, make_video

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).parents[1] / "fixtures" / "faults"
REPO = Path(__file__).resolve().parents[2]


def one_error(r, *words) -> str:
    """Exit 2, exactly one `error:` line holding every word, and no traceback; returns the line."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output, r.output
    errs = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errs) == 1, r.stderr
    for w in words:
        assert str(w) in errs[0], (w, errs[0])
    return errs[0]


def intact(path: Path) -> list[dict]:
    """The rows of a results file that has no torn line and lists each id once (none when it was never created)."""
    data = path.read_bytes() if path.exists() else b""
    assert not data or data.endswith(b"\n"), f"torn last line in {path}"
    rows = [json.loads(x) for x in data.decode().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"{path} lists an id twice: {ids}"
    return rows


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A folder with the corpus and two small videos beside it."""
    d = tmp_path_factory.mktemp("faults")
    for f in CORPUS.iterdir():
        shutil.copy(f, d / f.name)
    for i in range(2):
        make_video(d / f"clip{i}.mp4", seconds=4, fps=2, size=64)
    return d


def invoke(*args):
    from m1.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_every_command_over_bad_inputs(work, tmp_path, m1_cache):
    w, out = work, tmp_path / "res.jsonl"
    # a questions line that is not UTF-8 is skipped by file:line; the others are answered
    r = invoke("infer", w, "--questions", w / "questions_bad_bytes.jsonl", "--out", out)
    assert r.exit_code == 1 and "1 input lines skipped" in r.stdout, r.output  # a skipped line: exit 1
    assert f"skipped: {w / 'questions_bad_bytes.jsonl'}:2: malformed question (not UTF-8: byte 0xe9" in r.stderr
    assert [x["id"] for x in intact(out)] == ["q0", "q2"]
    # an empty questions file, a folder for a file, bad team YAMLs, bad overrides: one line, nothing written
    before = out.read_bytes()
    one_error(invoke("infer", w, "--questions", w / "questions_empty.jsonl", "--out", out),
              w / "questions_empty.jsonl", "no usable questions")
    one_error(invoke("infer", w, "--questions", w, "--out", out), w, "is a folder")
    one_error(invoke("infer", w, "--questions", w / "questions_bad_bytes.jsonl", "--out", w), w, "is a folder")
    one_error(invoke("infer", w, "-q", "Which?", "--team", w / "team_bad_bytes.yaml", "--out", out),
              f"{w / 'team_bad_bytes.yaml'}:1: not UTF-8 text (byte 0xe9)")
    one_error(invoke("infer", w, "-q", "Which?", "--team", w / "team_bad_yaml.yaml", "--out", out),
              w / "team_bad_yaml.yaml", "not valid YAML")
    one_error(invoke("infer", w, "-q", "Which?", "--set", "limits.max_turnz=2", "--out", out),
              "override 'limits.max_turnz=2': unknown key 'limits.max_turnz'")
    one_error(invoke("infer", w, "-q", "Which?", "--set", "limits.max_turns=many", "--out", out),
              "override 'limits.max_turns=many'", "limits.max_turns")
    one_error(invoke("infer", w, "-q", "Which?", "--set", "novalue", "--out", out), "key.path=value")
    one_error(invoke("infer", w, "-q", "Which?", "--shard", "3/2", "--out", out), "--shard '3/2'")
    assert out.read_bytes() == before

    # m1 eval: a benchmark line that is not UTF-8 is skipped by file and line; a folder for the file is one line
    ev = tmp_path / "eval"
    r = invoke("eval", "-b", "jsonl", "--annotations", w / "benchmark_bad_bytes.jsonl", "--videos", w, "--out", ev)
    assert r.exit_code == 1 and "1 input lines skipped" in r.stdout, r.output
    assert f"skipped: {w / 'benchmark_bad_bytes.jsonl'}: line 2: line 2: not UTF-8 text (byte 0xf6" in r.stderr
    assert [x["id"] for x in intact(ev / "predictions.jsonl")] == ["b0", "b2"]
    assert json.loads((ev / "metrics.json").read_text())["n_questions"] == 2
    one_error(invoke("eval", "-b", "jsonl", "--annotations", w, "--videos", w, "--out", ev), w, "is a folder")
    one_error(invoke("eval", "-b", "jsonl", "--annotations", w / "benchmark_bad_bytes.jsonl", "--videos", w,
                     "--out", w / "clip0.mp4"), w / "clip0.mp4")

    # missing and undecodable videos are error rows; once the video is back, the rerun retries them in place
    mv, vids = tmp_path / "missing.jsonl", tmp_path / "vids"
    shutil.copytree(w, vids)
    r = invoke("infer", vids, "--questions", vids / "questions_missing_videos.jsonl", "--out", mv)
    assert r.exit_code == 1 and "1 answered, 0 already done, 2 errors" in r.stdout, r.output  # errors: exit 1
    rows = intact(mv)
    assert [x["id"] for x in rows] == ["m0", "m1", "m2"] and [bool(x["error"]) for x in rows] == [False, True, True]
    assert "missing.mp4" in rows[1]["error"] and "not_a_video.mp4" in rows[2]["error"]
    shutil.copy(vids / "clip1.mp4", vids / "missing.mp4")
    r = invoke("infer", vids, "--questions", vids / "questions_missing_videos.jsonl", "--out", mv, "--keep-errors")
    assert r.exit_code == 0 and "2 earlier errors kept as they are (--keep-errors)" in r.stdout, r.output
    r = invoke("infer", vids, "--questions", vids / "questions_missing_videos.jsonl", "--out", mv)
    assert r.exit_code == 1 and "retried 2 earlier errors: 1 now answered, 1 still errors" in r.stdout, r.output
    rows = intact(mv)
    assert [x["id"] for x in rows] == ["m0", "m1", "m2"] and [bool(x["error"]) for x in rows] == [False, False, True]

    # m1 merge: a missing part names its ids
    sh = tmp_path / "sh.jsonl"
    assert invoke("infer", w, "--questions", w / "questions_bad_bytes.jsonl", "--out", sh,
                  "--shard", "0/2").exit_code == 1  # its skipped line: exit 1
    one_error(invoke("merge", sh), "sh.jsonl.part-1-of-2.jsonl (ids 'q2')", "--shard 1/2")
    assert not sh.exists()

    # m1 experiment: bad bytes in its YAML, an unknown override
    one_error(invoke("experiment", "run", w / "experiment_bad_bytes.yaml"),
              f"{w / 'experiment_bad_bytes.yaml'}:2: not UTF-8 text")
    exp = _eval_experiment(w, tmp_path)
    one_error(invoke("experiment", "run", exp, "--set", "eval.nope=1"), "override 'eval.nope=1'", "unknown key")
    # m1 train / sft / plot / view / synth: a config that is not UTF-8, folders that are not runs
    one_error(invoke("train", "--config", w / "team_bad_bytes.yaml"), w / "team_bad_bytes.yaml", "not UTF-8")
    one_error(invoke("sft", "--config", w / "team_bad_yaml.yaml"), w / "team_bad_yaml.yaml", "not valid YAML")
    one_error(invoke("plot", w), w)
    one_error(invoke("view", w / "nowhere"), "nowhere")
    one_error(invoke("synth", "make", w / "clip0.mp4", "--videos", "1", "--duration", "30"), w / "clip0.mp4")
    # --debug keeps the traceback
    r = invoke("infer", w, "--questions", w / "questions_bad_bytes.jsonl", "--out", w, "--debug")
    assert r.exit_code == 2 and "Traceback" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("error:")


def test_invalid_questions_are_error_rows_in_infer_and_eval(work, tmp_path, m1_cache):
    """Empty MCQ options, a truth letter outside the options, an unknown task: one error row each naming the field,
    the valid questions of the same batch answered, exit 1 (0 with --allow-errors); `m1 eval` agrees line by line.
    A line without an id has nothing to list an error row under: it is skipped by file:line."""
    w, out, q = work, tmp_path / "res.jsonl", work / "questions_invalid.jsonl"
    r = invoke("infer", w, "--questions", q, "--out", out)
    assert r.exit_code == 1 and "2 answered, 0 already done, 3 errors" in r.stdout, r.output
    assert f"skipped: {q}:5: malformed question (field 'id': '' is missing or empty)" in r.stderr
    assert "exit 1: 3 questions ended as error rows and 1 input lines were skipped (--allow-errors exits 0)" in r.stderr
    rows = sorted(intact(out), key=lambda x: x["id"])  # the invalid rows are written first, before any answer
    assert [x["id"] for x in rows] == ["v0", "v1", "v2", "v3", "v5"]
    assert [x["error"] is None for x in rows] == [True, False, False, False, True]
    errors = {x["id"]: x["error"] for x in rows if x["error"]}
    assert "field 'options': an mcq question needs at least 2 options, got 0" in errors["v1"]
    assert "field 'answer': answer 'F' is not one of A, B, C, D" in errors["v2"]
    assert "field 'task': 'essay' is not one of mcq, open, grounding, numeric" in errors["v3"]
    r = invoke("infer", w, "--questions", q, "--out", out, "--allow-errors")  # retried, still invalid: exit 0
    assert r.exit_code == 0 and "retried 3 earlier errors: 0 now answered, 3 still errors" in r.stdout, r.output
    assert [(x["id"], bool(x["error"])) for x in sorted(intact(out), key=lambda x: x["id"])] == \
        [(x["id"], bool(x["error"])) for x in rows]

    ev = tmp_path / "eval"
    r = invoke("eval", "-b", "jsonl", "--annotations", q, "--videos", w, "--out", ev)
    assert r.exit_code == 1 and "2 answered, 0 already done, 3 errors" in r.stdout, r.output
    assert "field 'id': '' is missing or empty" in r.stderr
    assert sorted((x["id"], x["error"]) for x in intact(ev / "predictions.jsonl")) == [(x["id"], x["error"]) for x in rows]
    metrics = json.loads((ev / "metrics.json").read_text())
    assert metrics["n_questions"] == 2 and metrics["n_invalid"] == 3
    only_bad = tmp_path / "only_bad.jsonl"  # nothing left to score: said so, the error rows kept, still exit 1
    only_bad.write_text("".join(q.read_text().splitlines(keepends=True)[1:3]))
    r = invoke("eval", "-b", "jsonl", "--annotations", only_bad, "--videos", w, "--out", tmp_path / "ev2")
    assert r.exit_code == 1 and "not scored: score_benchmark: no labelled questions to score" in r.stderr, r.output
    assert [x["id"] for x in intact(tmp_path / "ev2" / "predictions.jsonl")] == ["v1", "v2"]


def test_an_edited_question_is_answered_again(work, tmp_path, m1_cache):
    """A results line records a fingerprint of what was asked; a rerun re-answers a question whose text or video
    changed under the same id (its line replaced), --keep-stale keeps the old answer, and a line written before
    fingerprints existed counts as matching (an upgrade re-answers nothing)."""
    w, out, qfile = work, tmp_path / "res.jsonl", tmp_path / "q.jsonl"
    vids = tmp_path / "vids"
    vids.mkdir()
    for v in ("clip0.mp4", "clip1.mp4"):
        shutil.copy(w / v, vids / v)
    qs = [json.loads(x) for x in (w / "questions_invalid.jsonl").read_text().splitlines()]
    qs = [qs[0], qs[5]]  # v0 on clip0, v5 on clip1
    qfile.write_text("".join(json.dumps(x) + "\n" for x in qs))
    args = ("infer", vids, "--questions", qfile, "--out", out)
    assert invoke(*args).exit_code == 0
    first = intact(out)
    assert all(x["fp"].startswith(FINGERPRINT_PREFIX) and len(x["fp"]) == len(FINGERPRINT_PREFIX) + 16
               for x in first)
    r = invoke(*args)
    assert r.exit_code == 0 and "0 answered, 2 already done, 0 errors" in r.stdout, r.output

    qs[0]["text"] = "Which colour is the square?"  # v0 edited under its id
    qfile.write_text("".join(json.dumps(x) + "\n" for x in qs))
    before = out.read_bytes()
    r = invoke(*args, "--keep-stale")
    assert r.exit_code == 0 and "1 questions changed since their line was written; their old answers kept" in r.stdout
    assert out.read_bytes() == before
    r = invoke(*args)
    assert r.exit_code == 0 and "1 answered, 1 already done, 0 errors" in r.stdout, r.output
    assert "re-answered 1 questions that changed since their line was written" in r.stdout
    rows = intact(out)
    assert [x["id"] for x in rows] == ["v0", "v5"] and rows[0]["question"] == "Which colour is the square?"
    assert rows[0]["fp"] != first[0]["fp"] and rows[1] == first[1]

    st = (vids / "clip1.mp4").stat()  # v5's video replaced (a new mtime): answered again
    os.utime(vids / "clip1.mp4", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    r = invoke(*args)
    assert r.exit_code == 0 and "re-answered 1 questions that changed" in r.stdout, r.output
    rows = intact(out)
    assert [x["id"] for x in rows] == ["v0", "v5"] and rows[1]["fp"] != first[1]["fp"]

    qs[0]["text"], qs[1]["text"] = "Edited again?", "And this one?"  # lines without a fingerprint: kept as they are
    qfile.write_text("".join(json.dumps(x) + "\n" for x in qs))
    out.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "fp"}) + "\n" for x in rows))
    r = invoke(*args)
    assert r.exit_code == 0 and "0 answered, 2 already done, 0 errors" in r.stdout, r.output
    assert "re-answered" not in r.stdout and [x["id"] for x in intact(out)] == ["v0", "v5"]


def test_a_question_too_long_for_a_models_context_is_an_error_row(work, tmp_path, m1_cache, monkeypatch):
    """A question longer than a model's context (~37 KB against the tiny team's models) does not stop the run: it
    is an error row naming the tokens needed and the room the model's context leaves; the others, its batch mates
    included, are answered; the rerun with a shorter text answers it. A model failure that does stop a run says
    results are kept only when some are."""
    vids, out, qfile = tmp_path / "vids", tmp_path / "res.jsonl", tmp_path / "q.jsonl"
    vids.mkdir()
    for v in ("clip0.mp4", "clip1.mp4"):
        shutil.copy(work / v, vids / v)
    asked = {"a": ("clip0.mp4", "What colour is the square?"),
             "b": ("clip1.mp4", "Is the red square left of the blue circle at the start? " * 650),
             "c": ("clip1.mp4", "What colour is the square?")}

    def write():
        qfile.write_text("".join(json.dumps({"id": i, "video": v, "text": t, "options": ["white", "red"],
                                             "task": "mcq"}) + "\n" for i, (v, t) in asked.items()))

    write()
    args = ("infer", vids, "--questions", qfile, "--out", out)
    r = invoke(*args)
    assert r.exit_code == 1 and "2 answered, 0 already done, 1 errors" in r.stdout, r.output
    assert re.search(r"error: b: prompt too long: agent 'qwen3_big', phase plan, question 'b': the prompt is \d+ "
                     r"tokens, over the \d+ tokens left for it by the context of model 'q3_big' \(\d+ tokens, 48 "
                     r"kept for the reply\) .*; shorten the question or its options", r.output), r.output
    assert "Traceback" not in r.output and "results so far" not in r.output
    rows = sorted(intact(out), key=lambda x: x["id"])
    assert [(x["id"], bool(x["error"])) for x in rows] == [("a", False), ("b", True), ("c", False)]
    asked["b"] = ("clip1.mp4", "Is the red square left of the blue circle at the start?")
    write()
    r = invoke(*args)
    assert r.exit_code == 0 and "retried 1 earlier errors: 1 now answered, 0 still errors" in r.stdout, r.output

    from m1.models.base import ModelError
    from m1.team.cpp import Team

    def down(self, *a, **k):
        raise ModelError("model 'q3_big': the backend is down")

    monkeypatch.setattr(Team, "run", down)
    asked["d"] = ("clip0.mp4", "What colour is the square?")
    write()
    fresh = tmp_path / "fresh.jsonl"
    r = invoke("infer", vids, "--questions", qfile, "--out", fresh)
    one_error(r, "the backend is down")
    assert f"(no results were written to {fresh}; rerun once the model works)" in r.stderr and not fresh.exists()
    r = invoke(*args)
    one_error(r, "the backend is down")
    assert f"(results so far are kept in {out}; rerun to resume)" in r.stderr
    assert sorted(x["id"] for x in intact(out)) == ["a", "b", "c"]


def test_broken_links_in_a_video_folder_are_error_rows(work, tmp_path, m1_cache):
    """A dangling or looping *.mp4 link in the folder of `--question` gets its error row naming the link and why
    (one line per broken video, as the README promises; none is left out); once the links lead to videos,
    the rerun answers them in place."""
    vids, out, gone = tmp_path / "vids", tmp_path / "res.jsonl", tmp_path / "gone.mp4"
    vids.mkdir()
    shutil.copy(work / "clip0.mp4", vids / "clip0.mp4")
    (vids / "dangling.mp4").symlink_to(gone)
    (vids / "loop.mp4").symlink_to("loop.mp4")
    args = ("infer", vids, "-q", "What colour is the square?", "--out", out)
    r = invoke(*args)
    assert r.exit_code == 1 and "1 answered, 0 already done, 2 errors" in r.stdout, r.output
    assert (f"error: dangling: cannot read video {vids / 'dangling.mp4'}: a dangling symlink (its target {gone} "
            "does not exist)") in r.output
    assert f"error: loop: cannot read video {vids / 'loop.mp4'}: a symlink loop" in r.output
    rows = sorted(intact(out), key=lambda x: x["id"])
    assert [(x["id"], bool(x["error"])) for x in rows] == [("clip0", False), ("dangling", True), ("loop", True)]
    shutil.copy(work / "clip1.mp4", gone)
    (vids / "loop.mp4").unlink()
    (vids / "loop.mp4").symlink_to("clip0.mp4")
    r = invoke(*args)
    assert r.exit_code == 0 and "retried 2 earlier errors: 2 now answered, 0 still errors" in r.stdout, r.output
    rows = sorted(intact(out), key=lambda x: x["id"])
    assert [(x["id"], x["error"]) for x in rows] == [("clip0", None), ("dangling", None), ("loop", None)]


def test_a_question_on_a_looping_link_is_an_error_row(work, tmp_path, m1_cache):
    """A --questions line whose video is a symlink loop is an error row naming the link (resolve()'s RuntimeError
    does not stop the run); the other questions are answered, and the rerun once the link leads to a video answers
    it."""
    vids, out, qfile = tmp_path / "vids", tmp_path / "res.jsonl", tmp_path / "q.jsonl"
    vids.mkdir()
    for v in ("clip0.mp4", "clip1.mp4"):
        shutil.copy(work / v, vids / v)
    (vids / "loop.mp4").symlink_to("loop.mp4")
    qfile.write_text("".join(json.dumps({"id": i, "video": v, "text": "What colour is the square?",
                                         "options": ["white", "red"], "task": "mcq"}) + "\n"
                             for i, v in (("a", "clip0.mp4"), ("b", "loop.mp4"), ("c", "clip1.mp4"))))
    args = ("infer", vids, "--questions", qfile, "--out", out)
    r = invoke(*args)
    assert r.exit_code == 1 and "2 answered, 0 already done, 1 errors" in r.stdout, r.output
    assert f"error: b: cannot read video {vids / 'loop.mp4'}: a symlink loop" in r.output
    assert "Traceback" not in r.output
    rows = sorted(intact(out), key=lambda x: x["id"])
    assert [(x["id"], bool(x["error"])) for x in rows] == [("a", False), ("b", True), ("c", False)]
    (vids / "loop.mp4").unlink()
    (vids / "loop.mp4").symlink_to("clip1.mp4")
    r = invoke(*args)
    assert r.exit_code == 0 and "retried 1 earlier errors: 1 now answered, 0 still errors" in r.stdout, r.output
    assert [(x["id"], x["error"]) for x in sorted(intact(out), key=lambda x: x["id"])] == \
        [("a", None), ("b", None), ("c", None)]


def test_a_fragmented_mp4_cut_in_half_is_an_error_row(work, tmp_path, m1_cache):
    """A fragmented MP4 cut in half (a recording still being written) is not answered as a video half as long: it
    is an error row naming the file ("incomplete or still being written"); once the whole recording is in place,
    the rerun retries the row and answers it."""
    vids, out = tmp_path / "vids", tmp_path / "res.jsonl"
    vids.mkdir()
    shutil.copy(work / "clip0.mp4", vids / "clip0.mp4")
    whole = fragmented_mp4(make_video(tmp_path / "src.mp4", seconds=12, fps=2, size=64), tmp_path / "rec.mp4")
    data = whole.read_bytes()
    (vids / "rec.mp4").write_bytes(data[: len(data) // 2])
    args = ("infer", vids, "-q", "What colour is the square?", "--out", out)
    r = invoke(*args)
    assert r.exit_code == 1 and "1 answered, 0 already done, 1 errors" in r.stdout, r.output
    assert f"error: rec: cannot read video {(vids / 'rec.mp4').resolve()}: incomplete or still being written: " \
           "the file holds " in r.output, r.output
    rows = sorted(intact(out), key=lambda x: x["id"])
    assert [(x["id"], bool(x["error"])) for x in rows] == [("clip0", False), ("rec", True)]
    assert "incomplete or still being written" in rows[1]["error"] and "rec.mp4" in rows[1]["error"]
    shutil.copy(whole, vids / "rec.mp4")
    r = invoke(*args)
    assert r.exit_code == 0 and "retried 1 earlier errors: 1 now answered, 0 still errors" in r.stdout, r.output
    assert [(x["id"], x["error"]) for x in sorted(intact(out), key=lambda x: x["id"])] == \
        [("clip0", None), ("rec", None)]


def _eval_experiment(w: Path, tmp_path: Path, world: bool = False) -> Path:
    """An experiment of one eval stage (tiny team) over the corpus's good questions; with `world`, a data stage
    that renders a small M1-Synth world first."""
    spec = {"name": "faults", "out_dir": str(tmp_path / "exp"), "seeds": [0],
            "eval": {"team": "tiny", "questions": str(w / "questions_bad_bytes.jsonl"), "video_dir": str(w)},
            "arms": {"base": None}}
    if world:
        spec["data"] = {"worlds": [{"out": str(tmp_path / "world"), "videos": 1, "seed": 5, "duration": 30,
                                    "questions_per_video": 2}]}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_torn_eval_stage_runs_again(work, tmp_path, m1_cache):
    """A finished eval stage whose results file was cut (mid-line, or at a line's end) is unfinished, whatever its
    stage.json and committed record say: the report names the file, the rerun repairs it and answers the cut
    question again (each id once), and then the report no longer names the file."""
    exp = _eval_experiment(work, tmp_path)
    assert invoke("experiment", "run", exp).exit_code == 0
    res = tmp_path / "exp" / "base" / "seed0" / "eval" / "results.jsonl"
    whole = intact(res)
    for cut, why in ((res.read_bytes()[:-10], f"{res} was cut mid-line"),
                     (res.read_bytes().splitlines(keepends=True)[0], f"{res} holds 1 lines, fewer than the 2")):
        res.write_bytes(cut)
        one_error(invoke("experiment", "report", exp), why, "rerun `m1 experiment run`")
        r = invoke("experiment", "run", exp)
        assert r.exit_code == 0 and f"{why}" in r.stdout and "running the stage again" in r.stdout, r.output
        assert "1 answered, 1 already done, 0 errors" in r.stdout, r.output
        rows = intact(res)
        assert [x["id"] for x in rows] == ["q0", "q2"] and rows[0] == whole[0]
        assert json.loads((res.parent / "stage.json").read_text())["answered"] == 2
        assert "done before" in invoke("experiment", "run", exp).stdout
        assert str(res) not in invoke("experiment", "report", exp).output  # (ungraded questions: nothing to report)


# ------------------------------------------------------------------------------------------------ file systems
@pytest.fixture
def mount(tmp_path):
    """mount(name, size, ro=False) -> a tmpfs folder; unmounted at the end. Root only."""
    if os.geteuid() != 0:
        pytest.skip("read-only and full file systems are tmpfs mounts, which need root (as in CI); chmod would not "
                    "stop root, so no weaker stand-in is tried")
    made = []

    def _mount(name, size, ro=False):
        d = tmp_path / name
        d.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
        made.append(d)
        return d

    yield _mount
    for d in reversed(made):
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_read_only_and_full_file_systems(work, tmp_path, mount, m1_cache):
    w = work
    ro = mount("ro", "1m", ro=True)
    q = w / "questions_bad_bytes.jsonl"
    one_error(invoke("infer", w, "--questions", q, "--out", ro / "res.jsonl"), ro, "read-only file system")
    one_error(invoke("infer", w, "--questions", q, "--out", tmp_path / "r.jsonl", "--trace-dir", ro / "traces"),
              ro / "traces", "read-only file system")
    assert intact(tmp_path / "r.jsonl") == []  # a question whose trace cannot be written gets no line
    one_error(invoke("eval", "-b", "jsonl", "--annotations", w / "benchmark_bad_bytes.jsonl", "--videos", w,
                     "--out", ro / "eval"), ro / "eval", "read-only file system")
    one_error(invoke("synth", "make", ro / "world", "--videos", "1", "--duration", "30"), ro / "world",
              "read-only file system")

    # a full disk mid-run: no torn line or trace; the rerun after space is freed finishes with every id once
    full = mount("full", "24k")
    out, traces = full / "res.jsonl", full / "traces"
    r = invoke("infer", w, "--questions", q, "--out", out, "--trace-dir", traces)
    one_error(r, "disk full while writing", full)
    intact(out)
    assert not [p for p in traces.glob(".*.tmp")], "a temporary trace was left behind"
    for p in traces.glob("*.json"):
        json.loads(p.read_text())  # whole traces only
    subprocess.run(["mount", "-o", "remount,size=8m", str(full)], check=True)
    r = invoke("infer", w, "--questions", q, "--out", out, "--trace-dir", traces, "--allow-errors")
    assert r.exit_code == 0, r.output  # its skipped line alone would exit 1
    assert [x["id"] for x in intact(out)] == ["q0", "q2"]

    # a training checkpoint on a full disk: torch's own writer fails; the checkpoints on disk stay verifiable
    from m1.marl.checkpoint import checkpoint_history, checkpoint_problem
    from tests.marl.test_checkpoint_safety import write_config

    run = mount("train", "256m")
    config = write_config(tmp_path, str(w / "clip0.mp4"), run / "run", steps=1)
    assert invoke("train", "--config", config).exit_code == 0
    ckpt = sum(f.stat().st_size for f in (run / "run" / "checkpoints").rglob("*") if f.is_file())
    room = shutil.disk_usage(run).used + ckpt // 2  # step 2's checkpoint cannot fit
    subprocess.run(["mount", "-o", f"remount,size={room}", str(run)], check=True)
    r = invoke("train", "--config", config, "--set", "steps=2")
    one_error(r, "disk full while writing", run / "run" / "checkpoints" / "step-000002")
    assert [p.name for p in checkpoint_history(run / "run")] == ["step-000001"]
    assert checkpoint_problem(run / "run" / "checkpoints" / "step-000001") is None
    assert not list((run / "run" / "checkpoints").glob(".*.tmp"))
    subprocess.run(["mount", "-o", "remount,size=256m", str(run)], check=True)
    r = invoke("train", "--config", config, "--set", "steps=2")
    assert r.exit_code == 0, r.output
    history = checkpoint_history(run / "run")
    assert history and history[0].name == "step-000002" and all(checkpoint_problem(p) is None for p in history)


def test_read_only_advice_names_settings_that_exist(work, tmp_path, mount, m1_cache, monkeypatch):
    """`m1 experiment run` has no --out: a read-only out_dir advises `--set out_dir=`; a read-only model cache
    advises the M1_CACHE environment variable. Nothing is written; the rerun elsewhere finishes."""
    ro = mount("ro", "1m", ro=True)
    exp = _eval_experiment(work, tmp_path)
    line = one_error(invoke("experiment", "run", exp, "--set", f"out_dir={ro / 'exp'}"), ro / "exp",
                     "read-only file system", "--set out_dir=")
    assert "--out)" not in line and not list(ro.iterdir())
    monkeypatch.setenv("M1_CACHE", str(ro / "cache"))
    out = tmp_path / "res.jsonl"
    line = one_error(invoke("infer", work, "-q", "Which?", "--out", out), ro / "cache", "read-only file system",
                     "M1_CACHE environment variable")
    assert "--out" not in line and intact(out) == []
    monkeypatch.setenv("M1_CACHE", m1_cache)
    r = invoke("experiment", "run", exp)
    assert r.exit_code == 0 and [x["id"] for x in intact(tmp_path / "exp" / "base" / "seed0" / "eval" /
                                                         "results.jsonl")] == ["q0", "q2"], r.output


# ------------------------------------------------------------------------------------------------ concurrency
def test_two_experiment_runs_at_once(work, tmp_path, m1_cache):
    """The second `m1 experiment run` is refused naming the first; the world and the stage records of the first are
    whole; a rerun afterwards finds everything done."""
    exp = _eval_experiment(work, tmp_path, world=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "m1", "experiment", "run", str(exp)]
    runs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]  # started together: the loser starts well before the winner's render and eval end
    ends = [p.communicate(timeout=600) for p in runs]
    assert sorted(p.returncode for p in runs) == [0, 2], ends
    won, lost = (0, 1) if runs[0].returncode == 0 else (1, 0)
    assert "Traceback" not in ends[lost][1], ends[lost][1]
    [line] = [x for x in ends[lost][1].splitlines() if x.startswith("error:")]
    assert f"experiment folder {tmp_path / 'exp'} is being written by pid {runs[won].pid}" in line
    assert "rendering world" in ends[won][0] and "rendering world" not in ends[lost][0]
    lock = tmp_path / "exp" / ".lock"
    world = tmp_path / "world"
    qs = [json.loads(x) for x in (world / "questions.jsonl").read_text().splitlines()]
    assert len({q["id"] for q in qs}) == len(qs) > 0 and all((world / q["video"]).is_file() for q in qs)
    assert not list(tmp_path.glob(".world.*.tmp")) and not lock.exists()
    stage = json.loads((tmp_path / "exp" / "base" / "seed0" / "eval" / "stage.json").read_text())
    assert stage["answered"] == 2 and [x["id"] for x in intact(Path(stage["results"]["results"]))] == ["q0", "q2"]
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "done before" in again.stdout, again.stderr

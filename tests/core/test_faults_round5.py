"""Bad inputs, round five (issue 84): each test is one reported case or class; it failed before the fix and passes
after. The server's cases are in tests/serve/, the training inputs' beside their commands' tests."""
import json
import os
import socket
from pathlib import Path

import pytest

from m1.agents.parsers import answer_in_form
from m1.data.questions import InputError, build_questions, read_questions
from m1.data.records import INVALID, check_question
from m1.files import PlaceError, check_place
from m1.locks import hold, hold_dir
from m1.results import ResultsFile
from m1.run import RunSummary
from m1.schema import Question
from m1.trace import trace_name
from tests.conftest import make_video
from tests.core.test_faults import intact, invoke, one_error


def _question_file(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def one_video(tmp_path):
    make_video(tmp_path / "v.mp4", seconds=4, fps=2)
    return _question_file(tmp_path / "q.jsonl", [{"id": "q0", "video": "v.mp4", "text": "What colour?",
                                                  "options": ["red", "blue"], "task": "mcq", "answer": "A"}])


def _not_regular_files(tmp_path: Path) -> dict[str, Path]:
    """One of each kind of place that is not a regular file: a FIFO, a character device, a socket."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "out.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    sock.close()  # the socket file stays
    return {"FIFO": fifo, "character device": Path("/dev/null"), "socket": sock_path}


def test_outputs_that_are_not_regular_files_are_refused_at_once(tmp_path, one_video):
    """Case 1, the class: a FIFO as --out hung in open() holding its lock; /dev/null gave "Invalid argument ... rerun
    with --debug". Every such place, for --out of infer and eval, --trace-dir and a locked output folder, is one
    error line naming the place and what it is, before anything is opened or loaded."""
    for kind, place in _not_regular_files(tmp_path).items():
        r = invoke("infer", tmp_path, "--questions", one_video, "--team", "tiny", "--out", place)
        line = one_error(r, str(place), kind)
        assert "regular file" in line and line.endswith("tail -f)"), line  # the place's own words, nothing after
        assert not Path(str(place) + ".lock").exists()
        with pytest.raises(PlaceError, match=kind):
            with hold(place, "results file"):
                pass
        # where a folder belongs: --trace-dir, eval's --out, a training / experiment output folder
        one_error(invoke("infer", tmp_path, "--questions", one_video, "--team", "tiny", "--out", tmp_path / "r.jsonl",
                         "--trace-dir", place), str(place), "a folder is expected here", kind)
        one_error(invoke("eval", "-b", "jsonl", "--annotations", one_video, "--videos", tmp_path, "--team", "tiny",
                         "--out", place), str(place), "a folder is expected here", kind)
        with pytest.raises(PlaceError, match="a folder is expected here"):
            with hold_dir(place, "training output folder"):
                pass


def test_a_file_where_a_folder_belongs_says_so(tmp_path, one_video):
    """Case 13: a file as eval's --out, --trace-dir or a training out_dir said "FILE: File exists; check the path and
    its permissions"; a file halfway along the path is named too."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    r = invoke("eval", "-b", "jsonl", "--annotations", one_video, "--videos", tmp_path, "--team", "tiny",
               "--out", blocker)
    one_error(r, str(blocker), "a folder is expected here and a file is in the way")
    r = invoke("infer", tmp_path, "--questions", one_video, "--team", "tiny", "--out", tmp_path / "r.jsonl",
               "--trace-dir", blocker)
    one_error(r, "a folder is expected here and a file is in the way")
    r = invoke("infer", tmp_path, "--questions", one_video, "--team", "tiny", "--out", blocker / "sub" / "r.jsonl")
    one_error(r, f"{blocker} is a file where a folder is needed")
    with pytest.raises(PlaceError, match="a folder is expected here and a file is in the way"):
        check_place(blocker, "out_dir", folder=True)
    r = invoke("sft", "--config", "mini", "--set", f"out_dir={blocker}")
    one_error(r, str(blocker), "a folder is expected here")
    check_place(tmp_path / "new" / "folder", "out_dir", folder=True)  # absent places are made by the command


@pytest.mark.parametrize("qid", ["a" * 300, "漢" * 200, "é" * 130 + "/x", "😀" * 80, "\ud800lone", ".hidden",
                                 "x" * 120, "clip 1"])
def test_trace_names_fit_the_file_system_for_every_id(tmp_path, qid):
    """Case 2, the class: trace names were cut to 120 characters, so an id in a script of 3-byte letters needed a
    name of 360 bytes ("File name too long", the answer lost on every rerun). Names are cut in bytes, never through a
    letter, and stay distinct."""
    name = trace_name(qid)
    assert len(name.encode()) <= 140
    for suffix in (".json", ".html"):
        (tmp_path / f"{name}{suffix}").write_text("x")
        (tmp_path / f".{name}{suffix}.12345678.tmp").write_text("x")  # write_whole's temporary file
    assert trace_name(qid + "x") != name
    assert trace_name("clip_1") == "clip_1" != trace_name("clip 1")


def test_an_id_in_a_long_script_keeps_its_answer_and_trace(tmp_path, m1_cache):
    """Case 2 end to end: the run answers and writes the trace of an id of 200 CJK letters."""
    make_video(tmp_path / "v.mp4", seconds=4, fps=2)
    qid = "問" * 200
    q = _question_file(tmp_path / "q.jsonl", [{"id": qid, "video": "v.mp4", "text": "What colour?",
                                               "options": ["red", "blue"], "task": "mcq"}])
    r = invoke("infer", tmp_path, "--questions", q, "--team", "tiny", "--out", tmp_path / "r.jsonl",
               "--trace-dir", tmp_path / "traces")
    assert r.exit_code == 0, r.output
    assert [x["id"] for x in intact(tmp_path / "r.jsonl")] == [qid]
    assert (tmp_path / "traces" / f"{trace_name(qid)}.json").is_file()


def test_a_negative_limit_is_refused(tmp_path, one_video):
    """Case 3: `--limit -1` answered every question but the last (a slice), exit 0."""
    for cmd in (["infer", tmp_path, "--questions", one_video, "--out", tmp_path / "r.jsonl"],
                ["eval", "-b", "jsonl", "--annotations", one_video, "--videos", tmp_path, "--out", tmp_path / "ev"]):
        r = invoke(*cmd, "--team", "tiny", "--limit", "-1")
        assert r.exit_code == 2 and "--limit" in r.output and "greater than or equal to 0" in r.output, r.output
    assert not (tmp_path / "r.jsonl").exists()
    from m1.run import plan_resume

    with pytest.raises(InputError, match="limit -1"):
        plan_resume([], ResultsFile(tmp_path / "x.jsonl"), -1, False, False)


def test_answers_without_their_team_record_are_not_resumed(tmp_path, one_video, m1_cache):
    """Case 4: a results file whose .team.json was removed was resumed by any team, and eval scored the mix."""
    out = tmp_path / "ev"
    r = invoke("eval", "-b", "jsonl", "--annotations", one_video, "--videos", tmp_path, "--team", "tiny",
               "--out", out)
    assert r.exit_code == 0, r.output
    preds = out / "predictions.jsonl"
    before = preds.read_bytes()
    Path(f"{preds}.team.json").unlink()
    r = invoke("eval", "-b", "jsonl", "--annotations", one_video, "--videos", tmp_path, "--team", "tiny",
               "--set", "sampling.temperature=0.5", "--out", out)
    one_error(r, str(preds), "not the team record")
    assert preds.read_bytes() == before and not Path(f"{preds}.team.json").exists()


def test_a_results_file_listing_an_id_twice_is_refused_naming_it(tmp_path):
    """Case 5: two results files joined gave "2 already done" and eval scored one copy without a word."""
    path = tmp_path / "r.jsonl"
    rows = [{"id": "a", "answer": "A"}, {"id": "b", "answer": "B"}, {"id": "a", "answer": "C"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"1 question ids have more than one line: 'a' \(lines 1, 3\)"):
        ResultsFile(path)


def test_a_file_url_is_read_as_its_path_and_other_urls_name_the_field(tmp_path):
    """Case 6: `file:///abs/v.mp4` was joined under the videos folder ("the videos folder .../file:/... was
    gone"); it names the file, as `m1 serve` reads it. An http URL is an error row naming the field."""
    video = tmp_path / "my videos" / "v.mp4"
    q = _question_file(tmp_path / "q.jsonl", [
        {"id": "f", "video": "file://" + str(video).replace(" ", "%20"), "text": "t?", "options": ["a", "b"]},
        {"id": "h", "video": "https://example.com/v.mp4", "text": "t?", "options": ["a", "b"]},
        {"id": "o", "video": "file://otherhost/v.mp4", "text": "t?", "options": ["a", "b"]}])
    qs, issues = read_questions(q, tmp_path, invalid_rows=True)
    by_id = {x.id: x for x in qs}
    assert by_id["f"].video == str(video) and not issues
    assert "field 'video'" in by_id["h"].meta[INVALID] and "not fetched" in by_id["h"].meta[INVALID]
    assert "host 'otherhost'" in by_id["o"].meta[INVALID]


def test_a_question_without_options_or_task_is_open():
    """Case 7: a JSONL question with neither options nor task became an error row ("an mcq question needs at least
    2 options"); `--question` without options is open, and a file is read the same way."""
    q, problem = check_question({"id": "q", "video": "v.mp4", "text": "Describe what happens."})
    assert problem is None and q.task == "open"
    q, problem = check_question({"id": "q", "video": "v.mp4", "text": "Which?", "options": ["a", "b"]})
    assert problem is None and q.task == "mcq"


def test_answers_not_in_the_form_of_their_task_are_flagged_and_counted():
    """Cases 8 and 9: an open question answered "D", and an mcq answered null (its agents wrote spans, not options),
    were plain rows, counted as answered. `answer_in_form` is the row's `answer_ok`; the summary counts them."""
    open_q = Question(id="o", video="v.mp4", text="Describe what happens.", options=[], task="open")
    mcq = Question(id="m", video="v.mp4", text="When?", options=["00:01:05", "00:02:59", "03:00:00"], task="mcq")
    ground = Question(id="g", video="v.mp4", text="When does it appear?", options=[], task="grounding")
    assert not answer_in_form("D", open_q) and answer_in_form("a red circle rises", open_q)
    assert not answer_in_form(None, mcq) and not answer_in_form("", mcq) and not answer_in_form("D", mcq)
    assert answer_in_form("B", mcq)
    assert answer_in_form("[12.0 - 15.5]", ground) and not answer_in_form("B", ground)
    s = RunSummary(out=Path("r.jsonl"), answered=3, not_in_form=["o", "m"], no_answer=1)
    assert "2 answers are not in the exact form for their task (1 of them null)" in s.describe()


def test_every_row_says_whether_its_answer_is_in_form(tmp_path, m1_cache):
    """Cases 8 and 9 end to end: each row carries `answer_ok` as `answer_in_form` judges it, the closing summary
    counts the false ones, and eval's metrics count them (n_not_in_form, n_no_answer)."""
    make_video(tmp_path / "v.mp4", seconds=4, fps=2)
    rows = [{"id": f"o{i}", "video": "v.mp4", "text": "Describe what happens.", "task": "open", "answer": "x"}
            for i in range(3)]
    rows += [{"id": "m", "video": "v.mp4", "text": "Which colour?", "options": ["red", "blue"], "answer": "A"}]
    q = _question_file(tmp_path / "q.jsonl", rows)
    r = invoke("eval", "-b", "jsonl", "--annotations", q, "--videos", tmp_path, "--team", "tiny", "--out",
               tmp_path / "ev")
    assert r.exit_code == 0, r.output
    got = intact(tmp_path / "ev" / "predictions.jsonl")
    qs = {x.id: x for x in read_questions(q, tmp_path)[0]}
    assert [x["answer_ok"] for x in got] == [answer_in_form(x["answer"], qs[x["id"]]) for x in got]
    bad = [x for x in got if not x["answer_ok"]]
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["n_not_in_form"] == len(bad)
    assert metrics["n_no_answer"] == sum(x["answer"] is None for x in bad)
    assert (f"{len(bad)} answers are not in the exact form" in r.stdout) == bool(bad)


def test_an_unknown_task_is_refused_in_both_ways_of_asking(tmp_path, one_video):
    """Case 10: `--task bogus` with `--question` was an error row (exit 1), with `--questions` silently ignored."""
    for how in (["--question", "What?"], ["--questions", one_video]):
        r = invoke("infer", tmp_path, *how, "--task", "bogus", "--team", "tiny", "--out", tmp_path / "r.jsonl")
        one_error(r, "--task 'bogus'")
    one_error(invoke("infer", tmp_path, "--questions", one_video, "--task", "open", "--team", "tiny", "--out",
                     tmp_path / "r.jsonl"), "--task goes with --question")
    assert not (tmp_path / "r.jsonl").exists()


def _write(path: Path, fmt: str, codec: str, frames: int = 8) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=10)
        s.width, s.height, s.pix_fmt = 176, 144, "rgb8" if codec == "gif" else "yuv420p"  # a size H.263 takes
        for i in range(frames):
            img = np.full((144, 176, 3), i * 20, np.uint8)
            for pkt in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)


def test_a_folder_reads_the_containers_it_can_and_names_the_others(tmp_path):
    """Case 11, the class: .mpg, .ts and .gif files in a folder were skipped without a word. GIF, FLV and 3GP are
    read; MPEG-TS, MPEG-PS and ASF, which the readers here do not decode frame-exact, are each named as skipped
    (counted as skipped inputs: exit 1) with what to do."""
    for name, fmt, codec in [("a.gif", "gif", "gif"), ("b.flv", "flv", "flv"), ("c.3gp", "3gp", "h263"),
                             ("d.ts", "mpegts", "mpeg2video"), ("e.mpg", "mpeg", "mpeg2video"),
                             ("f.wmv", "asf", "wmv2")]:
        _write(tmp_path / name, fmt, codec)
    (tmp_path / "notes.txt").write_text("not a video")
    qs, skipped = build_questions(tmp_path, question="What colour?")
    assert sorted(q.id for q in qs) == ["a", "b", "c"]
    assert [Path(s.split(":")[0]).name for s in skipped] == ["d.ts", "e.mpg", "f.wmv"]
    assert all("not read from a folder" in s and "ffmpeg -i" in s for s in skipped)
    only = tmp_path / "only"
    only.mkdir()
    (tmp_path / "d.ts").rename(only / "d.ts")
    with pytest.raises(InputError, match=r"no video files .*\n  .*d\.ts: not read from a folder"):
        build_questions(only, question="What colour?")
    qs, skipped = build_questions(only / "d.ts", question="What colour?")  # named, it is read as it is
    assert [q.id for q in qs] == ["d.ts"] and not skipped

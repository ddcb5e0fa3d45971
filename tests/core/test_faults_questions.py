"""How questions are read and answers reported: video URLs, questions without options, tasks, the containers a
folder holds, and answers not in the exact form for their task."""
import json
from pathlib import Path

import pytest

from m1.agents.parsers import answer_in_form
from m1.data.questions import InputError, build_questions, read_questions
from m1.data.records import INVALID, check_question
from m1.run import RunSummary
from m1.schema import Question
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


def test_a_file_url_is_read_as_its_path_and_other_urls_name_the_field(tmp_path):
    """A `file:///abs/v.mp4` video is read as the file it names, as `m1 serve` reads one, not joined under the videos
    folder; an http URL or another host is an error row naming the field."""
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
    """A question with neither options nor task is open, as `--question` without options is; with options, mcq."""
    q, problem = check_question({"id": "q", "video": "v.mp4", "text": "Describe what happens."})
    assert problem is None and q.task == "open"
    q, problem = check_question({"id": "q", "video": "v.mp4", "text": "Which?", "options": ["a", "b"]})
    assert problem is None and q.task == "mcq"


def test_answers_not_in_the_form_of_their_task_are_flagged_and_counted():
    """An open question answered "D" and an mcq answered null (its agents wrote spans, not options) are not in the
    exact form for their task: `answer_in_form` is the row's `answer_ok`, and the summary counts them."""
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
    """Each row carries `answer_ok` as `answer_in_form` judges it, the closing summary counts the false ones, and
    eval's metrics count them (n_not_in_form, n_no_answer)."""
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
    """An unknown --task is refused at once with --question and with --questions; a --task beside a questions file
    (where each line gives its own) is refused too."""
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
    """A folder's GIF, FLV and 3GP videos are read; its MPEG-TS, MPEG-PS and ASF files, which the readers here do
    not decode frame-exact, are each named as skipped (counted as skipped inputs: exit 1) with what to do, and a
    folder holding only such files says so."""
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

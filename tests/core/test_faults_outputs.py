"""Where a run writes: output places that are not what the command writes there, trace names for every id, and
results files that cannot be trusted are refused or handled before anything is answered."""
import json
import os
import socket
from pathlib import Path

import pytest

from m1.data.questions import InputError
from m1.files import PlaceError, check_place
from m1.locks import hold, hold_dir
from m1.results import ResultsFile
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
    """Every place that is not a regular file (a FIFO, a device, a socket) as --out of infer and eval, as --trace-dir
    or as a locked output folder is one error line naming the place and what it is, before anything is opened or
    loaded: opening a FIFO blocks until a reader comes, and a device cannot be read back to resume."""
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
    """A file where a folder belongs (eval's --out, --trace-dir, a training out_dir, or halfway along the path) is
    named as such, with what to do."""
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
    """Trace names fit the file system's 255-byte names for ids of every script and length: they are cut in bytes,
    never through a letter (a letter of another script takes 2-4 bytes), and stay distinct."""
    name = trace_name(qid)
    assert len(name.encode()) <= 140
    for suffix in (".json", ".html"):
        (tmp_path / f"{name}{suffix}").write_text("x")
        (tmp_path / f".{name}{suffix}.12345678.tmp").write_text("x")  # write_whole's temporary file
    assert trace_name(qid + "x") != name
    assert trace_name("clip_1") == "clip_1" != trace_name("clip 1")


def test_an_id_in_a_long_script_keeps_its_answer_and_trace(tmp_path, m1_cache):
    """The run answers and writes the trace of an id of 200 CJK letters."""
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
    """A negative --limit is refused before anything runs (a slice would drop the last questions without a word)."""
    for cmd in (["infer", tmp_path, "--questions", one_video, "--out", tmp_path / "r.jsonl"],
                ["eval", "-b", "jsonl", "--annotations", one_video, "--videos", tmp_path, "--out", tmp_path / "ev"]):
        r = invoke(*cmd, "--team", "tiny", "--limit", "-1")
        assert r.exit_code == 2 and "--limit" in r.output and "greater than or equal to 0" in r.output, r.output
    assert not (tmp_path / "r.jsonl").exists()
    from m1.run import plan_resume

    with pytest.raises(InputError, match="limit -1"):
        plan_resume([], ResultsFile(tmp_path / "x.jsonl"), -1, False, False)


def test_answers_without_their_team_record_are_not_resumed(tmp_path, one_video, m1_cache):
    """A results file whose team record is gone is not resumed: which team wrote its answers cannot be told, and eval
    would score a mix."""
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
    """A results file listing an id twice (two files joined) is refused, naming the ids and lines: which line is the
    answer cannot be told."""
    path = tmp_path / "r.jsonl"
    rows = [{"id": "a", "answer": "A"}, {"id": "b", "answer": "B"}, {"id": "a", "answer": "C"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InputError, match=r"1 question ids have more than one line: 'a' \(lines 1, 3\)"):
        ResultsFile(path)

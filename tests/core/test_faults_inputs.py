"""Bad inputs: files from phones and hand-written question files, as a new user brings them. Each is read as meant,
or is an error row or one message naming the culprit. Beside tests/core/test_faults.py, whose helpers it uses."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import make_video, top_boxes
from tests.core.test_faults import intact, invoke, one_error

pytestmark = pytest.mark.slow


def rotated_phone_video(path: Path, w: int = 128, h: int = 96, n: int = 16, fps: int = 4) -> Path:
    """A w x h picture with a 90-degree display matrix in `tkhd`, as phones write a portrait video."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.set_display_rotation(90)
        for i in range(n):
            img = np.zeros((h, w, 3), np.uint8)
            img[:] = (20 * (i // fps), 60, 200)
            img[: h // 2, : w // 2] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def blank_payload(src: Path, dst: Path) -> Path:
    """`src` with every byte of its `mdat` zeroed: the headers read, no frame decodes."""
    data = bytearray(src.read_bytes())
    for off, kind, size in top_boxes(bytes(data)):
        if kind == b"mdat":
            data[off + 8: off + size] = bytes(size - 8)
    dst.write_bytes(bytes(data))
    return dst


def write_questions(path: Path, rows: list[dict], bom: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


def test_a_rotated_phone_video_is_read_upright_and_answered_from_its_frames(tmp_path, m1_cache):
    """The frames of a 90-degree phone video pass their size check: they are read as a player shows them
    (96 x 128) and the answer uses them (`frames_used` above 0, `error: null`)."""
    from m1.video import VideoReader

    d = tmp_path / "phone"
    d.mkdir()
    video = rotated_phone_video(d / "portrait.mp4")
    reader = VideoReader(video)
    assert (reader.info.width, reader.info.height, reader.info.rotation) == (96, 128, 270)
    assert reader.frames([0]).shape == (1, 128, 96, 3)
    out = tmp_path / "r.jsonl"
    r = invoke("infer", d, "-q", "What colour is the background?", "-o", "blue", "-o", "red", "--out", out)
    assert r.exit_code == 0, r.output
    (row,) = intact(out)
    assert row["error"] is None and row["frames_used"] > 0, row


def test_no_answer_from_nothing_a_video_with_no_readable_frame_is_an_error_row(tmp_path, m1_cache):
    """The general rule: a video whose headers read but whose frames do not decode gets no answer with
    `frames_used: 0`; it is an error row naming the file and why, in m1 infer and m1 eval (exit 1), and the other
    video of the run is answered."""
    d = tmp_path / "vids"
    d.mkdir()
    make_video(d / "good.mp4", seconds=4, fps=2, size=64)
    blank_payload(d / "good.mp4", d / "blank.mp4")
    out = tmp_path / "r.jsonl"
    r = invoke("infer", d, "-q", "What is shown?", "-o", "a", "-o", "b", "--out", out)
    assert r.exit_code == 1, r.output
    rows = {x["id"]: x for x in intact(out)}
    assert rows["good"]["error"] is None
    assert rows["blank"]["answer"] is None and str(d / "blank.mp4") in rows["blank"]["error"], rows["blank"]
    qs = write_questions(tmp_path / "q.jsonl", [{"id": "b", "video": "blank.mp4", "text": "What?",
                                                 "options": ["a", "b"], "answer": "A"},
                                                {"id": "g", "video": "good.mp4", "text": "What?",
                                                 "options": ["a", "b"], "answer": "A"}])
    r = invoke("eval", "-b", "jsonl", "--annotations", qs, "--videos", d, "--out", tmp_path / "ev")
    assert r.exit_code == 1, r.output
    rows = {x["id"]: x for x in intact(tmp_path / "ev" / "predictions.jsonl")}
    assert rows["b"]["answer"] is None and "blank.mp4" in rows["b"]["error"] and rows["g"]["error"] is None


def test_frames_that_fail_after_opening_give_an_error_row_not_an_answer(tmp_path, m1_cache, monkeypatch):
    """A video that opens and shows its first frame but whose later frames all fail: the team's tools read none,
    so the question is an error row that names the first failure ("no frame could be read"), never an answer."""
    from m1.config import load_team
    from m1.run import run_questions
    from m1.schema import Question
    from m1.video import VideoError, VideoReader

    make_video(tmp_path / "v.mp4", seconds=4, fps=2, size=64)
    real = VideoReader.frames

    def frames(self, indices):
        indices = list(indices)
        if indices == [0]:
            return real(self, indices)
        raise VideoError(self.path, "decoder gave up at frame 3")

    monkeypatch.setattr(VideoReader, "frames", frames)
    q = Question(id="q", video=str(tmp_path / "v.mp4"), text="What?", options=["a", "b"])
    summary = run_questions(load_team("tiny"), [q], tmp_path / "r.jsonl", progress=False)
    (row,) = intact(tmp_path / "r.jsonl")
    assert row["answer"] is None and row["error"].startswith("no frame could be read, so no answer is given"), row
    assert "decoder gave up at frame 3" in row["error"] and len(summary.errors) == 1


def test_more_than_26_options_is_an_error_row_and_the_rest_is_answered(tmp_path, m1_cache):
    """27 options (or an empty text) is no crash: the validation m1 serve applies holds in m1 infer and m1 eval,
    an error row naming the field, the other questions answered."""
    d = tmp_path / "vids"
    d.mkdir()
    make_video(d / "clip.mp4", seconds=4, fps=2, size=64)
    rows = [{"id": "many", "video": "clip.mp4", "text": "Which?", "options": [f"o{i}" for i in range(27)]},
            {"id": "fine", "video": "clip.mp4", "text": "Which?", "options": ["a", "b"]},
            {"id": "blank", "video": "clip.mp4", "text": "   ", "options": ["a", "b"]}]
    qs = write_questions(tmp_path / "q.jsonl", rows)
    out = tmp_path / "r.jsonl"
    r = invoke("infer", d, "--questions", qs, "--out", out)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    got = {x["id"]: x["error"] for x in intact(out)}
    assert got["fine"] is None
    assert "options" in got["many"] and "27 options: at most 26 (A-Z)" in got["many"]
    assert "field 'text': the question is empty" in got["blank"]
    r = invoke("eval", "-b", "jsonl", "--annotations", qs, "--videos", d, "--out", tmp_path / "ev")
    assert r.exit_code == 1, r.output
    assert {x["id"]: x["error"] for x in intact(tmp_path / "ev" / "predictions.jsonl")} == got


def test_a_bom_is_read_and_skipped_lines_are_counted_and_exit_1(tmp_path, m1_cache):
    """A UTF-8 BOM (Notepad) is read and the first question answered; a skipped line is counted and repeated in the
    closing summary, and the run exits 1 (0 with --allow-errors)."""
    d = tmp_path / "vids"
    d.mkdir()
    make_video(d / "clip.mp4", seconds=4, fps=2, size=64)
    qs = write_questions(tmp_path / "q.jsonl", [{"id": "first", "video": "clip.mp4", "text": "Which?",
                                                 "options": ["a", "b"]}], bom=True)
    out = tmp_path / "r.jsonl"
    r = invoke("infer", d, "--questions", qs, "--out", out)
    assert r.exit_code == 0, r.output
    assert [x["id"] for x in intact(out)] == ["first"]
    qs.write_bytes(qs.read_bytes() + b"{not json\n")
    r = invoke("infer", d, "--questions", qs, "--out", out)
    assert r.exit_code == 1, r.output
    assert "0 answered, 1 already done, 0 errors, 1 input lines skipped" in r.stdout, r.stdout
    assert f"  skipped: {qs}:2: malformed question" in r.stdout  # repeated below the progress bar
    assert "exit 1: 1 input lines were skipped (--allow-errors exits 0)" in r.stderr
    assert invoke("infer", d, "--questions", qs, "--out", out, "--allow-errors").exit_code == 0
    ev = invoke("eval", "-b", "jsonl", "--annotations", qs, "--videos", d, "--out", tmp_path / "ev")
    assert ev.exit_code == 1 and "1 input lines skipped" in ev.stdout, ev.output
    assert [x["id"] for x in intact(tmp_path / "ev" / "predictions.jsonl")] == ["first"]


def test_a_videos_folder_that_vanishes_mid_run_is_one_message(tmp_path, m1_cache, monkeypatch):
    """A videos folder removed during a run is one message, not one `error:` line per remaining question: it names
    the folder and how many questions were left as error rows; the rerun answers them."""
    import m1.run

    d = tmp_path / "vids"
    d.mkdir()
    for i in range(6):
        make_video(d / f"v{i}.mp4", seconds=2, fps=2, size=32)
    real = m1.run.make_team

    class Vanishing:  # the team, whose videos folder is moved away once the first answer is written
        def __init__(self, cfg):
            self.team = real(cfg)

        def run(self, questions, on_episode=None):
            def done(ep):
                on_episode(ep)
                if d.exists():
                    shutil.move(d, tmp_path / "elsewhere")
            return self.team.run(questions, on_episode=done)

    monkeypatch.setattr(m1.run, "make_team", Vanishing)
    out = tmp_path / "r.jsonl"
    r = invoke("infer", d, "-q", "Which?", "-o", "a", "-o", "b", "--out", out, "--set", "limits.batch_episodes=1")
    assert r.exit_code == 1, r.output
    errors = [x for x in r.stdout.splitlines() if "error:" in x]
    assert errors == [f"  error: the videos folder {d} was gone when 5 questions were asked: they are error rows "
                      f"in {out}; rerun the same command once the folder is back to answer them"], r.stdout
    monkeypatch.setattr(m1.run, "make_team", real)
    shutil.move(tmp_path / "elsewhere", d)
    r = invoke("infer", d, "-q", "Which?", "-o", "a", "-o", "b", "--out", out, "--set", "limits.batch_episodes=1")
    assert r.exit_code == 0 and "retried 5 earlier errors: 5 now answered" in r.stdout, r.output


def test_serve_refuses_a_non_loopback_address_without_a_key_unless_insecure(tmp_path):
    """`--host 0.0.0.0` without an API key is refused, naming what would be reachable; `--insecure` serves with
    that as a warning; a loopback address gives no warning."""
    pytest.importorskip("fastapi")
    r = invoke("serve", "--host", "0.0.0.0", "--allowed-media-root", tmp_path)
    line = one_error(r, "--host 0.0.0.0 with no --api-key-env", str(tmp_path), "--insecure")
    assert "file:// URL" in line
    r = invoke("serve", "--host", "0.0.0.0", "--allowed-media-root", tmp_path, "--insecure", "--team", "no_such_team")
    assert f"warning: --host 0.0.0.0 with no --api-key-env" in r.stderr and r.exit_code == 2, r.output
    r = invoke("serve", "--host", "127.0.0.1", "--team", "no_such_team")  # loopback: no warning
    assert "warning:" not in r.stderr and r.exit_code == 2

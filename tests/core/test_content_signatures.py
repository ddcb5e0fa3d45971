"""Content, not names: what M1 keeps about a video (a reader, its frames, CLIP rows, a results line) stands for the
content it was read from, and a pool holds a bounded number of files open."""
import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from m1.config import load_team
from m1.run import run_questions
from m1.schema import AgentRecord, Episode, Question, Topology
from m1 import video
from m1.video import VideoError, VideoPool, VideoReader, probe
from tests.conftest import holds_file_open, make_video


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Two videos that differ in length and in every frame's colour."""
    d = tmp_path_factory.mktemp("two")
    return make_video(d / "short.mp4", seconds=4, fps=4), make_video(d / "long.mp4", seconds=20, fps=4, size=48)


def rewrite_in_place(path: Path, source: Path) -> None:
    """What `cp source path` does: the same file (inode), truncated and written again."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(source.read_bytes())


class ReadingTeam:
    """Answers each question with the mean of the first and last frames it reads through a real VideoPool (as the
    teams do); `after(k)` runs once question k's line is written."""

    def __init__(self, after=None):
        self.pool = VideoPool(max_bytes=64 << 20)
        self.after = after

    def run(self, questions, on_episode=None):
        for k, q in enumerate(questions):
            reader = self.pool.open(q.video)
            frames = reader.frames([0, len(reader) - 1])
            on_episode(Episode(id=q.id, question=q, topology=Topology(agents=["a"], active=["a"], edges=[]),
                               memory={"a": AgentRecord()}, final_answer=f"{frames.mean():.3f}"))
            if self.after is not None:
                self.after(k)


def _rows(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_a_replaced_file_gets_a_new_reader_and_never_its_old_frames(two, tmp_path):
    """The pool `m1 serve` answers from: a file copied or moved over a path gets a new reader from `VideoPool.open`,
    which reads the new content, never the cached reader's old frames."""
    short, long = two
    v = tmp_path / "v.mp4"
    shutil.copy(short, v)
    pool = VideoPool(max_bytes=64 << 20)
    first = pool.open(v)
    old = first.frames([0])
    shutil.copy(long, v)  # cp over it
    second = pool.open(v)
    assert second is not first and len(second) == probe(long).num_frames
    assert np.array_equal(second.frames([0]), VideoReader(long).frames([0])) and second.decoded == 1
    assert old.shape != second.frames([0]).shape
    os.replace(shutil.copy(short, tmp_path / "new.mp4"), v)  # mv a new file into its place
    third = pool.open(v)
    assert third is not second and len(third) == probe(short).num_frames
    assert np.array_equal(third.frames([0]), VideoReader(short).frames([0]))


def test_a_reader_never_mixes_frames_of_a_file_rewritten_in_place(two, tmp_path):
    """At the reader: a file rewritten in place never gives frame 0 from the cache (old file) and frame 5 decoded
    from the new one; it raises VideoChanged, and from then on even for frames it holds."""
    short, long = two
    v = tmp_path / "v.mp4"
    shutil.copy(short, v)
    reader = VideoPool(max_bytes=64 << 20).open(v)
    reader.frames([0])
    rewrite_in_place(v, long)
    with pytest.raises(video.VideoChanged, match="changed on disk while it was being read.*rerun"):
        reader.frames([0, 5])
    with pytest.raises(video.VideoChanged):  # and from then on, even for frames it holds
        reader.frames([0])
    assert isinstance(video.VideoChanged(v, "x"), VideoError)  # an error row, like any unreadable video


def test_a_video_rewritten_during_a_run_is_an_error_row_that_a_rerun_answers(two, tmp_path):
    """A second process copies another video over the first after the first result line: the questions left are
    error rows naming the change, never answers from cached old frames and new ones under the old fingerprint; a
    rerun answers every question under one fingerprint."""
    short, long = two
    v = tmp_path / "v.mp4"
    shutil.copy(short, v)
    qs = [Question(id=f"q{i}", video=str(v), text="Which?", options=["x", "y"]) for i in range(3)]
    out = tmp_path / "r.jsonl"
    summary = run_questions(load_team("tiny"), qs, out, progress=False,
                            team=ReadingTeam(after=lambda k: k == 0 and rewrite_in_place(v, long)))
    rows = _rows(out)
    assert rows["q0"]["error"] is None  # answered whole from the old file before it changed
    for q in ("q1", "q2"):
        assert "changed on disk during the run" in rows[q]["error"] and "rerun" in rows[q]["error"]
        assert rows[q]["answer"] is None
    assert summary.answered == 1 and len(summary.errors) == 2
    again = run_questions(load_team("tiny"), qs, out, progress=False, team=ReadingTeam())
    rows = _rows(out)
    assert again.answered == 3 and all(r["error"] is None for r in rows.values())  # q0: its video changed too
    assert len({r["answer"] for r in rows.values()}) == 1 and len({r["fp"] for r in rows.values()}) == 1


def test_a_rerun_sees_a_rewrite_that_kept_size_and_mtime(two, tmp_path):
    """Another video padded to the same size, its mtime restored in ns: the rerun sees the change and re-answers."""
    short, long = two
    v = tmp_path / "v.mp4"
    size = max(short.stat().st_size, long.stat().st_size) + 16
    v.write_bytes(short.read_bytes().ljust(size, b"\0"))
    qs = [Question(id="q0", video=str(v), text="Which?", options=["x", "y"])]
    out = tmp_path / "r.jsonl"
    run_questions(load_team("tiny"), qs, out, progress=False, team=ReadingTeam())
    before = _rows(out)["q0"]
    st = v.stat()
    rewrite_in_place(v, long)
    with open(v, "ab") as f:
        f.write(b"\0" * (size - long.stat().st_size))
    os.utime(v, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (v.stat().st_size, v.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    summary = run_questions(load_team("tiny"), qs, out, progress=False, team=ReadingTeam())
    after = _rows(out)["q0"]
    assert summary.changed == 1 and after["fp"] != before["fp"] and after["answer"] != before["answer"]


def test_lines_fingerprinted_before_content_signatures_are_not_re_answered(two, tmp_path):
    """A line whose fingerprint covers the path, size and mtime, not a content signature, still matches its
    unchanged file, so it is not re-answered; the same line after the file changed does not."""
    import hashlib

    from m1.results import fingerprint, same_question

    v = tmp_path / "v.mp4"
    shutil.copy(two[0], v)
    q = Question(id="q0", video=str(v), text="Which?", options=["x", "y"])
    st = v.resolve().stat()
    old = hashlib.sha256(json.dumps([[str(v.resolve()), st.st_size, st.st_mtime_ns], q.text, q.task,
                                     list(q.options), q.answer]).encode()).hexdigest()[:16]
    assert same_question(old, q, fingerprint(q)) and same_question(None, q, fingerprint(q))
    rewrite_in_place(v, two[1])
    assert not same_question(old, q, fingerprint(q))


def test_clip_rows_follow_the_content_not_the_name(two, tmp_path):
    """CLIP rows are kept by content, not by path: a replaced file is scored with its new frames, never the old."""
    from m1.tools.clip_index import ClipIndex
    from tests.fakes import FakeClip

    short, long = two
    v = tmp_path / "v.mp4"
    shutil.copy(short, v)
    pool, index = VideoPool(max_bytes=64 << 20), ClipIndex(FakeClip())
    a = index.frame_embeddings(pool.open(v), [0])
    shutil.copy(long, v)
    b = index.frame_embeddings(pool.open(v), [0])
    assert not np.allclose(a, b)
    assert np.allclose(b, ClipIndex(FakeClip()).frame_embeddings(VideoReader(long), [0]))


def test_the_pool_holds_at_most_max_open_files_and_reopens_what_it_released(tmp_path):
    """The pool keeps at most max_open files open, not one per distinct video; a released reader opens its file
    again when read."""
    videos = [make_video(tmp_path / f"v{i}.mp4", seconds=2, fps=2, size=32) for i in range(7)]
    fds = len(os.listdir("/proc/self/fd"))
    pool = VideoPool(max_bytes=0, max_open=3)  # no frame cache: every read decodes
    readers = [pool.open(v) for v in videos]
    for r in readers:
        r.frames([1])
    assert pool.open_files() == 3 and sum(holds_file_open(r) for r in readers) == 3
    assert len(os.listdir("/proc/self/fd")) - fds <= 3 + 1
    first = readers[0]  # released, still usable by whoever holds it: it opens its file again
    assert not holds_file_open(first) and first.frames([2]).shape == (1, 32, 32, 3) and holds_file_open(first)
    assert pool.open_files() == 3
    pool.close()
    assert pool.open_files() == 0 and not any(holds_file_open(r) for r in readers)


def test_running_out_of_file_handles_is_an_oserror_not_a_bad_video(tmp_path, monkeypatch):
    """Running out of file handles (as under `ulimit -n 48`) is an OSError, not a VideoError calling the video
    "unreadable" (a 400 blaming the file)."""
    import av

    v = make_video(tmp_path / "v.mp4", seconds=2, fps=2, size=32)

    def no_handles(*a, **k):
        raise av.error.OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(av, "open", no_handles)
    with pytest.raises(OSError) as err:
        VideoPool().open(v)
    assert err.value.errno == errno.EMFILE and not isinstance(err.value, VideoError)

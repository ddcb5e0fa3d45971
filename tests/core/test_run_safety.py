"""Nothing lost when runs collide, die, are preempted or fill the disk: one writer per results file
(m1.locks), --shard i/n + `m1 merge`, a graceful stop on SIGTERM, and whole lines on ENOSPC.

The `m1 infer` runs use the offline tiny team on the generated videos of test_e2e_tiny; the disk-full
tests use a scripted team in-process, since what is tested there is how lines are written."""
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from m1 import files
from m1.config import load_team
from m1.files import WriteError
from m1.locks import LockError, _read_info, hold, hold_dir, lock_path
from m1.team.engines_registry import TEAM_KINDS, KindSpec
from m1.schema import AgentRecord, Episode, Question, Topology
from m1.results import FINGERPRINT_PREFIX, result_row
from tests.core.test_e2e_tiny import REPO, _infer, folder  # noqa: F401  (folder is a fixture)

IDS = [f"q{i:02d}" for i in range(10)]


def holder(target: Path) -> dict | None:
    """The record of the process holding `target`'s lock now (a shared flock fails while it is held), or None."""
    try:
        fd = os.open(lock_path(target), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_info(fd) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _questions_file(tmp_path, ids=IDS) -> Path:
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"id": i, "video": f"clip{n % 3}.mp4", "text": "Which colour?",
                                         "options": ["white", "red"], "task": "mcq"}) + "\n"
                             for n, i in enumerate(ids)))
    return qfile


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def _wait_for(cond, p, seconds=300):
    deadline = time.time() + seconds
    while time.time() < deadline and p.poll() is None and not cond():
        time.sleep(0.05)
    assert cond(), f"never happened; run ended with {p.poll()}: {p.stderr.read() if p.poll() is not None else ''}"


# ------------------------------------------------------------------ locks

def test_lock_names_its_holder_and_is_released(tmp_path):
    target = tmp_path / "results.jsonl"
    with hold(target, "results file", "wait for it"):
        info = holder(target)
        assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
        assert info["started"].endswith("Z") and info["command"]
        with pytest.raises(LockError) as err:  # a second open file description is a second holder
            with hold(target, "results file", "wait for it"):
                pass
        msg = str(err.value)
        assert f"results file {target} is being written by pid {os.getpid()} on host {socket.gethostname()}" in msg
        assert msg.endswith("; wait for it")
    assert holder(target) is None and not (tmp_path / "results.jsonl.lock").exists()
    with hold_dir(tmp_path / "run", "training output folder"):
        assert (tmp_path / "run" / ".lock").is_file()
        with pytest.raises(LockError, match=r"output folder .*run is being written by pid \d+.*another output"):
            with hold_dir(tmp_path / "run", "training output folder"):
                pass
    assert not (tmp_path / "run" / ".lock").exists()


def test_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path):
    target = tmp_path / "results.jsonl"
    code = ("import sys, time; from m1.locks import hold\n"
            "cm = hold(sys.argv[1], 'results file'); cm.__enter__(); print('held', flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code, str(target)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    assert holder(target)["pid"] == p.pid
    with pytest.raises(LockError, match=f"pid {p.pid}"):
        with hold(target, "results file"):
            pass
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (tmp_path / "results.jsonl.lock").is_file() and holder(target) is None  # the file stays, the lock is gone
    warnings = []
    with hold(target, "results file", warn=warnings.append):
        assert holder(target)["pid"] == os.getpid()
    assert len(warnings) == 1 and f"pid {p.pid} is gone" in warnings[0] and str(target) in warnings[0]


def test_a_holder_that_has_not_written_yet_is_still_named(tmp_path):
    """Two runs started together: the loser meets the flock before the winner has written its record (an empty
    file), and it waits the moment that takes rather than naming 'another process'."""
    import fcntl
    import threading
    lf = tmp_path / "results.jsonl.lock"
    fd = os.open(lf, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, nothing written yet
    late = threading.Timer(0.3, lambda: os.write(fd, (json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                                   "started": "now", "command": "m1 infer"}) + "\n").encode()))
    late.start()
    try:
        with pytest.raises(LockError, match=f"being written by pid {os.getpid()} on host"):
            with hold(tmp_path / "results.jsonl", "results file"):
                pass
    finally:
        late.join()
        os.close(fd)


@pytest.mark.slow
def test_second_infer_on_the_same_results_is_refused(folder, tmp_path, m1_cache):  # noqa: F811
    out = tmp_path / "results.jsonl"
    args = ["--questions", str(_questions_file(tmp_path)), "--team", "tiny", "--set", "limits.batch_episodes=2"]
    first = _infer(folder, out, args)
    _wait_for(lambda: holder(out) is not None and holder(out).get("pid") == first.pid, first)
    second = _infer(folder, out, args)
    _, err = second.communicate(timeout=120)
    assert first.poll() is None, "the first run ended before the second was checked; make it longer"
    assert second.returncode == 2
    assert f"results file {out} is being written by pid {first.pid} on host {socket.gethostname()}" in err
    assert "m1 infer" in err and "--shard i/n" in err
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert _ids(out) == IDS  # each id once, in order
    assert not (tmp_path / "results.jsonl.lock").exists()


# ------------------------------------------------------------------ shards

@pytest.mark.slow
def test_shards_then_merge_give_every_id_once_in_order(folder, tmp_path, m1_cache):  # noqa: F811
    ids = IDS[:6]
    out = tmp_path / "results.jsonl"
    args = ["--questions", str(_questions_file(tmp_path, ids)), "--team", "tiny"]
    workers = [_infer(folder, out, [*args, "--shard", f"{i}/2"]) for i in range(2)]  # at once: one lock per part
    for w in workers:
        stdout, err = w.communicate(timeout=600)
        assert w.returncode == 0, err
        assert "when every part is done: m1 merge" in stdout
    part0, part1 = (tmp_path / f"results.jsonl.part-{i}-of-2.jsonl" for i in range(2))
    assert _ids(part0) == ["q00", "q02", "q04"] and _ids(part1) == ["q01", "q03", "q05"]
    assert not out.exists()
    runner = CliRunner()
    from m1.cli import app

    good1 = part1.read_text()
    part1.write_text("".join(good1.splitlines(keepends=True)[:-1]))  # worker 1 did not finish
    r = runner.invoke(app, ["merge", str(out)])
    assert r.exit_code == 2 and "results.jsonl.part-1-of-2.jsonl misses 'q05'" in r.output and "--shard 1/2" in r.output
    assert not out.exists()
    part0.write_text(part0.read_text() + good1.splitlines(keepends=True)[0])  # q01 in worker 0's part too
    part1.write_text(good1)
    r = runner.invoke(app, ["merge", str(out)])
    assert r.exit_code == 2 and "parts disagree: 'q01' is in both results.jsonl.part-0-of-2.jsonl and " \
                                "results.jsonl.part-1-of-2.jsonl" in r.output, r.output
    part0.write_text("".join(part0.read_text().splitlines(keepends=True)[:-1]))
    r = runner.invoke(app, ["merge", str(out)])
    assert r.exit_code == 0, r.output
    assert _ids(out) == ids and "merged 2 parts: 6 results" in r.output
    assert part0.exists() and part1.exists()  # kept unless asked
    assert json.loads((tmp_path / "results.jsonl.team.json").read_text()) == \
        json.loads((tmp_path / "results.jsonl.part-0-of-2.jsonl.team.json").read_text())
    r = runner.invoke(app, ["merge", str(out), "--delete-parts"])
    assert r.exit_code == 0 and "already holds the merge" in r.output, r.output
    assert not part0.exists() and not part1.exists() and not (tmp_path / "results.jsonl.shards.json").exists()
    assert _ids(out) == ids
    # the merged file resumes like any results file: a plain rerun has nothing left to do
    p = _infer(folder, out, args)
    stdout, err = p.communicate(timeout=300)
    assert p.returncode == 0 and "0 answered, 6 already done" in stdout, err


def test_shard_workers_must_share_one_input(tmp_path):
    from m1.data.questions import InputError
    from m1.results import parse_shard, record_split, shard_of

    qs = [Question(id=i, video="v.mp4", text="?") for i in IDS[:5]]
    assert [q.id for q in shard_of(qs, 1, 2)] == ["q01", "q03"]
    assert parse_shard("1/2") == (1, 2)
    with pytest.raises(InputError, match="need 0 <= i < n"):
        parse_shard("2/2")
    out = tmp_path / "r.jsonl"
    record_split(out, qs, 2)
    record_split(out, qs, 2)  # the second worker agrees
    with pytest.raises(InputError, match="splits into 2 parts, this run into 3"):
        record_split(out, qs, 3)
    with pytest.raises(InputError, match="lists 5 questions, this run 4"):
        record_split(out, qs[:4], 2)


# ------------------------------------------------------------------ graceful stop

@pytest.mark.slow
def test_sigterm_stops_between_lines_and_the_rerun_finishes(folder, tmp_path, m1_cache):  # noqa: F811
    out = tmp_path / "results.jsonl"
    args = ["--questions", str(_questions_file(tmp_path, IDS[:6])), "--team", "tiny",
            "--set", "limits.batch_episodes=2"]
    p = _infer(folder, out, args)
    _wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 2, p)
    assert p.poll() is None, "run finished before it could be stopped; make it longer"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    data = out.read_text()
    assert data.endswith("\n")
    done = _ids(out)
    assert 2 <= len(done) < 6 and done == IDS[:len(done)]
    assert (f"stopped by SIGTERM: {len(done)} of 6 questions answered in {out}; "
            f"rerun the same command to continue") in err
    assert "Traceback" not in err and not (tmp_path / "results.jsonl.lock").exists()
    p = _infer(folder, out, args)
    stdout, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert f"{6 - len(done)} answered, {len(done)} already done" in stdout
    assert _ids(out) == IDS[:6]


_MID_LINE = """
import sys, time
from pathlib import Path
from m1 import files, run
from m1.config import load_team
from m1.signals import Stopped
from m1.schema import AgentRecord, Episode, Question, Topology

class Team:
    pool = None
    def run(self, questions, on_episode=None):
        for q in questions:
            on_episode(Episode(id=q.id, question=q, topology=Topology(agents=["a"], active=["a"], edges=[]),
                               memory={"a": AgentRecord()}, final_answer="A"))

class SlowWrite:  # half a line, a pause, the other half: signals arrive mid-line
    def __init__(self, f):
        self.f = f
    def write(self, data):
        n = self.f.write(bytes(data[:len(data) // 2]))
        print("mid-line", flush=True)
        time.sleep(3)
        return n + self.f.write(bytes(data[len(data) // 2:]))
    def fileno(self):
        return self.f.fileno()
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()

plain = files.open_for_write  # the team stamp beside the results is written as usual
files.open_for_write = lambda path, mode: (SlowWrite(open(path, mode, buffering=0)) if Path(path).suffix == ".jsonl"
                                           else plain(path, mode))
qs = [Question(id=f"q{i}", video="v.mp4", text="?") for i in range(3)]
try:
    run.run_questions(load_team("tiny"), qs, Path(sys.argv[1]), team=Team(), progress=False, stop_on_signals=True)
except Stopped as exc:
    print(exc, flush=True)
    sys.exit(exc.exit_status)
"""


def _stop_mid_line(tmp_path, signals):
    out = tmp_path / "results.jsonl"
    p = subprocess.Popen([sys.executable, "-c", _MID_LINE, str(out)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "mid-line", p.stderr.read()
    t0 = time.time()
    for s in signals:
        p.send_signal(s)
        time.sleep(0.2)
    stdout, err = p.communicate(timeout=60)
    return p.returncode, stdout, err, time.time() - t0, out


def test_a_signal_mid_line_lets_the_line_finish(tmp_path):
    from m1.results import ResultsFile

    status, stdout, err, _, out = _stop_mid_line(tmp_path, [signal.SIGTERM])
    assert status == 143, err
    assert _ids(out) == ["q0"] and out.read_text().endswith("\n")  # the line being written, whole; no more
    assert "stopped by SIGTERM: 1 of 3 questions answered in" in stdout
    assert ResultsFile(out).done == {"q0"}


def test_a_second_signal_stops_at_once(tmp_path):
    from m1.results import ResultsFile

    status, _, err, seconds, out = _stop_mid_line(tmp_path, [signal.SIGTERM, signal.SIGINT])
    assert status == 130 and seconds < 2.5, (status, seconds, err)  # did not wait for the 3 s write
    assert out.read_bytes() and not out.read_bytes().endswith(b"\n")  # it left half a line ...
    assert ResultsFile(out).done == set() and out.read_bytes() == b""  # ... which the next run cuts away


# ------------------------------------------------------------------ disk full

class FullDisk:
    """Files opened for writing through it share `room` bytes: a write past that lands in part and
    raises ENOSPC, as on a disk that fills up. `only(path)` picks the files on this disk."""

    def __init__(self, room, only=lambda path: True):
        self.room, self.only = room, only

    def open(self, path, mode):
        f = open(path, mode, buffering=0)
        return _OnDisk(f, self) if self.only(Path(path)) else f


class _OnDisk:
    def __init__(self, f, disk):
        self.f, self.disk = f, disk

    def write(self, data):
        data = bytes(data)
        if len(data) > self.disk.room:
            self.f.write(data[:self.disk.room])
            self.disk.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.disk.room -= len(data)
        return self.f.write(data)

    def fileno(self):
        return self.f.fileno()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class ScriptedTeam:
    """Answers A to everything at once: the disk, not the team, is under test."""

    pool = None  # decodes no video (m1/contracts.py Team)

    def __init__(self, cfg=None):
        pass

    def run(self, questions, on_episode=None):
        for q in questions:
            on_episode(_episode(q))


def _episode(q):
    return Episode(id=q.id, question=q, topology=Topology(agents=["a"], active=["a"], edges=[]),
                   memory={"a": AgentRecord(plan=["Global Sampling"], answer="A")}, final_answer="A",
                   aggregation="vote", timings={"batch_wall": 0.01, "batch_size": 1.0})


def _qs(tmp_path, n=5):
    return [Question(id=f"q{i:02d}", video=str(tmp_path / f"v{i}.mp4"), text="Which?", options=["x", "y"])
            for i in range(n)]


def test_disk_full_on_a_results_line_cuts_it_back_and_the_rerun_completes(tmp_path, monkeypatch):
    from m1 import run
    from m1.cli import app

    monkeypatch.setitem(TEAM_KINDS, "cpp", KindSpec("cpp", ScriptedTeam))
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"id": f"q{i:02d}", "video": f"v{i}.mp4", "text": "Which?",
                                         "options": ["x", "y"]}) + "\n" for i in range(5)))
    out = tmp_path / "results.jsonl"
    row = {**result_row(_episode(_qs(tmp_path, 1)[0])), "fp": FINGERPRINT_PREFIX + "0" * 16}  # a line and its fingerprint
    line = len((json.dumps(row, ensure_ascii=False) + "\n").encode())
    disk = FullDisk(room=2 * line + 10, only=lambda path: path == out)  # two lines fit, the third tears
    monkeypatch.setattr(files, "open_for_write", disk.open)
    args = ["infer", str(tmp_path), "--questions", str(qfile), "--team", "tiny", "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2
    assert (f"error: disk full while writing {out} (question q02): free space and rerun the same command; "
            f"2 answers are safely written in {out}") in r.output
    assert out.read_bytes().endswith(b"\n") and out.stat().st_size == 2 * line and _ids(out) == ["q00", "q01"]
    assert not (tmp_path / "results.jsonl.lock").exists()
    monkeypatch.setattr(files, "open_for_write", lambda path, mode: open(path, mode, buffering=0))  # space freed
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "3 answered, 2 already done" in r.output and _ids(out) == [f"q{i:02d}" for i in range(5)]


def test_disk_full_on_a_trace_leaves_no_torn_file_and_the_rerun_completes(tmp_path, monkeypatch):
    from m1 import run

    cfg, qs = load_team("tiny"), _qs(tmp_path)
    out, traces = tmp_path / "results.jsonl", tmp_path / "traces"
    from m1.trace import render_html

    ep = _episode(qs[0])  # every episode of ScriptedTeam has traces of these sizes (ids of one length)
    size = len(ep.model_dump_json(indent=1).encode()) + len(render_html(ep).encode())
    disk = FullDisk(room=2 * size + 100, only=lambda path: path.parent == traces)  # q02's JSON trace tears
    monkeypatch.setattr(files, "open_for_write", disk.open)
    with pytest.raises(WriteError) as err:
        run.run_questions(cfg, qs, out, trace_dir=traces, team=ScriptedTeam(), progress=False)
    assert _ids(out) == ["q00", "q01"]  # the question whose trace failed has no results line
    msg = str(err.value)
    assert msg == (f"disk full while writing {traces / 'q02.json'} (question q02): free space and rerun the same "
                   f"command; 2 answers are safely written in {out}")
    assert sorted(f.name for f in traces.iterdir()) == [".results", "q00.html", "q00.json", "q01.html",
                                                        "q01.json"]  # no torn
    assert all(json.loads((traces / f"q0{i}.json").read_text())["id"] == f"q0{i}" for i in range(2))  # or tmp file
    monkeypatch.undo()
    summary = run.run_questions(cfg, qs, out, trace_dir=traces, team=ScriptedTeam(), progress=False)
    assert summary.answered == 3 and summary.skipped_done == 2
    assert _ids(out) == [q.id for q in qs]
    assert sorted(f.name for f in traces.iterdir()) == sorted(
        [f"{q.id}{s}" for q in qs for s in (".json", ".html")] + ["index.html", ".results"])



# ------------------------------------------------------------------ error rows, shards, bad inputs

class VideoTeam(ScriptedTeam):
    """Answers A, or records an error for a question whose video file is not there (as the real team does)."""

    def run(self, questions, on_episode=None):
        for q in questions:
            ep = _episode(q)
            if not Path(q.video).is_file():
                ep.error, ep.final_answer = f"cannot open video {q.video}: no such file", None
            on_episode(ep)


def test_error_rows_are_retried_by_default_and_kept_with_keep_errors(tmp_path, monkeypatch):
    from m1.cli import app

    monkeypatch.setitem(TEAM_KINDS, "cpp", KindSpec("cpp", VideoTeam))
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"id": f"q{i:02d}", "video": f"v{i}.mp4", "text": "Which?",
                                         "options": ["x", "y"]}) + "\n" for i in range(3)))
    for i in (0, 2):
        (tmp_path / f"v{i}.mp4").write_bytes(b"x")
    out = tmp_path / "results.jsonl"
    args = ["infer", str(tmp_path), "--questions", str(qfile), "--team", "tiny", "--out", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1 and "2 answered, 0 already done, 1 errors" in r.stdout, r.output
    assert [json.loads(x)["error"] is not None for x in out.read_text().splitlines()] == [False, True, False]
    r = CliRunner().invoke(app, args + ["--keep-errors"])
    assert r.exit_code == 0 and "0 answered, 3 already done, 0 errors" in r.stdout
    assert "1 earlier errors kept as they are (--keep-errors)" in r.stdout
    before = out.read_bytes()
    r = CliRunner().invoke(app, args)  # the video is still missing: retried, still an error, the line replaced
    assert r.exit_code == 1 and "retried 1 earlier errors: 0 now answered, 1 still errors" in r.stdout, r.output
    assert _ids(out) == ["q00", "q01", "q02"] and out.read_bytes().splitlines()[0] == before.splitlines()[0]
    (tmp_path / "v1.mp4").write_bytes(b"x")  # the video is restored
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "1 answered, 2 already done, 0 errors" in r.stdout, r.output
    assert "retried 1 earlier errors: 1 now answered, 0 still errors" in r.stdout
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in rows] == ["q00", "q01", "q02"] and [x["error"] for x in rows] == [None] * 3
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "0 answered, 3 already done, 0 errors" in r.stdout and "earlier errors" not in r.stdout


def test_merge_names_the_ids_of_a_missing_part(tmp_path):
    from m1 import run
    from m1.data.questions import InputError
    from m1.results import merge_parts

    cfg, qs = load_team("tiny"), _qs(tmp_path, 5)
    out = tmp_path / "results.jsonl"
    run.run_questions(cfg, qs, out, team=ScriptedTeam(), progress=False, shard=(0, 2))
    with pytest.raises(InputError) as err:
        merge_parts(out)
    assert str(err.value) == (f"cannot merge into {out}: results.jsonl.part-1-of-2.jsonl (ids 'q01', 'q03') missing; "
                              f"run those workers (--shard 1/2) first")


def test_bad_bytes_empty_files_and_folders_as_files_are_one_line(tmp_path, monkeypatch):
    from m1.cli import app

    monkeypatch.setitem(TEAM_KINDS, "cpp", KindSpec("cpp", ScriptedTeam))
    qfile = tmp_path / "q.jsonl"
    good = [json.dumps({"id": f"q{i}", "video": "v.mp4", "text": "Which?", "options": ["x", "y"]}) for i in range(3)]
    qfile.write_bytes((good[0] + "\n" + good[1].replace("Which", "Wh\xffich") + "\n").encode("latin-1")
                      + (good[2] + "\n").encode())
    out = tmp_path / "results.jsonl"
    r = CliRunner().invoke(app, ["infer", str(tmp_path), "--questions", str(qfile), "--out", str(out)])
    assert r.exit_code == 1 and "2 answered" in r.stdout and "1 input lines skipped" in r.stdout, r.output
    assert f"skipped: {qfile}:2: malformed question (not UTF-8: byte 0xff at column" in r.stderr
    assert _ids(out) == ["q0", "q2"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for argv, words in ((["--questions", str(empty), "--out", str(tmp_path / "e.jsonl")],
                         f"error: {empty}: no usable questions (0 skipped); nothing to answer"),
                        (["--questions", str(qfile), "--out", str(tmp_path)],
                         f"error: {tmp_path}: is a folder; the results need a file path"),
                        (["--questions", str(tmp_path), "--out", str(out)],
                         f"error: {tmp_path}: is a folder; --questions needs a JSONL file")):
        r = CliRunner().invoke(app, ["infer", str(tmp_path), *argv])
        assert r.exit_code == 2 and "Traceback" not in r.stderr, r.output
        assert len([x for x in r.stderr.splitlines() if x.startswith("error:")]) == 1, r.stderr
        assert r.stderr.splitlines()[-1].startswith(words), r.stderr
    assert _ids(out) == ["q0", "q2"]

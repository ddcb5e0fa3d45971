"""Running a team over many questions: resumable results, traces, progress.

`run_questions` answers questions into a results file (m1/results.py: one whole line per question, a torn last line
cut off on start, ids already present skipped), so a run killed at any moment and rerun lists every id exactly once.
A line (or trace) that cannot be written whole — disk full — is cut back to the previous size and the run stops
with a `WriteError`; one run at a time writes a results file (`m1.locks`); SIGTERM/SIGINT stop it between two lines
(m1/signals.py `Stopped`). `--shard i/n` splits the questions over workers, `merge_parts` (m1/results.py) joins them.
Questions are read by m1/data/questions.py.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from m1.config import TeamConfig
from m1.contracts import Team
from m1.data.loaders import INVALID
from m1.files import WriteError, write_whole
from m1.locks import hold
from m1.results import (ResultsFile, changed_since, check_team, fingerprint, invalid_row, part_path, record_split,
                        result_row, same_question, shard_of)
from m1.schema import Episode, Question
from m1.signals import Stopped, StopOnSignals
from m1.team.kinds import make_team
from m1.trace import TraceIndex, render_html, trace_name


@dataclass
class RunSummary:
    """What `run_questions` did, counted for the closing message (`describe`)."""

    out: Path
    answered: int = 0
    skipped_done: int = 0
    errors: list[str] = field(default_factory=list)
    correct: int = 0
    graded: int = 0
    seconds: float = 0.0
    retried: int = 0  # earlier error lines answered again (their lines replaced)
    retried_failed: int = 0  # of those, how many ended in an error again
    kept_errors: int = 0  # earlier error lines left as they are (--keep-errors)
    changed: int = 0  # done questions asked differently since their line was written, answered again
    kept_stale: int = 0  # of those, left as they are (--keep-stale)
    skipped: list[str] = field(default_factory=list)  # input lines skipped unread (the command's `skipped:` lines)
    # folder -> ids of the questions that failed because their videos folder was gone when they were asked
    vanished: dict[str, list[str]] = field(default_factory=dict)

    SKIPPED_SHOWN = 10  # skipped lines repeated in the closing summary (they scroll away above the progress bar)

    def describe(self) -> str:
        lines = [f"{self.answered} answered, {self.skipped_done} already done, {len(self.errors)} errors"
                 + (f", {len(self.skipped)} input lines skipped" if self.skipped else "")
                 + f" in {self.seconds:.1f}s -> {self.out}"]
        if self.retried:
            lines.append(f"retried {self.retried} earlier errors: {self.retried - self.retried_failed} now answered, "
                         f"{self.retried_failed} still errors")
        if self.kept_errors:
            lines.append(f"{self.kept_errors} earlier errors kept as they are (--keep-errors); rerun without it to "
                         f"retry them")
        if self.changed:
            lines.append(f"re-answered {self.changed} questions that changed since their line was written "
                         f"(--keep-stale keeps the old answers)")
        if self.kept_stale:
            lines.append(f"{self.kept_stale} questions changed since their line was written; their old answers kept "
                         f"(--keep-stale); rerun without it to answer them again")
        if self.graded:
            lines.append(f"accuracy {self.correct}/{self.graded} = {self.correct / self.graded:.1%}")
        gone = {qid for ids in self.vanished.values() for qid in ids}
        for folder, ids in self.vanished.items():  # one message for a whole folder, not one line per question
            lines.append(f"  error: the videos folder {folder} was gone when {len(ids)} questions were asked: they "
                         f"are error rows in {self.out}; rerun the same command once the folder is back to answer "
                         f"them")
        lines += [f"  error: {e}" for e in self.errors if e.split(": ", 1)[0] not in gone]
        if self.skipped:
            lines.append(f"{len(self.skipped)} input lines skipped (not answered, not in {self.out}); fix them and "
                         f"rerun:")
            lines += [f"  skipped: {m}" for m in self.skipped[:self.SKIPPED_SHOWN]]
            if len(self.skipped) > self.SKIPPED_SHOWN:
                lines.append(f"  ... and {len(self.skipped) - self.SKIPPED_SHOWN} more (listed above)")
        return "\n".join(lines)


def write_trace(trace_dir: Path, ep: Episode, pool=None, index=None) -> Path:
    """Write the episode's JSON and its HTML page (`m1.trace`). `pool`: the run's VideoPool, whose cache
    holds the frames the tools read, so thumbnails cost no decoding; `index`: a `TraceIndex` to tell."""
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    safe = trace_name(ep.id)
    for suffix, text in ((".json", ep.model_dump_json(indent=1)), (".html", render_html(ep, pool=pool))):
        write_whole(trace_dir / f"{safe}{suffix}", text.encode())
    if index is not None:
        index.add(ep, trace_dir / f"{safe}.json")
    return trace_dir / f"{safe}.json"


TRACE_OWNER = ".results"  # in a trace folder: the results file whose traces it holds


def claim_trace_dir(trace_dir: Path, out: Path) -> None:
    """One results file per trace folder: traces are named by question id, so two results files writing one folder
    would overwrite each other's traces. The first run records its results file in the folder (TRACE_OWNER); a run of
    another results file is refused before it answers anything. The shards of one run share their folder (`out` is
    the file they are merged into)."""
    from m1.data.questions import InputError

    folder = Path(trace_dir)
    folder.mkdir(parents=True, exist_ok=True)
    mine = os.path.relpath(Path(out).resolve(), folder.resolve())  # relative: a run folder moved whole still matches
    marker = folder / TRACE_OWNER
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        owner = marker.read_text(encoding="utf-8", errors="replace").strip()
        if owner and owner != mine:
            theirs = os.path.normpath(folder.resolve() / owner)
            raise InputError(f"trace folder {folder} holds the traces of the results file {theirs}; this run writes "
                             f"{out}: give it its own --trace-dir (traces are named by question id and would "
                             f"overwrite each other), or remove {marker} to give the folder to this run") from None
        if not owner:
            write_whole(marker, (mine + "\n").encode())
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(mine + "\n")


INDEX_EVERY_S = 5.0  # while a run goes on, the trace index is rewritten at most this often (and at its end)


def run_questions(cfg: TeamConfig, questions: list[Question], out: Path, trace_dir: Path | None = None,
                  limit: int | None = None, team: Team | None = None, progress: bool = True,
                  shard: tuple[int, int] | None = None, stop_on_signals: bool = False,
                  keep_errors: bool = False, keep_stale: bool = False) -> RunSummary:
    """Answer `questions` into the results file `out`, resuming it; see the module docstring.

    A question whose line records an error (a video that was missing, a model that failed) is answered again and
    its line replaced, unless `keep_errors`; so is one whose fingerprint (`fingerprint`) changed, unless
    `keep_stale`. A question `check_question` rejected is written as an error row without being asked; one whose
    prompt does not fit a model's context or the team's limits.max_prompt_tokens is an error row ("prompt too long:").
    `shard=(i, n)`: answer only worker i's share (`shard_of`) into `part_path(out, i, n)`.
    `stop_on_signals`: SIGTERM/SIGINT raise Stopped (with counts) after the line being written.
    Raises LockError when another run writes the same file, WriteError when a line cannot be written."""
    out = whole = Path(out)
    if shard is not None:
        i, n = shard
        record_split(out, questions, n)
        questions, out = shard_of(questions, i, n), part_path(out, i, n)
    advice = ("wait for it, or use --shard i/n to split one evaluation across workers" if shard is None else
              "wait for it; every worker needs its own --shard i/n")
    with hold(out, "results file", advice), StopOnSignals() as stop:
        if trace_dir is not None:
            claim_trace_dir(trace_dir, whole)
        try:
            return _run(cfg, questions, out, trace_dir, limit, team, progress, stop, keep_errors, keep_stale)
        except Stopped as exc:
            done = len({q.id for q in questions} & ResultsFile(out).done)
            raise Stopped(exc.signum, f"stopped by {signal.Signals(exc.signum).name}: {done} of {len(questions)} "
                                      f"questions answered in {out}; rerun the same command to continue") from None


def _run(cfg, questions, out, trace_dir, limit, team, progress, stop: StopOnSignals,
         keep_errors: bool = False, keep_stale: bool = False) -> RunSummary:
    from tqdm import tqdm

    check_team(Path(out), cfg)
    results = ResultsFile(out)
    stat: dict = {}
    fps = {q.id: fingerprint(q, stat) for q in questions}
    failed = results.failed & {q.id for q in questions}
    # a line without a fingerprint (written before they existed) counts as matching: an upgrade re-answers nothing
    stale = {q.id for q in questions if q.id in results.done and q.id not in failed
             and not same_question(results.fps.get(q.id), q, fps[q.id], stat)}
    retry = (set() if keep_errors else failed) | (set() if keep_stale else stale)
    todo = [q for q in questions if q.id not in results.done or q.id in retry]
    summary = RunSummary(out=Path(out), skipped_done=len(questions) - len(todo),
                         kept_errors=len(failed) if keep_errors else 0, kept_stale=len(stale) if keep_stale else 0)
    if limit is not None:
        todo = todo[:limit]
    retry &= {q.id for q in todo}
    invalid = [q for q in todo if INVALID in q.meta]
    todo = [q for q in todo if INVALID not in q.meta]
    index = None
    if trace_dir is not None:
        index = TraceIndex(Path(trace_dir))
    def write(row: dict) -> None:  # inside stop.write()
        if row["id"] in retry:  # an earlier error or a changed question: its line is replaced, the id listed once
            results.replace(row)
            if row["id"] in stale:
                summary.changed += 1
            else:
                summary.retried += 1
                summary.retried_failed += int(bool(row.get("error")))
        else:
            results.append(row)

    for q in invalid:  # never asked: an error row naming the field, the rest of the run goes on
        row = {**invalid_row(q), "fp": fps[q.id]}
        with stop.write():
            write(row)
        summary.errors.append(f"{q.id}: {row['error']}")
    if not todo:
        if index is not None:  # a rerun of a finished (or killed after its last line) run: index what is there
            with stop.write():
                index.write()
        return summary
    team = team or make_team(cfg)
    team.over_budget_rows = True  # a question too long for a model is its own error row, not a stop
    team.server_error_rows = True  # a served model that stops answering: error rows for the batch in flight
    t0 = time.perf_counter()
    bar = tqdm(total=len(todo), desc=f"team {cfg.name}", unit="q", disable=not progress)
    last_index = [time.monotonic()]  # when the index was last written (first: INDEX_EVERY_S into the run)

    def done(ep: Episode) -> None:
        changed = None if ep.error else changed_since(ep.question, stat)
        if changed:  # the answer may mix two files' frames: an error row, which a rerun answers again
            ep = ep.model_copy(update={"error": changed, "final_answer": None, "final_reason": ""})
        row = {**result_row(ep), "fp": fps[ep.id]}
        with stop.write():
            if trace_dir is not None:
                try:
                    write_trace(Path(trace_dir), ep, pool=team.pool, index=index)
                except WriteError as exc:
                    raise WriteError(exc.path, exc.exc, question=ep.id, safe=len(results.done),
                                     results=Path(out)) from None
            write(row)
            if index is not None and time.monotonic() - last_index[0] >= INDEX_EVERY_S:
                last_index[0] = time.monotonic()
                try:
                    index.write()
                except WriteError:
                    pass  # derived from the traces; the next trace or the end of the run reports a full disk
        bar.update(1)
        if ep.error:
            summary.errors.append(f"{ep.id}: {ep.error}")
            folder = Path(ep.question.video).parent
            if ep.question.video and not folder.is_dir():  # the whole folder went away (an unmounted disk, a move)
                summary.vanished.setdefault(str(folder), []).append(ep.id)
        else:
            summary.answered += 1
        if "correct" in row and not ep.error:
            summary.graded += 1
            summary.correct += int(row["correct"])

    try:
        team.run(todo, on_episode=done)
    except BaseException:
        if index is not None:  # a stopped or failed run still leaves an index of what it wrote
            try:
                index.write()
            except WriteError:
                pass  # the error in flight says what went wrong
        raise
    finally:
        bar.close()
    if index is not None:
        with stop.write():
            index.write()
    summary.seconds = time.perf_counter() - t0
    return summary

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from m1.config import TeamConfig
from m1.contracts import Team
from m1.data.questions import InputError
from m1.data.records import INVALID
from m1.gc_pauses import fewer_gc_pauses
from m1.files import WriteError, check_place, write_whole
from m1.locks import hold
from m1.results import (ResultsFile, changed_since, check_team, fingerprint, invalid_row, part_path, record_split,
                        result_row, same_question, shard_of)
from m1.schema import Episode, Question
from m1.signals import Stopped, StopOnSignals
from m1.team.engines_registry import make_team
from m1.trace import render_html, trace_name
from m1.trace_index import TraceIndex


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
    not_in_form: list[str] = field(default_factory=list)  # ids answered, not in the exact form for their task
    no_answer: int = 0  # of those, how many have no answer at all (null)
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
        if self.not_in_form:
            shown = ", ".join(self.not_in_form[:5]) + (", ..." if len(self.not_in_form) > 5 else "")
            lines.append(f"{len(self.not_in_form)} answers are not in the exact form for their task ({self.no_answer} "
                         f"of them null), flagged answer_ok: false in {self.out}: {shown}")
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
    folder = Path(trace_dir)
    check_place(folder, "trace folder", folder=True)
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
            with fewer_gc_pauses():
                return _run(cfg, questions, out, trace_dir, limit, team, progress, stop, keep_errors,
                            keep_stale)
        except Stopped as exc:
            done = len({q.id for q in questions} & ResultsFile(out).done)
            raise Stopped(exc.signum, f"stopped by {signal.Signals(exc.signum).name}: {done} of {len(questions)} "
                                      f"questions answered in {out}; rerun the same command to continue") from None


@dataclass
class ResumePlan:
    """What a run of a results file does, decided before anything is asked: which questions to ask, which lines
    it replaces rather than appends, and the summary it starts from (what it leaves as it is)."""

    todo: list[Question]  # to ask, in input order (at most `limit`)
    invalid: list[Question]  # rejected by check_question: error rows, never asked
    retry: set[str]  # ids of todo whose line is replaced: an earlier error or a changed question
    stale: set[str]  # ids whose question changed since their line was written
    fps: dict[str, str]  # id -> the question's fingerprint as asked now
    stat: dict  # the fingerprints' video cache, shared with `changed_since` for the rest of the run
    summary: RunSummary


def plan_resume(questions: list[Question], results: ResultsFile, limit: int | None, keep_errors: bool,
                keep_stale: bool) -> ResumePlan:
    """Compare `questions` with the lines `results` already holds: a question without a line is asked, one whose line
    records an error (unless `keep_errors`) or that changed since its line (unless `keep_stale`) is asked again."""
    stat: dict = {}
    fps = {q.id: fingerprint(q, stat) for q in questions}
    failed = results.failed & {q.id for q in questions}
    # a line without a fingerprint (written before they existed) counts as matching: an upgrade re-answers nothing
    stale = {q.id for q in questions if q.id in results.done and q.id not in failed
             and not same_question(results.fps.get(q.id), q, fps[q.id], stat)}
    retry = (set() if keep_errors else failed) | (set() if keep_stale else stale)
    todo = [q for q in questions if q.id not in results.done or q.id in retry]
    summary = RunSummary(out=results.path, skipped_done=len(questions) - len(todo),
                         kept_errors=len(failed) if keep_errors else 0, kept_stale=len(stale) if keep_stale else 0)
    if limit is not None:
        if limit < 0:  # a slice would drop the last questions without a word
            raise InputError(f"limit {limit}: give 0 or more questions to answer")
        todo = todo[:limit]
    retry &= {q.id for q in todo}
    return ResumePlan(todo=[q for q in todo if INVALID not in q.meta], invalid=[q for q in todo if INVALID in q.meta],
                      retry=retry, stale=stale, fps=fps, stat=stat, summary=summary)


class RunWriter:
    """Where a run's answers go, each inside `stop.write()` (a signal waits for it): the results line (appended, or
    put in place of a retried id's line), the episode's trace and, now and then, the trace index; and the counts of
    the plan's summary."""

    def __init__(self, results: ResultsFile, plan: ResumePlan, stop: StopOnSignals, trace_dir: Path | None):
        self.results, self.plan, self.summary, self.stop = results, plan, plan.summary, stop
        self.trace_dir = None if trace_dir is None else Path(trace_dir)
        self.index = None if self.trace_dir is None else TraceIndex(self.trace_dir)
        self.index_written = time.monotonic()

    def _line(self, row: dict) -> None:  # inside stop.write()
        if row["id"] in self.plan.retry:  # an earlier error or a changed question: its line replaced, the id once
            self.results.replace(row)
            if row["id"] in self.plan.stale:
                self.summary.changed += 1
            else:
                self.summary.retried += 1
                self.summary.retried_failed += int(bool(row.get("error")))
        else:
            self.results.append(row)

    def invalid(self, q: Question) -> None:
        """A question never asked: an error row naming the field; the rest of the run goes on."""
        row = {**invalid_row(q), "fp": self.plan.fps[q.id]}
        with self.stop.write():
            self._line(row)
        self.summary.errors.append(f"{q.id}: {row['error']}")

    def answering(self, team: Team, bar) -> Callable[[Episode], None]:
        """The team's per-episode callback: the episode written, the progress bar moved, the summary counted. The
        trace index is rewritten at most every INDEX_EVERY_S from now."""
        self.index_written = time.monotonic()

        def done(ep: Episode) -> None:
            changed = None if ep.error else changed_since(ep.question, self.plan.stat)
            if changed:  # the answer may mix two files' frames: an error row, which a rerun answers again
                ep = ep.model_copy(update={"error": changed, "final_answer": None, "final_reason": ""})
            row = {**result_row(ep), "fp": self.plan.fps[ep.id]}
            self._episode(ep, row, team)
            bar.update(1)
            self._count(ep, row)

        return done

    def _episode(self, ep: Episode, row: dict, team: Team) -> None:
        """The episode's trace (`team.pool` read only then), its results line, and the trace index when due."""
        with self.stop.write():
            if self.trace_dir is not None:
                try:
                    write_trace(self.trace_dir, ep, pool=team.pool, index=self.index)
                except WriteError as exc:
                    raise WriteError(exc.path, exc.exc, question=ep.id, safe=len(self.results.done),
                                     results=self.results.path) from None
            self._line(row)
            if self.index is not None and time.monotonic() - self.index_written >= INDEX_EVERY_S:
                self.index_written = time.monotonic()
                try:
                    self.index.write()
                except WriteError:
                    pass  # derived from the traces; the next trace or the end of the run reports a full disk

    def _count(self, ep: Episode, row: dict) -> None:
        if ep.error:
            self.summary.errors.append(f"{ep.id}: {ep.error}")
            folder = Path(ep.question.video).parent
            if ep.question.video and not folder.is_dir():  # the whole folder went away (an unmounted disk, a move)
                self.summary.vanished.setdefault(str(folder), []).append(ep.id)
        else:
            self.summary.answered += 1
            if not row["answer_ok"]:
                self.summary.not_in_form.append(ep.id)
                self.summary.no_answer += row["answer"] is None
        if "correct" in row and not ep.error:
            self.summary.graded += 1
            self.summary.correct += int(row["correct"])

    def write_index(self) -> None:
        """The trace index of what the folder holds, at the end of a run."""
        if self.index is not None:
            with self.stop.write():
                self.index.write()

    def index_after_failure(self) -> None:
        """A stopped or failed run still leaves an index of what it wrote; the error in flight says what went wrong,
        so a full disk here is not reported over it."""
        if self.index is not None:
            try:
                self.index.write()
            except WriteError:
                pass


def _run(cfg, questions, out, trace_dir, limit, team, progress, stop: StopOnSignals,
         keep_errors: bool = False, keep_stale: bool = False) -> RunSummary:
    from tqdm import tqdm

    check_team(Path(out), cfg)
    results = ResultsFile(out)
    plan = plan_resume(questions, results, limit, keep_errors, keep_stale)
    writer = RunWriter(results, plan, stop, trace_dir)
    for q in plan.invalid:
        writer.invalid(q)
    if not plan.todo:  # a rerun of a finished (or killed after its last line) run: index what is there
        writer.write_index()
        return plan.summary
    team = team or make_team(cfg)
    team.over_budget_rows = True  # a question too long for a model is its own error row, not a stop
    team.server_error_rows = True  # a served model that stops answering: error rows for the batch in flight
    t0 = time.perf_counter()
    bar = tqdm(total=len(plan.todo), desc=f"team {cfg.name}", unit="q", disable=not progress)
    try:
        team.run(plan.todo, on_episode=writer.answering(team, bar))
    except BaseException:
        writer.index_after_failure()
        raise
    finally:
        bar.close()
    writer.write_index()
    plan.summary.seconds = time.perf_counter() - t0
    return plan.summary

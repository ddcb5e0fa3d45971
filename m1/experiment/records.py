"""Committed records: what a finished stage leaves under `rows_dir` for another machine, and what a run makes of them.

out_dir (runs/) is not in git, so each finished stage also writes a small record under `rows_dir`
(docs/experiments/<name>/<arm>/seed<k>/<stage>.json, an eval's per-question rows beside it in <stage>.jsonl, gzipped
past 50 rows: what the report reads), with its config identity (`stage_identity`). A run without the stage's folder
(another day, another machine) skips a stage so recorded under the same identity, reruns one recorded under another
(saying so), and trains a recorded stage again only where a stage still to run needs its weights (naming both).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m1.config import load_team
from m1.config_files import CONFIG_DIR
from m1.experiment.config import Experiment, ExperimentError
from m1.experiment.rows import compact_eval, rows_file, write_rows
from m1.experiment.stages import (StageRun, eval_overrides, eval_questions, eval_team, first_training_stage,
                                  init_seat, load_stage_config, previous_training, read_stage, stage_runs,
                                  torn_results)
from m1.files import write_whole
from m1.plots import PlotError, read_metrics


def stage_identity(exp: Experiment, arm: str, seed: int, stage: str) -> str:
    """What a stage computes, as a short hash: the resolved configs (the values the code does not default) of every
    stage of the arm up to it, with their seeds, initial-weight shifts and the synthetic worlds their paths name. Not
    out_dir nor where the repository lies (a team's `../assets/x` resolves to an absolute path; the hash reads it
    from the repository's root): the same experiment gives the same identity on another machine or clone, an edited
    config or override another one."""
    return hashlib.sha256(identity_text(exp, arm, seed, stage).encode()).hexdigest()[:16]


def identity_text(exp: Experiment, arm: str, seed: int, stage: str, root: str = "") -> str:
    """The text `stage_identity` hashes: paths under the repository's root written relative to it (or under `root`)."""
    stages = exp.arm_stages(arm)
    first = first_training_stage(exp, arm)
    parts: list[Any] = []
    for st in stages[: stages.index(stage) + 1]:
        s = exp.stage_seed(arm, seed, st)
        run = StageRun(arm, s, st, exp.stage_dir(arm, s, st))
        shift = init_seat(exp, arm, s) if st == first or first is None else []
        if st == "eval":
            assert exp.eval is not None
            team = load_team(eval_team(exp, arm), eval_overrides(exp, run, shift))
            parts.append([st, exp.eval.model_dump(mode="json", exclude_defaults=True, by_alias=True),
                          team.model_dump(mode="json", exclude_defaults=True, by_alias=True)])
        else:
            cfg = load_stage_config(exp, run)[0]
            dump = cfg.model_dump(mode="json", exclude_defaults=True, by_alias=True)
            dump.pop("out_dir", None)
            team_dump = cfg.team_config().model_dump(mode="json", exclude_defaults=True, by_alias=True)
            parts.append([st, dump, team_dump, shift])
    text = json.dumps(parts, sort_keys=True)
    worlds = [w.model_dump(mode="json") for w in (exp.data.worlds if exp.data else [])
              if f'"{Path(w.out)}"' in text or f'"{Path(w.out)}/' in text]
    repo = json.dumps(str(CONFIG_DIR.resolve().parent) + "/")[1:-1]
    return json.dumps([parts, worlds], sort_keys=True).replace(repo, root + "/" if root else "")


_SHA: dict[tuple[str, int, int], str] = {}  # (path, mtime_ns, size) -> its sha256: a plan hashes each file once


def examples_of(exp: Experiment, arm: str, seed: int, stage: str) -> str | None:
    """The sha256 of the SFT examples the arm's `sft` stage trains on, when it comes at or before `stage`, as
    data.examples holds them now (None: no such stage, or the file is not here). A stage's identity hashes configs;
    this catches what a code change rewrote under the same config (a synth teacher edited, its examples built
    again): recorded with each stage, a stage trained on, or after, other examples runs again."""
    from m1.marl.sft import examples_path
    from m1.signature import file_sha256

    stages = exp.arm_stages(arm)
    if "sft" not in stages[: stages.index(stage) + 1]:
        return None
    s = exp.stage_seed(arm, seed, "sft")
    path = examples_path(load_stage_config(exp, StageRun(arm, s, "sft", exp.stage_dir(arm, s, "sft")))[0])
    if not path.is_file():
        return None
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _SHA:
        _SHA[key] = file_sha256(path)
    return _SHA[key]


def other_examples(exp: Experiment, run: StageRun, done: dict[str, Any]) -> bool:
    """Whether a finished stage (`done`: its record) was trained on other SFT examples than data.examples now holds
    (a record from before examples were recorded: no)."""
    was = done.get("examples")
    now = examples_of(exp, run.arm, run.seed, run.stage) if was else None
    return bool(was and now and was != now)


def read_record(exp: Experiment, run: StageRun) -> dict[str, Any] | None:
    """The committed record of a stage (None without one; an eval's also needs its rows file)."""
    path = exp.record_path(run.arm, run.seed, run.stage)
    if not path.is_file() or (run.stage == "eval" and rows_file(path.with_suffix(".jsonl")) is None):
        return None
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExperimentError(f"{path}: not JSON ({exc}); delete it to rerun the stage") from None


MAX_ERRORS = 10  # error lines kept in a committed record (the stage's own stage.json keeps them all)


def write_record(exp: Experiment, run: StageRun, done: dict[str, Any], questions=None) -> Path:
    """Write a finished stage's committed record: stage.json without what only this machine can use (resolved
    config, seat, result paths), with its step timings; for an eval, first its rows (`rows.compact_eval`).
    Each file is written whole, the record last, so a record never names rows that are not there."""
    path = exp.record_path(run.arm, run.seed, run.stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {k: v for k, v in done.items() if k not in ("resolved", "seat", "results")}
    errors = record.get("errors") or []
    if len(errors) > MAX_ERRORS:
        record["errors"] = errors[:MAX_ERRORS] + [f"... and {len(errors) - MAX_ERRORS} more (in its stage.json)"]
    if run.stage == "eval":
        assert exp.eval is not None
        compact = compact_eval(done, run.folder, questions or eval_questions(exp)[0], exp.eval.source)
        rows = write_rows(path.with_suffix(".jsonl"), compact.pop("rows"))
        record.update(rows=rows.name, **compact)
    else:
        record["timing"] = step_timing(run.folder)
    write_whole(path, (json.dumps(record, indent=1) + "\n").encode())
    return path


def step_timing(folder: Path) -> dict[str, float]:
    """Steps a training stage logged and the mean of each `time/*` metric over them (seconds)."""
    try:
        rows = read_metrics(folder)
    except PlotError:
        return {}
    out: dict[str, float] = {"steps": len(rows)}
    for key in sorted({k for r in rows for k in r if k.startswith("time/")}):
        xs = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if xs:
            out[key] = round(sum(xs) / len(xs), 4)
    return out


@dataclass
class Planned:
    """What a run of the experiment does with one stage folder: `state` is "local" (finished in out_dir), "torn"
    (finished in out_dir, but its results file was cut: `torn_results`; run again, whatever its record says), "recorded"
    (its committed record has this identity), "changed" (recorded under another identity) or "new";
    `needed_by`: the stage still to run that needs this recorded stage's weights (so it is trained again)."""

    state: str
    identity: str | None = None
    record: dict[str, Any] | None = None
    needed_by: str | None = None

    @property
    def runs(self) -> bool:
        return self.state in ("changed", "new", "torn") or (self.state == "recorded" and self.needed_by is not None)


def plan_stages(exp: Experiment) -> dict[Path, Planned]:
    """Per stage folder of the experiment (every arm and seed), what a run does with it: see `Planned`."""
    runs = stage_runs(exp)
    plan: dict[Path, Planned] = {}
    for run in runs:
        if run.folder in plan:
            continue
        src = StageRun(exp.owner(run.arm, run.stage), exp.stage_seed(run.arm, run.seed, run.stage), run.stage,
                       run.folder)
        record = read_record(exp, src)
        local = read_stage(run.folder)
        if local is not None:
            plan[run.folder] = Planned("torn" if torn_results(run.folder, local) else "local", record=record)
        elif record is None:
            plan[run.folder] = Planned("new")
        else:
            ident = stage_identity(exp, src.arm, src.seed, src.stage)
            same = record.get("identity") == ident and not other_examples(exp, src, record)
            plan[run.folder] = Planned("recorded" if same else "changed", ident, record)
    for run in reversed(runs):  # a stage that runs needs its predecessor's weights, which a record does not hold
        prev = previous_training(exp, run)
        if plan[run.folder].runs and prev is not None and plan[prev.folder].state == "recorded":
            plan[prev.folder].needed_by = plan[prev.folder].needed_by or run.label
    return plan


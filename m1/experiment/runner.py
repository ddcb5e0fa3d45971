"""Run an experiment: every (arm, seed) goes through its stages in order, each an ordinary run in its own folder.

Folder of a stage: <out_dir>/<arm>/seed<k>/<stage>. A stage is finished when that folder holds `stage.json`, written
last and atomically (the config used, wall seconds, result paths, and for a training stage the overrides that seat
its trained agents). A rerun skips finished stages and lets an unfinished one resume the way its own command does
(training from its newest checkpoint, eval from the answers already in its results file).

Committed records: out_dir (runs/) is not in git, so each finished stage also writes a small record under `rows_dir`
(docs/experiments/<name>/<arm>/seed<k>/<stage>.json, an eval's per-question rows beside it in <stage>.jsonl, gzipped
past 50 rows: what the report reads), with its config identity (`stage_identity`). A run without the stage's folder
(another day, another machine) skips a stage so recorded under the same identity, reruns one recorded under another
(saying so), and trains a recorded stage again only where a stage still to run needs its weights (naming both).

Chaining: a stage's "seat" is the list of team overrides that puts the trained weights in place — the stage
config's own `team_overrides` (the weights it started from) plus `trained_agent_overrides` of its last checkpoint
(full weights replace the model's source, a LoRA adapter goes on top). MARL starts from the seat of its arm's SFT;
eval answers with the seat of the last training stage.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from m1.config import ConfigError, load_team
from m1.data.loaders import load_benchmark
from m1.data.prepare import parse_split, prepare
from m1.data.questions import build_questions, read_questions
from m1.errors import describe
from m1.experiment.config import Experiment, ExperimentError
from m1.experiment.rows import RESULTS_FILE, compact_eval, rows_file, write_rows
from m1.files import WriteError, write_whole
from m1.locks import hold_dir
from m1.marl.checkpoint import find_latest_checkpoint
from m1.marl.cluster import PlanError
from m1.marl.config import load_sft_config, load_train_config
from m1.marl.guard import OUT_DIR_ADVICE
from m1.marl.launch import merge_adapters, trained_agent_overrides
from m1.marl.planner import make_plan
from m1.marl.preflight import check_run
from m1.marl.sft import data_settings, examples_path, prepare_examples
from m1.marl.stream import load_questions
from m1.models.preflight import summary
from m1.plots import PlotError, read_metrics
from m1.results import ResultsFile
from m1.signals import Stopped
from m1.signature import file_sha256
from m1.synth.make import make_dataset

log = logging.getLogger(__name__)

STAGE_FILE = "stage.json"


@dataclass(frozen=True)
class StageRun:
    arm: str
    seed: int
    stage: str
    folder: Path

    @property
    def label(self) -> str:
        return f"{self.arm} seed{self.seed} {self.stage}"


def first_training_stage(exp: Experiment, arm: str) -> str | None:
    return next((s for s in exp.arm_stages(arm) if s != "eval"), None)


def init_seat(exp: Experiment, arm: str, seed: int) -> list[str]:
    """Team overrides that give seed k its own untrained draws; none for seed 0 (the configs' own).

    The randomly initialised (tiny) chat models of the arm's first training stage start from their spec seed +
    k * init_seed_stride. An arm without a training stage (an untrained or a reference row) gets the same shift on
    its eval team: tiny chat models start where seed k's training would have started, and rule-based synth chat
    models draw their errors from seed + k * stride, so the row varies over seeds as a trained one does."""
    stage = first_training_stage(exp, arm)
    shift = seed * exp.init_seed_stride
    if shift == 0:
        return []
    if stage is not None:
        run = StageRun(arm, seed, stage, exp.stage_dir(arm, seed, stage))
        team = load_stage_config(exp, run)[0].team_config()
    elif "eval" in exp.arm_stages(arm):
        run = StageRun(arm, seed, "eval", exp.stage_dir(arm, seed, "eval"))
        team = load_team(eval_team(exp, arm), eval_overrides(exp, run, []))
    else:
        return []
    chat = {a.model for a in team.agents}
    sets = []
    for key, spec in team.models.items():
        if key in chat and spec.tiny is not None:
            sets.append(f"models.{key}.tiny.seed={spec.tiny.seed + shift}")
        elif key in chat and spec.backend == "synth" and stage is None:
            sets.append(f"models.{key}.seed={spec.seed + shift}")
    return sets


def stage_runs(exp: Experiment) -> list[StageRun]:
    """Arm by arm, seed by seed, stages in order: a killed experiment has finished whole arms first."""
    return [StageRun(arm, seed, stage, exp.stage_dir(arm, seed, stage))
            for arm in exp.arms for seed in exp.seeds for stage in exp.arm_stages(arm)]


def read_stage(folder: Path) -> dict[str, Any] | None:
    """The record of a finished stage, or None while it is not finished."""
    path = Path(folder) / STAGE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExperimentError(f"{path}: not JSON ({exc}); delete it to rerun the stage") from None


def torn_results(folder: Path, record: dict[str, Any]) -> str | None:
    """Why the results file of a finished eval stage no longer holds what its stage.json counts, else None: its
    last line was cut (no newline: a copy or a disk that stopped mid-write), or it has fewer lines than answers
    counted (cut at a line's end, or a repair of it stopped). Such a stage counts as unfinished, whatever its
    committed record says: the rerun repairs the file the way `m1 infer` does (`ResultsFile` drops the torn line)
    and answers what is missing again."""
    if record.get("stage") != "eval":
        return None
    path = Path((record.get("results") or {}).get("results") or Path(folder) / RESULTS_FILE)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if data and not data.endswith(b"\n"):
        return f"{path} was cut mid-line"
    lines, counted = data.count(b"\n"), record.get("answered")
    if isinstance(counted, int) and lines < counted:
        return f"{path} holds {lines} lines, fewer than the {counted} answers its {STAGE_FILE} counts"
    return None


def _write_stage(folder: Path, record: dict[str, Any]) -> Path:
    """stage.json through a temporary file unique to this process, renamed over it (`write_whole`)."""
    path = Path(folder) / STAGE_FILE
    write_whole(path, json.dumps(record, indent=1).encode())
    return path


SPENT_FILE = ".wall_s"  # wall seconds of the earlier, unfinished attempts of a stage (a stopped or failed run)


def _spent(folder: Path) -> float:
    """Wall seconds the earlier attempts of a stage took (0 for a first attempt)."""
    path = Path(folder) / SPENT_FILE
    try:
        return float(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0.0


def _add_spent(folder: Path, seconds: float) -> None:
    """Count an unfinished attempt's wall time towards the stage's record (written whole; best effort on a full disk,
    where the error in flight is the one to report)."""
    if not Path(folder).is_dir():
        return
    try:
        write_whole(Path(folder) / SPENT_FILE, f"{_spent(folder) + seconds:.3f}".encode())
    except WriteError:
        log.warning("could not record the wall time of the unfinished attempt in %s", folder)


# ------------------------------------------------------------------------------------------------ overrides
def train_overrides(exp: Experiment, run: StageRun, seat: list[str] | None = None,
                    base_team_overrides: list[str] | None = None) -> list[str]:
    """The stage's overrides, the arm's, then seed and out_dir; with a seat, `team_overrides` = the config's own
    followed by the seat (later overrides win, so the seated weights replace what the config starts from)."""
    spec = getattr(exp, run.stage)
    sets = list(spec.overrides) + list(getattr(exp.arm(run.arm), run.stage))
    sets += [f"seed={run.seed}", f"out_dir={run.folder}"]
    if run.stage == "marl":  # the runner chains the stages itself: a config's own init_from never applies
        sets.append("init_from=null")
    if seat:
        sets.append("team_overrides=" + json.dumps(list(base_team_overrides or []) + list(seat)))
    return sets


def eval_overrides(exp: Experiment, run: StageRun, seat: list[str]) -> list[str]:
    """Team overrides of an eval stage: the seat first, then the experiment's and the arm's (so an arm can still
    change anything), then the seed of sampling and of a random topology."""
    assert exp.eval is not None
    return (list(seat) + list(exp.eval.overrides) + list(exp.arm(run.arm).eval)
            + [f"sampling.seed={run.seed}", f"topology.seed={run.seed}"])


def load_stage_config(exp: Experiment, run: StageRun, seat: list[str] | None = None):
    """The SFT / MARL config a training stage runs with (checked before anything runs)."""
    spec = getattr(exp, run.stage)
    loader = load_sft_config if run.stage == "sft" else load_train_config
    base = loader(spec.config, train_overrides(exp, run)) if seat else None
    sets = train_overrides(exp, run, seat, base.team_overrides if base is not None else None)
    return loader(spec.config, sets), sets


def _seat_of(cfg, folder: Path) -> tuple[list[str], str]:
    """(seat, checkpoint root) of a finished training stage: its team_overrides plus its trained agents."""
    root = find_latest_checkpoint(folder)
    if root is None:
        raise ExperimentError(f"{folder}: the stage ended without a checkpoint; nothing to seat for the next stage")
    team = cfg.team_config()
    agents = list(cfg.train_agents or [a.name for a in team.agents])
    sets, notes = trained_agent_overrides(team, agents, root, cfg.learner.finetune)
    if notes:  # an agent left unseated would make the next stage silently use untrained weights
        raise ExperimentError(f"{folder}: cannot seat every trained agent: " + "; ".join(notes))
    # a trained model no longer starts from a tiny spec: drop the overrides of its spec (init_seat's seed shift)
    untiny = {x.split("=", 1)[0][: -len(".tiny")] + ".tiny." for x in sets if x.endswith(".tiny=null")}
    kept = [x for x in cfg.team_overrides if not any(x.startswith(p) for p in untiny)]
    return kept + sets, str(root)


MERGED_DIR = "merged"


# ------------------------------------------------------------------------------------------------ stages
def _run_train(exp: Experiment, run: StageRun, seat: list[str], progress: Callable[[str], None]) -> dict:
    # looked up at each call (not at the top), so tests that wrap these entry points reach them
    from m1.marl.launch import train_main
    from m1.marl.sft import sft_main

    cfg, sets = load_stage_config(exp, run, seat)
    spec = getattr(exp, run.stage)
    main = sft_main if run.stage == "sft" else train_main
    main(spec.config, sets, progress=lambda msg: progress(f"  {msg}"))
    new_seat, root = _seat_of(cfg, run.folder)
    after = exp.stages[exp.stages.index(run.stage) + 1:]  # does any arm sharing this stage train on from it?
    later = [st for a in exp.arms if exp.owner(a, run.stage) == run.arm if run.stage in exp.arm_stages(a)
             for st in exp.arm_stages(a) if st in after and st != "eval"]
    if later and cfg.learner.finetune == "lora":
        if not isinstance(cfg.team, str):
            raise ExperimentError(f"{cfg.name}: an inline team cannot be seated for the next stage; name a team "
                                  "config")
        agents = list(cfg.train_agents or [a.name for a in cfg.team_config().agents])
        new_seat = merge_adapters(cfg.team, new_seat, agents, run.folder / MERGED_DIR, progress)
    return {"config": spec.config, "overrides": sets, "resolved": cfg.model_dump(mode="json"),
            "results": {"metrics": str(run.folder / "metrics.jsonl"), "checkpoint": root,
                        "plots": str(run.folder / "plots")},
            "finetune": cfg.learner.finetune, "seat": new_seat, "gpus": _gpus_used(cfg)}


def _gpus_used(cfg) -> int:
    """GPUs a training stage held: its placement plan's count when it ran on GPUs (the GPU-hours of its record),
    0 on a CPU."""
    import torch

    if not torch.cuda.is_available():
        return 0

    try:
        return make_plan(cfg).gpus_needed or torch.cuda.device_count()
    except PlanError as exc:  # the run itself went through: count the GPUs this machine has
        log.warning("GPU-hours of %s: no placement plan (%s); counting this machine's GPUs", cfg.name, exc)
        return torch.cuda.device_count()


def eval_team(exp: Experiment, arm: str) -> str:
    assert exp.eval is not None
    return exp.arm(arm).eval_team or exp.eval.team


def eval_questions(exp: Experiment):
    """The eval stage's questions (malformed lines are reported, not fatal, as in `m1 infer`)."""
    assert exp.eval is not None
    e = exp.eval
    if e.benchmarks:
        qs, issues = [], []
        for b in e.benchmarks:
            got, bad = load_benchmark(b.format, b.annotations, b.videos)
            qs += [q.model_copy(update={"id": f"{b.name}:{q.id}", "meta": {**q.meta, "family": b.name}})
                   for q in got]
            issues += [f"{b.name}: {i}" for i in bad]
        return qs, issues
    if e.video_dir:
        return build_questions(Path(e.video_dir), questions_file=Path(e.questions))
    return read_questions(Path(e.questions))


def _run_eval(exp: Experiment, run: StageRun, seat: list[str], progress: Callable[[str], None]) -> dict:
    from m1.run import run_questions  # looked up at each call, like _run_train's entry points

    assert exp.eval is not None
    sets = eval_overrides(exp, run, seat)
    team = eval_team(exp, run.arm)
    cfg = load_team(team, sets)
    qs, issues = eval_questions(exp)
    for msg in issues:
        progress(f"  skipped: {msg}")
    if not qs:
        raise ExperimentError(f"{exp.eval.source}: no usable questions ({len(issues)} skipped)")
    run.folder.mkdir(parents=True, exist_ok=True)
    out = run.folder / RESULTS_FILE
    traces = run.folder / "traces" if exp.eval.traces else None
    summary = run_questions(cfg, qs, out, trace_dir=traces, progress=False)
    for line in summary.describe().splitlines():
        progress(f"  {line}")
    # counted from the results file, so a stage resumed after a stop counts the rows of every attempt
    ids = {q.id for q in qs}
    rows = [r for r in ResultsFile(out).read() if r["id"] in ids]
    good = [r for r in rows if not r.get("error")]
    graded = [r for r in good if "correct" in r]
    return {"config": team, "overrides": sets, "resolved": cfg.model_dump(mode="json"),
            "results": {"results": str(out), "questions": exp.eval.source,
                        **({"traces": str(traces)} if traces is not None else {})},
            "answered": len(rows), "graded": len(graded), "correct": sum(int(bool(r["correct"])) for r in graded),
            "errors": [f"{r['id']}: {r['error']}" for r in rows if r.get("error")]}


def check_configs(exp: Experiment) -> None:
    """Load every training stage's config (arm overrides included) and the eval team before anything runs, so a
    typo in the last arm does not surface hours in."""
    for arm in exp.arms:
        run0 = StageRun(arm, exp.seeds[0], "", Path())
        for stage in ("sft", "marl"):
            if stage in exp.arm_stages(arm):
                run = StageRun(arm, run0.seed, stage, exp.stage_dir(arm, run0.seed, stage))
                try:
                    load_stage_config(exp, run)
                except ConfigError as exc:
                    raise ConfigError(f"arm {arm!r}, stage {stage}: {exc}") from None
        if "eval" in exp.arm_stages(arm):
            run = StageRun(arm, run0.seed, "eval", exp.stage_dir(arm, run0.seed, "eval"))
            try:
                load_team(eval_team(exp, arm), eval_overrides(exp, run, []))
            except ConfigError as exc:
                raise ConfigError(f"arm {arm!r}, stage eval: {exc}") from None


# ------------------------------------------------------------------------------------------------ committed records
def stage_identity(exp: Experiment, arm: str, seed: int, stage: str) -> str:
    """What a stage computes, as a short hash: the resolved configs (the values the code does not default) of every
    stage of the arm up to it, with their seeds, initial-weight shifts and the synthetic worlds their paths name. Not
    out_dir nor the seated weights' paths: the same experiment gives the same identity on another machine, an edited
    config or override another one."""
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
            parts.append([st, exp.eval.model_dump(mode="json", exclude_defaults=True),
                          team.model_dump(mode="json", exclude_defaults=True)])
        else:
            cfg = load_stage_config(exp, run)[0]
            dump = cfg.model_dump(mode="json", exclude_defaults=True)
            dump.pop("out_dir", None)
            parts.append([st, dump, cfg.team_config().model_dump(mode="json", exclude_defaults=True), shift])
    text = json.dumps(parts, sort_keys=True)
    worlds = [w.model_dump(mode="json") for w in (exp.data.worlds if exp.data else [])
              if f'"{Path(w.out)}"' in text or f'"{Path(w.out)}/' in text]
    return hashlib.sha256(json.dumps([parts, worlds], sort_keys=True).encode()).hexdigest()[:16]


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


def load_state(jobs: int, threads: int) -> dict[str, Any] | None:
    """The 1-, 5- and 15-minute load averages, the machine's cores and the cores this run was given (jobs x
    threads_per_seed); None where the system keeps no load average."""
    try:
        loads = os.getloadavg()
    except (OSError, AttributeError):
        return None
    return {"load": [round(x, 2) for x in loads], "cores": os.cpu_count() or 1, "given": jobs * threads}


def warn_load(jobs: int, threads: int, progress: Callable[[str], None]) -> dict[str, Any] | None:
    """Warn when the 1-minute load average exceeds the cores this run was given (at most the machine's) by more
    than half a core: something else is using them, and every wall time measured now is inflated (on 2 shared
    cores, halved speed). Returns `load_state`; never fails."""
    state = load_state(jobs, threads)
    if state is not None and state["load"][0] > min(state["given"], state["cores"]) + 0.5:
        progress(f"warning: load average {state['load'][0]:.2f} on {state['cores']} cores, this run was given "
                 f"{state['given']} ({jobs} job(s) x {threads} thread(s)): something else is using the cores; "
                 "timings will be inflated")
    return state


def previous_training(exp: Experiment, run: StageRun) -> StageRun | None:
    """The training stage whose weights `run` starts from (None for a first stage)."""
    stages = exp.arm_stages(run.arm)
    prev = [s for s in stages[: stages.index(run.stage)] if s != "eval"]
    if not prev:
        return None
    seed = exp.stage_seed(run.arm, run.seed, prev[-1])
    return StageRun(run.arm, seed, prev[-1], exp.stage_dir(run.arm, seed, prev[-1]))


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
            plan[run.folder] = Planned("recorded" if record.get("identity") == ident else "changed", ident, record)
    for run in reversed(runs):  # a stage that runs needs its predecessor's weights, which a record does not hold
        prev = previous_training(exp, run)
        if plan[run.folder].runs and prev is not None and plan[prev.folder].state == "recorded":
            plan[prev.folder].needed_by = plan[prev.folder].needed_by or run.label
    return plan


def run_chains(exp: Experiment, progress: Callable[[str], None] = print, jobs: int = 1,
               seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """Every unfinished (arm, seed, stage) in order (of `seeds` only, when given: a worker's share); the stage
    records. A finished stage (stage.json) is skipped, and so is a stage another arm owns (the same overrides up to
    it: `Experiment.owner`) or another seed of its SFT group runs (`sft_share`), and one recorded under rows_dir with
    this config's identity (see `plan_stages`); one finished with other overrides than the experiment now gives is
    refused rather than silently reused. `jobs`: the worker processes sharing the cores (the load warning's count)."""
    runs = [r for r in stage_runs(exp) if seeds is None or r.seed in seeds]
    plan = plan_stages(exp)
    records: list[dict[str, Any]] = []
    seats: dict[tuple[str, int], list[str]] = {}
    questions: list = []  # the eval questions, read once for the records of every eval finished here
    for i, run in enumerate(runs, 1):
        owner, head = exp.owner(run.arm, run.stage), exp.stage_seed(run.arm, run.seed, run.stage)
        src = StageRun(run.arm, head, run.stage, run.folder)  # the run that computes this folder
        tag = (f"[{i}/{len(runs)}] {run.label}" + (f" (= arm {owner}'s)" if owner != run.arm else "")
               + (f" (= seed {head}'s, sft_share {exp.sft_share})" if head != run.seed else ""))
        seat = seats.get((run.arm, run.seed)) or init_seat(exp, run.arm, head)  # [] after a recorded stage
        planned = plan[run.folder]
        record_path = exp.record_path(run.arm, run.seed, run.stage)
        done = read_stage(run.folder)
        torn = None
        if done is not None:
            if run.stage != "eval":
                expected = load_stage_config(exp, src, seat)[1]
            else:
                expected = eval_overrides(exp, src, seat)
            if done.get("overrides") != expected:
                raise ExperimentError(
                    f"{run.folder / STAGE_FILE}: finished with other overrides than the experiment now gives "
                    f"({done.get('overrides')} vs {expected}); delete that folder to rerun it, or use another out_dir")
            ident = stage_identity(exp, owner, head, run.stage)
            if done.get("identity", ident) != ident:
                raise ExperimentError(f"{run.folder / STAGE_FILE}: finished with another config than the experiment "
                                      f"now gives (identity {done['identity']}, now {ident}: a stage config or team "
                                      "changed); delete that folder to rerun it, or use another out_dir")
            torn = torn_results(run.folder, done)
            if torn is not None:
                progress(f"{tag}: {torn}: running the stage again to repair it")
        if done is not None and torn is None:
            progress(f"{tag}: done before ({done['wall_s']:.1f}s), skipped -> {run.folder}")
            record = read_record(exp, run)
            if owner == run.arm and head == run.seed and (record is None or record.get("identity") != ident):
                if run.stage == "eval" and not questions:
                    questions = eval_questions(exp)[0]
                write_record(exp, run, {**done, "identity": ident}, questions)
                progress(f"{tag}: recorded -> {record_path}")
        elif planned.state == "recorded" and planned.needed_by is None:
            done = planned.record
            progress(f"{tag}: recorded before ({done.get('wall_s', 0.0):.1f}s), skipped -> {record_path}")
        elif owner != run.arm:
            raise ExperimentError(f"{run.label}: arm {owner} runs this stage and has not finished it ({run.folder})")
        elif head != run.seed:
            raise ExperimentError(f"{run.label}: seed {head} runs this stage (sft_share {exp.sft_share}) and has not "
                                  f"finished it ({run.folder})")
        else:
            ident = planned.identity or stage_identity(exp, run.arm, run.seed, run.stage)
            if planned.state == "changed":
                was = planned.record.get("identity") if planned.record else None
                progress(f"{tag}: {record_path} was recorded with another config (identity {was}, now {ident}): "
                         "running it again")
            elif planned.state == "recorded":
                progress(f"{tag}: recorded in {record_path}, but its weights are not on this machine and "
                         f"{planned.needed_by} needs them: training it again")
            earlier = _spent(run.folder) + (done["wall_s"] if torn is not None else 0.0)  # the torn run's time too
            progress(f"{tag}: running -> {run.folder}" + (f" (resumed; {earlier:.1f}s before)" if earlier else ""))
            before = warn_load(jobs, exp.threads_per_seed, progress)
            t0 = time.perf_counter()
            try:
                body = (_run_eval if run.stage == "eval" else _run_train)(exp, run, seat, progress)
            except BaseException:  # stopped or failed: the rerun's record counts this attempt's time too
                _add_spent(run.folder, time.perf_counter() - t0)
                raise
            after = load_state(jobs, exp.threads_per_seed)
            done = {"experiment": exp.name, "arm": run.arm, "seed": run.seed, "stage": run.stage,
                    "wall_s": earlier + time.perf_counter() - t0, "identity": ident, **body,
                    "load": {"before": before and before["load"], "after": after and after["load"],
                             "cores": os.cpu_count(), "given": jobs * exp.threads_per_seed}}
            if "gpus" in done:
                done["gpu_hours"] = done["wall_s"] / 3600 * done["gpus"]
            _write_stage(run.folder, done)
            (run.folder / SPENT_FILE).unlink(missing_ok=True)
            if run.stage == "eval" and not questions:
                questions = eval_questions(exp)[0]
            write_record(exp, run, done, questions)
            progress(f"{tag}: finished in {done['wall_s']:.1f}s -> {run.folder}; recorded -> {record_path}")
        if run.stage != "eval":
            seats[(run.arm, run.seed)] = done.get("seat") or []
        records.append(done)
    return records


def run_experiment(exp: Experiment, progress: Callable[[str], None] = print, jobs: int = 1) -> list[dict[str, Any]]:
    """The data stage, then every arm and seed (`run_chains`); with `jobs` > 1, that many seeds at once, each in a
    worker process (their training bars in <out_dir>/logs/seed<k>.log). Every seed runs on `threads_per_seed` torch
    threads either way, so its result does not depend on --jobs.

    One run of an experiment at a time: it holds `<out_dir>/.lock` from start to end (a second run is refused naming
    the holder; the lock of a killed run is taken over with a warning), so two runs never render the same worlds or
    write the same stage records."""
    check_configs(exp)
    with hold_dir(Path(exp.out_dir), "experiment folder", "wait for that run to finish (or stop it), or give this "
                  "run another out_dir", warn=lambda msg: progress(f"warning: {msg}")):
        return _run_experiment(exp, progress, jobs)


def _run_experiment(exp: Experiment, progress: Callable[[str], None], jobs: int) -> list[dict[str, Any]]:
    threads = exp.threads_per_seed
    workers = 1 if jobs <= 1 or len(exp.seeds) == 1 else min(jobs, len(exp.seeds))
    warn_load(workers, threads, progress)
    if exp.data is not None:  # not rendered again on a machine where every stage is recorded
        if (Path(exp.out_dir) / "data" / STAGE_FILE).is_file() or any(p.runs for p in plan_stages(exp).values()):
            run_data(exp, progress)
        else:
            progress(f"data: not needed, every stage is recorded (in {exp.rows_root})")
    if workers == 1:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return run_chains(exp, progress)
        finally:
            torch.set_num_threads(before)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if workers * threads > (os.cpu_count() or 1):
        progress(f"warning: {workers} seeds x {threads} torch thread(s) (threads_per_seed) on {os.cpu_count()} "
                 "cores: they share them (results do not change, wall time does)")
    logs = Path(exp.out_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    progress(f"{len(exp.seeds)} seeds in {workers} worker processes, {threads} torch thread(s) each "
             f"(threads_per_seed, whatever --jobs is); their logs in {logs}")
    # the seeds that train an SFT shared by their group (sft_share) first, then the seeds that start from it
    heads = [s for s in exp.seeds if exp.sft is None or s % exp.sft_share == 0]
    waves = [w for w in (heads, [s for s in exp.seeds if s not in heads]) if w]
    outcomes: dict[int, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        for wave in waves:
            futures = {seed: ex.submit(_seed_worker, exp, seed, workers, str(logs / f"seed{seed}.log"))
                       for seed in wave}
            outcomes.update({seed: f.result() for seed, f in futures.items()})  # every seed of a wave runs to its end
            if any(o.get("exit_status") for o in outcomes.values()):
                break
    failed = [(seed, o) for seed, o in outcomes.items() if "error" in o]
    stopped = [o["exit_status"] for _, o in failed if o.get("exit_status")]
    if stopped:
        raise Stopped(stopped[0] - 128, "stopped by a signal; rerun the same command to resume")
    if failed:
        raise ExperimentError("; ".join(f"seed {seed}: {o['error']} (log: {logs / f'seed{seed}.log'})"
                                        for seed, o in failed))
    by_run = {}
    for seed, o in outcomes.items():
        mine = [run for run in stage_runs(exp) if run.seed == seed]
        by_run.update({(run.arm, seed, run.stage): r for run, r in zip(mine, o["records"])})
    return [by_run[(run.arm, run.seed, run.stage)] for run in stage_runs(exp)]  # in the order of one process


def _seed_worker(exp: Experiment, seed: int, workers: int, log_path: str) -> dict[str, Any]:
    """One seed of `run_experiment(jobs > 1)` in a spawned process: stderr (bars, warnings) to its log file, stage
    lines to stdout prefixed with the seed; the outcome returned as plain data (exceptions need not pickle)."""
    import sys

    import torch

    torch.set_num_threads(exp.threads_per_seed)
    log_file = open(log_path, "a", buffering=1)
    os.dup2(log_file.fileno(), 2)
    sys.stderr = log_file

    def say(msg: str) -> None:
        print(f"[seed {seed}] {msg}", flush=True)
        print(msg, file=log_file, flush=True)

    try:
        records = run_chains(exp, say, jobs=workers, seeds=[seed])
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which decides the exit status
        import traceback

        traceback.print_exc(file=log_file)
        return {"error": describe(exc, OUT_DIR_ADVICE) if isinstance(exc, Exception) else str(exc),
                "exit_status": getattr(exc, "exit_status", None)}
    return {"records": records}


# ------------------------------------------------------------------------------------------------ data
def _world_files(folder: Path) -> list[Path]:
    return sorted((folder / "videos").glob("*.mp4"))


def _render_world(out: Path, w) -> None:
    """Render a world into a folder unique to this process, then move its files into `out` by renames, questions.jsonl
    last: a reader never sees a half-written video or question file, and `out/questions.jsonl` existing means the
    world is complete."""
    import shutil

    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        make_dataset(tmp, w.videos, w.seed, duration=w.duration, questions_per_video=w.questions_per_video)
        files = sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != "questions.jsonl")
        for src in files + [tmp / "questions.jsonl"]:
            dest = out / src.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_data(exp: Experiment, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The data stage (<out_dir>/data/stage.json): render the worlds not yet rendered, build each SFT owner arm's
    teacher examples, and check that no eval video has the bytes of a training video (a held-out world made from a
    training seed would score questions the students were trained on)."""
    assert exp.data is not None
    folder = Path(exp.out_dir) / "data"
    t0 = time.perf_counter()
    worlds = []
    for w in exp.data.worlds:
        out = Path(w.out)
        if (out / "questions.jsonl").is_file():
            progress(f"data: world {out} (seed {w.seed}) exists")
        else:
            progress(f"data: rendering world {out}: {w.videos} videos of {w.duration:g} s, seed {w.seed}")
            _render_world(out, w)
        worlds.append({"out": str(out), "seed": w.seed, "videos": len(_world_files(out))})
    datasets = []
    for d in exp.data.datasets:
        out, fractions = Path(d.out), parse_split(d.split)
        made = json.loads((out / "prepare.json").read_text()) if (out / "prepare.json").is_file() else {}
        same = {k: made.get(k) for k in ("format", "annotations", "videos", "seed", "split")}
        if same == {"format": d.format, "annotations": str(Path(d.annotations)), "videos": str(Path(d.videos)),
                    "seed": d.seed, "split": fractions}:
            progress(f"data: {out} was split before ({made['questions']} questions)")
        else:
            progress(f"data: splitting {d.annotations} ({d.format}) into {out}")
            made = prepare(d.format, Path(d.annotations), Path(d.videos), out, fractions, d.seed,
                           progress=lambda m: progress(f"data: {m}"))
        datasets.append({"out": str(out), "questions": made["questions"], "skipped": made["skipped"]})
    examples: dict[str, Any] = {}
    if exp.data.sft_examples and exp.sft is not None:
        built: dict[str, tuple[str, dict]] = {}
        for arm in exp.arms:
            owner = exp.owner(arm, "sft")
            if owner != arm:
                continue
            run = StageRun(arm, exp.seeds[0], "sft", exp.stage_dir(arm, exp.seeds[0], "sft"))
            cfg = load_stage_config(exp, run)[0]
            if cfg.data.teacher is None:
                continue
            if not cfg.data.examples:
                raise ExperimentError(f"arm {arm}, stage sft: data.examples must name a file for the data stage to "
                                      f"build it once for every seed (it defaults to one per run folder)")
            path, settings = str(examples_path(cfg)), data_settings(cfg)
            if path in built and built[path][1] != settings:
                raise ExperimentError(f"arms {built[path][0]} and {arm} build SFT examples with other settings into "
                                      f"the same file {path}: give one of them another data.examples")
            if path not in built:
                found, stats = prepare_examples(cfg, progress=lambda m: progress(f"data: {m}"))
                built[path] = (arm, settings)
                examples[path] = {"examples": len(found),
                                  "stats": {k: v for k, v in stats.items() if k != "data"}}
    overlap = check_held_out(exp)
    record = {"experiment": exp.name, "stage": "data", "wall_s": time.perf_counter() - t0, "worlds": worlds,
              "datasets": datasets, "sft_examples": examples, "held_out_check": overlap}
    folder.mkdir(parents=True, exist_ok=True)
    _write_stage(folder, record)
    progress(f"data: ready in {record['wall_s']:.1f}s ({overlap})")
    return record


def check_held_out(exp: Experiment) -> str:
    """Refuse an eval video whose bytes equal a training stage's video; returns what was compared."""
    if exp.eval is None:
        return "no eval stage"
    trained: dict[str, str] = {}
    for stage in ("sft", "marl"):
        if getattr(exp, stage) is None:
            continue
        for arm in exp.arms:
            run = StageRun(arm, exp.seeds[0], stage, exp.stage_dir(arm, exp.seeds[0], stage))
            d = load_stage_config(exp, run)[0].data
            if d.questions and Path(d.questions).is_file():
                for q in load_questions(d.questions, d.video_dir):
                    if Path(q.video).is_file() and q.video not in trained.values():
                        trained[file_sha256(q.video)] = q.video
    held, _ = eval_questions(exp)
    videos = sorted({q.video for q in held if Path(q.video).is_file()})
    for v in videos:
        same = trained.get(file_sha256(v))
        if same is not None:
            raise ExperimentError(f"eval video {v} has the same bytes as training video {same}: the held-out "
                                  f"questions must come from another world (another synth seed)")
    return f"{len(videos)} eval videos share no bytes with {len(trained)} training videos"


# ------------------------------------------------------------------------------------------------ --plan
def _measured_step_s(exp: Experiment, arm: str, stage: str) -> float | None:
    """Mean wall seconds per step measured by earlier runs of this arm's stage (any seed), else None."""
    times = []
    for seed in exp.seeds:
        try:
            rows = read_metrics(exp.stage_dir(arm, seed, stage))
        except PlotError:
            continue
        for r in rows:
            t = r.get("time/step", r.get("time/total"))
            if isinstance(t, (int, float)) and math.isfinite(t):
                times.append(float(t))
    return sum(times) / len(times) if times else None


def _steps(cfg, stage: str) -> int | None:
    """Optimizer steps of one run: MARL `steps`; SFT `max_steps`, else epochs x batches of an existing examples
    file (None when the examples are still to be built)."""
    if stage == "marl":
        return cfg.steps
    if cfg.max_steps:
        return cfg.max_steps
    path = Path(cfg.data.examples) if cfg.data.examples else None
    if path is None or not path.is_file():
        return None
    with open(path) as f:
        n = sum(1 for line in f if line.strip())
    return math.ceil(n / cfg.batch_size) * cfg.epochs


def _seated_models(exp: Experiment, arm: str, cfg) -> set[str]:
    """Model keys of a MARL stage that this arm's SFT stage replaces with its trained weights: their configured
    paths need not exist before the experiment runs, so the plan's preflight leaves them to the seating."""
    if "sft" not in exp.arm_stages(arm):
        return set()
    sft_cfg, _ = load_stage_config(exp, StageRun(arm, exp.seeds[0], "sft", exp.stage_dir(arm, exp.seeds[0], "sft")))
    trained = set(sft_cfg.train_agents or [a.name for a in sft_cfg.team_config().agents])
    return {a.model for a in cfg.team_config().agents if a.name in trained}


def plan_text(exp: Experiment, gpus: int | None, gpu_mem_gb: float | None) -> tuple[str, bool]:
    """(text, fits): the stages x arms x seeds, and per training stage and arm its placement plan, GPU count and,
    where a step time was measured in this experiment's folders, estimated GPU-hours, and the preflight of its models
    (a model that cannot be built makes `fits` false, as a plan that does not fit does). Loads no weights."""
    runs = stage_runs(exp)
    lines = [f"experiment {exp.name}: stages {' -> '.join(exp.stages)}; arms {list(exp.arms)}; seeds {exp.seeds}; "
             f"{len(runs)} stage runs in {exp.out_dir}"]
    if exp.data is not None:
        state = "done" if (Path(exp.out_dir) / "data" / STAGE_FILE).is_file() else "to run"
        lines.append(f"  {'data (worlds, SFT examples)':<32} {state:<7} {Path(exp.out_dir) / 'data'}")
    for run in runs:
        state = ("done" if (run.folder / STAGE_FILE).is_file() else "recorded"
                 if exp.record_path(run.arm, run.seed, run.stage).is_file() else "to run")
        lines.append(f"  {run.label:<32} {state:<8} {run.folder}")
    fits = True
    total_hours: float | None = 0.0
    for stage in ("sft", "marl"):
        if getattr(exp, stage) is None:
            continue
        for arm in exp.arms:
            if stage not in exp.arm_stages(arm):
                continue
            if exp.owner(arm, stage) != arm:
                lines += ["", f"== {stage} / arm {arm}: the same as arm {exp.owner(arm, stage)}'s, run once =="]
                continue
            run = StageRun(arm, exp.seeds[0], stage, exp.stage_dir(arm, exp.seeds[0], stage))
            cfg, _ = load_stage_config(exp, run)  # planned on the config's own weights: seats change paths, not shapes
            plan = make_plan(cfg, gpus=gpus, gpu_mem_gb=gpu_mem_gb)
            fits = fits and plan.fits
            extra = " + the arm's overrides" if getattr(exp.arm(arm), stage) else ""
            lines += ["", f"== {stage} / arm {arm} ({getattr(exp, stage).config}{extra}) =="]
            if stage == "marl" and "sft" in exp.arm_stages(arm):
                lines.append("(starts from this arm's SFT weights: same shapes as planned here)")
            lines.append(plan.render())
            checks = check_run(cfg)
            seated = _seated_models(exp, arm, cfg) if stage == "marl" else set()
            refused = [c for c in checks if c.status == "refused" and c.key not in seated]
            fits = fits and not refused
            lines += summary([c for c in checks if c.key not in seated])
            if seated:
                lines.append(f"models this arm's SFT stage makes (checked when seated): {', '.join(sorted(seated))}")
            lines += [f"model refused: {c.line()}" for c in refused]
            steps, step_s = _steps(cfg, stage), _measured_step_s(exp, arm, stage)
            n = len(exp.seeds)
            if steps is not None and step_s is not None:
                if plan.gpus_needed:
                    hours = plan.gpus_needed * steps * step_s / 3600 * n
                    total_hours = None if total_hours is None else total_hours + hours
                    lines.append(f"time: {steps} steps x {step_s:.1f} s/step (measured here) x {plan.gpus_needed} "
                                 f"GPUs x {n} seeds = {hours:.1f} GPU-hours")
                else:  # a CPU run: wall time, not GPU time
                    lines.append(f"time: {steps} steps x {step_s:.1f} s/step (measured here) x {n} seeds = "
                                 f"{steps * step_s / 3600 * n:.2f} wall-hours on CPU, no GPU")
            else:
                total_hours = None
                why = ("no step time measured yet" if steps is not None
                       else "step count unknown until the SFT examples exist")
                lines.append(f"time: not estimated ({why}); {plan.gpus_needed} GPUs per run x {n} seeds"
                             + (f", {steps} steps each" if steps is not None else ""))
    if exp.eval is not None:
        lines += ["", f"== eval: team {exp.eval.team} on {exp.eval.source}: not planned (inference, "
                      f"{len(exp.arms) * len(exp.seeds)} runs) =="]
    if total_hours is not None and total_hours > 0:
        lines.append(f"total training: {total_hours:.1f} GPU-hours")
    elif exp.sft is not None or exp.marl is not None:
        lines.append("total training GPU-hours: not estimated")
    return "\n".join(lines), fits

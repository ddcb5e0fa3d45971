"""Run an experiment: the data stage, then every (arm, seed) through its stages in order, each an ordinary run in
its own folder (`stages`), skipping what is finished here or recorded under rows_dir (`records`); with --jobs, the
seeds in worker processes.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from m1.config import load_team
from m1.errors import describe
from m1.experiment.config import Experiment, ExperimentError
from m1.experiment.data_stage import run_data
from m1.experiment.records import (Planned, examples_of, other_examples, plan_stages, read_record, stage_identity,
                                  write_record)
from m1.experiment.rows import RESULTS_FILE
from m1.experiment.stages import (SPENT_FILE, STAGE_FILE, StageRun, add_spent, check_configs, eval_overrides,
                                  eval_questions, eval_team, init_seat, load_stage_config, read_stage, seat_of,
                                  spent, stage_runs, torn_results, write_stage)
from m1.locks import hold_dir
from m1.marl.plan.cluster import PlanError
from m1.marl.guard import OUT_DIR_ADVICE
from m1.marl.launch import merge_adapters
from m1.marl.plan.planner import make_plan
from m1.results import ResultsFile
from m1.signals import Stopped

log = logging.getLogger(__name__)

MERGED_DIR = "merged"


# ------------------------------------------------------------------------------------------------ one stage
def _run_train(exp: Experiment, run: StageRun, seat: list[str], progress: Callable[[str], None]) -> dict:
    # looked up at each call (not at the top), so tests that wrap these entry points reach them
    from m1.marl.launch import train_main
    from m1.marl.sft import sft_main

    cfg, sets = load_stage_config(exp, run, seat)
    spec = getattr(exp, run.stage)
    main = sft_main if run.stage == "sft" else train_main
    main(spec.config, sets, progress=lambda msg: progress(f"  {msg}"))
    new_seat, root = seat_of(cfg, run.folder)
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


@dataclass
class _Chain:
    """What the stages of one `run_chains` share: the experiment, where progress goes, the worker processes sharing
    the cores (the load warning's count), what a run does with each stage folder (`plan_stages`), and the eval
    questions, read once for the records of every eval finished here."""

    exp: Experiment
    progress: Callable[[str], None]
    jobs: int
    plan: dict[Path, Planned]
    questions: list = field(default_factory=list)

    def record(self, run: StageRun, done: dict[str, Any]) -> None:
        """Write the committed record of a stage finished here (`write_record`)."""
        if run.stage == "eval" and not self.questions:
            self.questions = eval_questions(self.exp)[0]
        write_record(self.exp, run, done, self.questions)


def run_chains(exp: Experiment, progress: Callable[[str], None] = print, jobs: int = 1,
               seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """Every unfinished (arm, seed, stage) in order (of `seeds` only, when given: a worker's share); the stage
    records. A finished stage (stage.json) is skipped, and so is a stage another arm owns (the same overrides up to
    it: `Experiment.owner`) or another seed of its SFT group runs (`sft_share`), and one recorded under rows_dir with
    this config's identity (see `plan_stages`); one finished with other overrides than the experiment now gives is
    refused rather than silently reused. `jobs`: the worker processes sharing the cores (the load warning's count)."""
    runs = [r for r in stage_runs(exp) if seeds is None or r.seed in seeds]
    chain = _Chain(exp, progress, jobs, plan_stages(exp))
    records: list[dict[str, Any]] = []
    seats: dict[tuple[str, int], list[str]] = {}
    for i, run in enumerate(runs, 1):
        owner, head = exp.owner(run.arm, run.stage), exp.stage_seed(run.arm, run.seed, run.stage)
        tag = (f"[{i}/{len(runs)}] {run.label}" + (f" (= arm {owner}'s)" if owner != run.arm else "")
               + (f" (= seed {head}'s, sft_share {exp.sft_share})" if head != run.seed else ""))
        seat = seats.get((run.arm, run.seed)) or init_seat(exp, run.arm, head)  # [] after a recorded stage
        done = _chain_stage(chain, run, owner, head, seat, tag)
        if run.stage != "eval":
            seats[(run.arm, run.seed)] = done.get("seat") or []
        records.append(done)
    return records


def _chain_stage(chain: _Chain, run: StageRun, owner: str, head: int, seat: list[str], tag: str) -> dict[str, Any]:
    """One stage of a chain, computed by arm `owner` at seed `head`: its record as finished here (recorded under
    rows_dir if it is not yet) or under rows_dir, else the stage run now (`_run_stage`)."""
    exp, progress = chain.exp, chain.progress
    planned = chain.plan[run.folder]
    record_path = exp.record_path(run.arm, run.seed, run.stage)
    done = read_stage(run.folder)
    torn = None
    if done is not None:
        ident = _check_finished(exp, StageRun(run.arm, head, run.stage, run.folder), owner, seat, done)
        torn = torn_results(run.folder, done)
        if torn is not None:
            progress(f"{tag}: {torn}: running the stage again to repair it")
    if done is not None and torn is None:
        progress(f"{tag}: done before ({done['wall_s']:.1f}s), skipped -> {run.folder}")
        record = read_record(exp, run)
        if owner == run.arm and head == run.seed and (record is None or record.get("identity") != ident):
            chain.record(run, {**done, "identity": ident})
            progress(f"{tag}: recorded -> {record_path}")
        return done
    if planned.state == "recorded" and planned.needed_by is None:
        done = planned.record
        progress(f"{tag}: recorded before ({done.get('wall_s', 0.0):.1f}s), skipped -> {record_path}")
        return done
    if owner != run.arm:
        raise ExperimentError(f"{run.label}: arm {owner} runs this stage and has not finished it ({run.folder})")
    if head != run.seed:
        raise ExperimentError(f"{run.label}: seed {head} runs this stage (sft_share {exp.sft_share}) and has not "
                              f"finished it ({run.folder})")
    earlier = spent(run.folder) + (done["wall_s"] if done is not None else 0.0)  # a torn run's time too
    return _run_stage(chain, run, seat, tag, earlier)


def _check_finished(exp: Experiment, src: StageRun, owner: str, seat: list[str], done: dict[str, Any]) -> str:
    """Refuse a stage finished here with other overrides or another config than the experiment now gives (`src`:
    the run that computed its folder), rather than reuse it for what it is not; returns its identity."""
    if src.stage != "eval":
        expected = load_stage_config(exp, src, seat)[1]
    else:
        expected = eval_overrides(exp, src, seat)
    if done.get("overrides") != expected:
        raise ExperimentError(
            f"{src.folder / STAGE_FILE}: finished with other overrides than the experiment now gives "
            f"({done.get('overrides')} vs {expected}); delete that folder to rerun it, or use another out_dir")
    ident = stage_identity(exp, owner, src.seed, src.stage)
    if done.get("identity", ident) != ident:
        raise ExperimentError(f"{src.folder / STAGE_FILE}: finished with another config than the experiment "
                              f"now gives (identity {done['identity']}, now {ident}: a stage config or team "
                              "changed); delete that folder to rerun it, or use another out_dir")
    if other_examples(exp, StageRun(owner, src.seed, src.stage, src.folder), done):
        raise ExperimentError(f"{src.folder / STAGE_FILE}: trained on other SFT examples than the experiment's "
                              "data.examples now holds (rebuilt since); delete that folder to rerun it, or use "
                              "another out_dir")
    return ident


def _run_stage(chain: _Chain, run: StageRun, seat: list[str], tag: str, earlier: float) -> dict[str, Any]:
    """Run a stage (again, where its record is of another config, or its weights are needed here), write its
    stage.json and its committed record; `earlier`: wall seconds of its unfinished attempts, counted in."""
    exp, progress, jobs = chain.exp, chain.progress, chain.jobs
    planned = chain.plan[run.folder]
    record_path = exp.record_path(run.arm, run.seed, run.stage)
    ident = planned.identity or stage_identity(exp, run.arm, run.seed, run.stage)
    if planned.state == "changed" and planned.record and planned.record.get("identity") == ident:
        progress(f"{tag}: {record_path} was trained on other SFT examples than data.examples now holds: "
                 "running it again")
    elif planned.state == "changed":
        was = planned.record.get("identity") if planned.record else None
        progress(f"{tag}: {record_path} was recorded with another config (identity {was}, now {ident}): "
                 "running it again")
    elif planned.state == "recorded":
        progress(f"{tag}: recorded in {record_path}, but its weights are not on this machine and "
                 f"{planned.needed_by} needs them: training it again")
    progress(f"{tag}: running -> {run.folder}" + (f" (resumed; {earlier:.1f}s before)" if earlier else ""))
    before = warn_load(jobs, exp.threads_per_seed, progress)
    t0 = time.perf_counter()
    try:
        body = (_run_eval if run.stage == "eval" else _run_train)(exp, run, seat, progress)
    except BaseException:  # stopped or failed: the rerun's record counts this attempt's time too
        add_spent(run.folder, time.perf_counter() - t0)
        raise
    after = load_state(jobs, exp.threads_per_seed)
    examples = examples_of(exp, run.arm, run.seed, run.stage)
    done = {"experiment": exp.name, "arm": run.arm, "seed": run.seed, "stage": run.stage,
            "wall_s": earlier + time.perf_counter() - t0, "identity": ident,
            **({"examples": examples} if examples else {}), **body,
            "load": {"before": before and before["load"], "after": after and after["load"],
                     "cores": os.cpu_count(), "given": jobs * exp.threads_per_seed}}
    if "gpus" in done:
        done["gpu_hours"] = done["wall_s"] / 3600 * done["gpus"]
    write_stage(run.folder, done)
    (run.folder / SPENT_FILE).unlink(missing_ok=True)
    chain.record(run, done)
    progress(f"{tag}: finished in {done['wall_s']:.1f}s -> {run.folder}; recorded -> {record_path}")
    return done


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
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    if workers * threads > (os.cpu_count() or 1):
        progress(f"warning: {workers} seeds x {threads} torch thread(s) (threads_per_seed) on {os.cpu_count()} "
                 "cores: they share them (results do not change, wall time does)")
    logs = Path(exp.out_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    progress(f"{len(exp.seeds)} seeds in {workers} worker processes, {threads} torch thread(s) each "
             f"(threads_per_seed, whatever --jobs is); their logs in {logs}")
    outcomes: dict[int, dict[str, Any]] = {}
    first, after = seed_order(exp)
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        running = {ex.submit(_seed_worker, exp, seed, workers, str(logs / f"seed{seed}.log")): seed for seed in first}
        while running:  # every seed submitted runs to its end; after a signal no further one is submitted
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                seed = running.pop(future)
                outcomes[seed] = future.result()
                if not any(o.get("exit_status") for o in outcomes.values()):
                    running.update({ex.submit(_seed_worker, exp, s, workers, str(logs / f"seed{s}.log")): s
                                    for s in after.get(seed, [])})
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


def seed_order(exp: Experiment) -> tuple[list[int], dict[int, list[int]]]:
    """The seeds to start at once, and for each seed those that start from its SFT (sft_share: the seed that trains
    a group's SFT first, the rest of the group as soon as it is done, not when every group's is)."""
    heads = [s for s in exp.seeds if exp.sft is None or s % exp.sft_share == 0]
    after = {h: [s for s in exp.seeds if s not in heads and s - s % exp.sft_share == h] for h in heads}
    return heads, after  # config validation keeps a group's SFT seed among the seeds


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


"""An experiment's stage runs and what each needs: folders, `stage.json`, overrides, seats, the eval questions.

Folder of a stage: <out_dir>/<arm>/seed<k>/<stage>. A stage is finished when that folder holds `stage.json`, written
last and atomically (the config used, wall seconds, result paths, and for a training stage the overrides that seat
its trained agents). A rerun skips finished stages and lets an unfinished one resume the way its own command does
(training from its newest checkpoint, eval from the answers already in its results file).

Chaining: a stage's "seat" is the list of team overrides that puts the trained weights in place — the stage
config's own `team_overrides` (the weights it started from) plus `trained_agent_overrides` of its last checkpoint
(full weights replace the model's source, a LoRA adapter goes on top). MARL starts from the seat of its arm's SFT;
eval answers with the seat of the last training stage.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m1.config import load_team
from m1.config_files import ConfigError
from m1.data.loaders import load_benchmark
from m1.data.questions import build_questions, read_questions
from m1.experiment.config import Experiment, ExperimentError
from m1.experiment.rows import RESULTS_FILE
from m1.files import WriteError, write_whole
from m1.marl.checkpoint import find_latest_checkpoint
from m1.marl.config import load_sft_config, load_train_config
from m1.marl.launch import trained_agent_overrides

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


def write_stage(folder: Path, record: dict[str, Any]) -> Path:
    """stage.json through a temporary file unique to this process, renamed over it (`write_whole`)."""
    path = Path(folder) / STAGE_FILE
    write_whole(path, json.dumps(record, indent=1).encode())
    return path


SPENT_FILE = ".wall_s"  # wall seconds of the earlier, unfinished attempts of a stage (a stopped or failed run)


def spent(folder: Path) -> float:
    """Wall seconds the earlier attempts of a stage took (0 for a first attempt)."""
    path = Path(folder) / SPENT_FILE
    try:
        return float(path.read_text())
    except (FileNotFoundError, ValueError):
        return 0.0


def add_spent(folder: Path, seconds: float) -> None:
    """Count an unfinished attempt's wall time towards the stage's record (written whole; best effort on a full disk,
    where the error in flight is the one to report)."""
    if not Path(folder).is_dir():
        return
    try:
        write_whole(Path(folder) / SPENT_FILE, f"{spent(folder) + seconds:.3f}".encode())
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


def seat_of(cfg, folder: Path) -> tuple[list[str], str]:
    """(seat, checkpoint root) of a finished training stage: its team_overrides plus its trained agents."""
    root = find_latest_checkpoint(folder)
    if root is None:
        raise ExperimentError(f"{folder}: the stage ended without a checkpoint; nothing to seat for the next stage")
    team = cfg.team_config()
    agents = list(cfg.train_agents or [a.name for a in team.agents])
    sets, notes = trained_agent_overrides(team, agents, root, cfg.learner.finetune)
    if notes:  # an agent left unseated would make the next stage silently use untrained weights
        raise ExperimentError(f"{folder}: cannot seat every trained agent: " + "; ".join(notes))
    # a trained model does not start from a tiny spec: drop the overrides of its spec (init_seat's seed shift)
    untiny = {x.split("=", 1)[0][: -len(".tiny")] + ".tiny." for x in sets if x.endswith(".tiny=null")}
    kept = [x for x in cfg.team_overrides if not any(x.startswith(p) for p in untiny)]
    return kept + sets, str(root)



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


def previous_training(exp: Experiment, run: StageRun) -> StageRun | None:
    """The training stage whose weights `run` starts from (None for a first stage)."""
    stages = exp.arm_stages(run.arm)
    prev = [s for s in stages[: stages.index(run.stage)] if s != "eval"]
    if not prev:
        return None
    seed = exp.stage_seed(run.arm, run.seed, prev[-1])
    return StageRun(run.arm, seed, prev[-1], exp.stage_dir(run.arm, seed, prev[-1]))


"""`m1 train` from the command line: load the config, train, and say how to answer with the trained agents."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable

from m1.config import TeamConfig
from m1.marl.checkpoint import find_latest_checkpoint, stop_on_signals, stopped
from m1.marl.config import load_train_config
from m1.marl.trainer import Trainer


def trained_agent_overrides(team: TeamConfig, agents: list[str], root: Path,
                            finetune: str) -> tuple[list[str], list[str]]:
    """(overrides, notes): team-config overrides (`m1 infer --set ...`) that seat the trained agents of `root` (a
    checkpoint or the averaged folder), full weights replacing the model's source and a LoRA adapter going on top of
    it; and a note for each agent whose model key other agents share: it needs a model entry of its own."""
    sets, notes = [], []
    for agent in agents:
        key = next(a.model for a in team.agents if a.name == agent)
        shared = [a.name for a in team.agents if a.model == key and a.name != agent]
        folder = Path(root) / "agents" / agent / ("adapter" if finetune == "lora" else "model")
        if shared:
            notes.append(f"{agent} shares model {key!r} with {shared}: give it its own model entry for {folder}")
        elif finetune == "lora":
            sets.append(f"models.{key}.adapter={folder}")
        else:
            sets += [f"models.{key}.tiny=null", f"models.{key}.path={folder}"]
    return sets, notes


def infer_command(cfg, agents: list[str], root: Path) -> str:
    """The `m1 infer` call that answers with the trained agents of `root` (printed when training ends): the run's
    team with its `team_overrides` (the weights training started from) and the trained agents seated."""
    team = cfg.team_config()
    ref = cfg.team if isinstance(cfg.team, str) else "TEAM.yaml"  # an inline team has no name to pass
    sets, notes = trained_agent_overrides(team, agents, root, cfg.learner.finetune)
    command = " ".join(["m1 infer VIDEOS --team", shlex.quote(ref)]
                       + [f"--set {shlex.quote(s)}" for s in list(cfg.team_overrides) + sets])
    return command + "".join(f" ({n})" for n in notes)


def run_training(cfg, make_trainer, total_steps: Callable[[Any], int], announce: Callable[[Any], None],
                 progress: Callable[[str], None]):
    """One `m1 train` / `m1 sft` run: its out_dir held against a second run, a first SIGTERM/SIGINT turned into a
    checkpointed stop (TrainingStopped), the trainer closed whatever happens; returns (trainer, rows)."""
    from m1.locks import hold_dir

    with hold_dir(Path(cfg.out_dir), "training output folder"), stop_on_signals() as stop:
        trainer = make_trainer(cfg)
        announce(trainer)
        try:
            rows = trainer.train(stop=stop)
        finally:
            trainer.close()
        if stop and trainer.step < total_steps(trainer):
            raise stopped(cfg.name, trainer, stop, progress)
    return trainer, rows


def train_main(config_path: str | Path, overrides: list[str] | None = None,
               progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """`m1 train --config PATH --set key=value ...`: load the config, train, return the per-step metrics.

    SIGTERM / SIGINT (a scheduler's notice, Ctrl-C): the current step finishes and is checkpointed, then
    TrainingStopped says "stopped at step N; rerun the same command to resume" (the command exits with 143 / 130);
    a second signal stops at once (StoppedAtOnce, no checkpoint). Rerunning the command resumes.
    """
    from m1.plots import plot_finished_run

    cfg = load_train_config(config_path, overrides)

    def announce(trainer) -> None:
        if trainer.step:
            progress(f"resuming {cfg.name} from step {trainer.step} in {cfg.out_dir}")

    trainer, rows = run_training(cfg, Trainer, lambda tr: cfg.steps, announce, progress)
    start = trainer.step - len(rows)
    if rows:
        progress(f"{cfg.name}: {len(rows)} steps, last loss {rows[-1]['loss']:.5f}, "
                 f"mean reward {rows[-1]['reward/mean']:.3f}; metrics in {Path(cfg.out_dir) / 'metrics.jsonl'}")
    else:
        progress(f"{cfg.name}: already at step {start} of {cfg.steps}; nothing to do")
    plot_finished_run(cfg.out_dir, progress)
    from m1.marl.average import AVERAGE_DIR

    root = find_latest_checkpoint(Path(cfg.out_dir))
    if cfg.average.checkpoints:
        root = Path(cfg.out_dir) / AVERAGE_DIR
        progress(f"{cfg.name}: the weights to use (average of {cfg.average.checkpoints} checkpoints"
                 f"{' and the start' if cfg.average.include_start else ''}) are in {root}")
    if root is not None:
        progress("answer with the trained agents: " + infer_command(cfg, trainer.trained, root))
    return rows

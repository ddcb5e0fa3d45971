"""`m1 train` from the command line: load the config, train, and say how to answer with the trained agents."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable

from m1.config import TeamConfig, load_team
from m1.config_files import ConfigError
from m1.locks import hold_dir
from m1.marl.checkpoint import find_latest_checkpoint, stop_on_signals, stopped
from m1.marl.config import load_train_config
from m1.marl.preflight import check_run
from m1.marl.parts import make_trainer
from m1.models.hf import HFChatModel
from m1.models.preflight import require
from m1.plots import plot_finished_run


def trained_agent_overrides(team: TeamConfig, agents: list[str], root: Path,
                            finetune: str) -> tuple[list[str], list[str]]:
    """(overrides, notes): team-config overrides (`m1 infer --set ...`) that seat the trained agents of `root` (a
    checkpoint), full weights replacing the model's source and a LoRA adapter going on top of
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


def run_weights(run_dir: Path) -> Path:
    """The weights a finished training run hands on: its newest checkpoint. A ConfigError (naming `init_from`)
    when there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"init_from: {run_dir} is not a folder; run the SFT stage first (`m1 sft --config ...` "
                          "with this out_dir), or set init_from: null to train from the team's own weights")
    root = find_latest_checkpoint(run_dir)
    if root is None:
        raise ConfigError(f"init_from: {run_dir} holds no finished checkpoint (is its SFT run still going, or did "
                          "it stop before its first checkpoint?); finish it first, or set init_from: null")
    return root


def seated_agents(team: TeamConfig, root: Path) -> tuple[list[str], dict[str, str]]:
    """(overrides, finetune per agent) seating every agent `root` holds weights for (`agents/<agent>/adapter` or
    `agents/<agent>/model`), whichever way it was trained."""
    names = [a.name for a in team.agents]
    found = sorted(p.name for p in (Path(root) / "agents").iterdir() if p.is_dir()) \
        if (Path(root) / "agents").is_dir() else []
    unknown = [a for a in found if a not in names]
    if unknown or not found:
        raise ConfigError(f"init_from: {root} holds weights for {found or 'no agent'}, but team {team.name!r} has "
                          f"agents {names}; point init_from at an SFT run of this team")
    kinds = {a: ("lora" if (Path(root) / "agents" / a / "adapter").is_dir() else "full") for a in found}
    sets: list[str] = []
    for kind in ("lora", "full"):
        agents = [a for a in found if kinds[a] == kind]
        if agents:
            more, notes = trained_agent_overrides(team, agents, root, kind)
            if notes:  # an agent left unseated would silently start from untrained weights
                raise ConfigError(f"init_from: cannot seat every trained agent of {root}: " + "; ".join(notes))
            sets += more
    return sets, kinds


def merge_adapters(team_ref: str, seat: list[str], agents: list[str], out: Path,
                   progress: Callable[[str], None]) -> list[str]:
    """A model holds one adapter, so weights trained as a LoRA adapter are handed to a later training stage as
    whole models: each agent's base with its adapter merged in, written to out/<agent> (kept once complete, so a
    rerun or a resumed run reuses it). Returns `seat` plus the overrides pointing at them (adapter cleared)."""
    import os

    seated = load_team(team_ref, seat)
    sets = list(seat)
    for agent in agents:
        key = next(a.model for a in seated.agents if a.name == agent)
        folder = Path(out) / agent
        if not (folder / "config.json").is_file():
            progress(f"  merging {agent}'s adapter into its base -> {folder}")
            chat = HFChatModel(seated.models[key], key)
            tmp = Path(out) / f".{agent}.tmp"
            chat.model.save_pretrained(tmp)
            chat.tokenizer.save_pretrained(tmp)
            os.replace(tmp, folder)
        sets += [f"models.{key}.tiny=null", f"models.{key}.path={folder}", f"models.{key}.adapter=null"]
    return sets


INIT_DIR = "init"  # <out_dir>/init/<agent>: the SFT adapters of `init_from` merged into their bases


def seat_init(cfg, progress: Callable[[str], None] | None = None, merge: bool = True):
    """`cfg` with the agents of its `init_from` run seated (team_overrides extended); `cfg` itself without one.

    merge=False (the placement plan, which loads no weights) seats LoRA adapters on their bases as they are;
    training merges them into <out_dir>/init first, so the MARL adapter and the printed `m1 infer` call sit on
    the SFT weights."""
    if not getattr(cfg, "init_from", None):
        return cfg
    if not isinstance(cfg.team, str):
        raise ConfigError("init_from needs a named team (a configs/team name or a YAML path), not an inline team")
    root = run_weights(Path(cfg.init_from))
    sets, kinds = seated_agents(cfg.team_config(), root)
    lora = [a for a, k in kinds.items() if k == "lora"]
    if merge and lora:
        sets = merge_adapters(cfg.team, list(cfg.team_overrides) + sets, lora, Path(cfg.out_dir) / INIT_DIR,
                              progress or (lambda msg: None))[len(cfg.team_overrides):]
    if progress is not None:
        progress(f"starting from the agents trained in {root} ({', '.join(f'{a}: {k}' for a, k in kinds.items())})")
    return cfg.model_copy(update={"team_overrides": list(cfg.team_overrides) + sets, "init_from": None})


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
    require(check_run(cfg))  # a model that cannot be built is named before any loads or GPUs are reserved
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
    cfg = load_train_config(config_path, overrides)
    seat_init(cfg, merge=False)  # a missing or unfinished SFT run is named before anything loads

    def announce(trainer) -> None:
        if trainer.step:
            progress(f"resuming {cfg.name} from step {trainer.step} in {cfg.out_dir}")

    # the SFT adapters are merged inside the run (its out_dir held), and the trainer's config carries the seat
    trainer, rows = run_training(cfg, lambda c: make_trainer(seat_init(c, progress)), lambda tr: cfg.steps,
                                 announce, progress)
    cfg = trainer.cfg
    start = trainer.step - len(rows)
    if rows:
        progress(f"{cfg.name}: {len(rows)} steps, last loss {rows[-1]['loss']:.5f}, "
                 f"mean reward {rows[-1]['reward/mean']:.3f}; metrics in {Path(cfg.out_dir) / 'metrics.jsonl'}")
    else:
        progress(f"{cfg.name}: already at step {start} of {cfg.steps}; nothing to do")
    plot_finished_run(cfg.out_dir, progress)
    root = find_latest_checkpoint(Path(cfg.out_dir))
    if root is not None:
        progress("answer with the trained agents: " + infer_command(cfg, trainer.trained, root))
    return rows

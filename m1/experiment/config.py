"""The experiment YAML (configs/experiments/<name>.yaml): which stages run, the arms that differ, the seeds.

Kept small on purpose: every stage is an ordinary `m1 sft` / `m1 train` / `m1 infer` run, so an arm is only a list
of dotted overrides per stage, and the stage configs themselves stay where they are (configs/sft, configs/marl,
configs/team).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import Field, field_validator, model_validator

from m1.config import Strict, load_config, resolve_config_path

STAGES = ("sft", "marl", "eval")


class TrainStage(Strict):
    """An SFT or MARL stage: a config (a name in configs/sft or configs/marl, or a YAML path) and overrides."""

    config: str
    overrides: list[str] = Field(default_factory=list)


class EvalStage(Strict):
    """Answer a questions file (JSONL, as `m1 infer --questions` reads) with a team; graded rows give accuracy."""

    team: str  # a name in configs/team or a YAML path; trained agents of earlier stages are seated on it
    questions: str
    video_dir: Optional[str] = None  # relative `video` fields are resolved against it
    overrides: list[str] = Field(default_factory=list)


class Arm(Strict):
    """What one arm changes, per stage: dotted overrides added after the stage's own."""

    sft: list[str] = Field(default_factory=list)
    marl: list[str] = Field(default_factory=list)
    eval: list[str] = Field(default_factory=list)


class Experiment(Strict):
    name: str
    out_dir: str
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    sft: Optional[TrainStage] = None
    marl: Optional[TrainStage] = None
    eval: Optional[EvalStage] = None
    arms: dict[str, Optional[Arm]] = Field(min_length=1)  # the first arm is the baseline of the paired differences

    @field_validator("arms")
    @classmethod
    def _empty_arms(cls, arms: dict[str, Optional[Arm]]) -> dict[str, Optional[Arm]]:
        for name in arms:
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"arm name {name!r} must be a plain folder name")
        return {k: (v if v is not None else Arm()) for k, v in arms.items()}

    @model_validator(mode="after")
    def _checks(self) -> Experiment:
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: must be unique, got {self.seeds}")
        if not self.stages:
            raise ValueError("at least one of sft, marl, eval is needed")
        for arm, spec in self.arms.items():
            for stage in STAGES:
                if getattr(spec, stage) and getattr(self, stage) is None:
                    raise ValueError(f"arms.{arm}.{stage}: overrides for a stage the experiment does not have "
                                     f"(`{stage}:` is null)")
        return self

    @property
    def stages(self) -> list[str]:
        return [s for s in STAGES if getattr(self, s) is not None]

    def arm(self, name: str) -> Arm:
        return self.arms[name]  # type: ignore[return-value]  # None arms are replaced by Arm() on validation

    def stage_dir(self, arm: str, seed: int, stage: str) -> Path:
        return Path(self.out_dir) / arm / f"seed{seed}" / stage


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> Experiment:
    """An experiment YAML: a path, or a name in configs/experiments/. Unknown keys are errors naming file and key."""
    return load_config(Experiment, path, overrides, "experiments")


def experiment_path(path: str | Path) -> Path:
    return resolve_config_path(path, "experiments")

"""The models a training run loads, for the model check (m1/models/preflight.py) that runs before any loads: the
team's agents and tool models, the LLM judge (MARL) and the teacher team's models (SFT, when it builds its
examples)."""
from __future__ import annotations

from pathlib import Path

from m1.config import ModelSpec
from m1.marl.config import SFTConfig, TrainConfig
from m1.models.preflight import JUDGE, ModelCheck, check_models, team_models


def run_models(cfg: TrainConfig | SFTConfig, teacher: bool | None = None) -> dict[str, tuple[ModelSpec, set[str]]]:
    """key -> (spec, roles) of every model the run loads. `teacher` (SFT): include the teacher team's models; None:
    when data.examples does not exist yet (the rule of the placement plan)."""
    models = team_models(cfg.team_config())
    if isinstance(cfg, SFTConfig):
        build = teacher if teacher is not None else not (cfg.data.examples and Path(cfg.data.examples).is_file())
        teacher_cfg = cfg.teacher_config()
        if build and teacher_cfg is not None:
            models.update(team_models(teacher_cfg, prefix="teacher."))
    elif cfg.judge.method == "llm" and cfg.judge.model is not None:
        models["judge"] = (cfg.judge.model, {JUDGE})
    return models


def check_run(cfg: TrainConfig | SFTConfig, teacher: bool | None = None) -> list[ModelCheck]:
    return check_models(run_models(cfg, teacher))

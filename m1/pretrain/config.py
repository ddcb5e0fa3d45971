"""The settings of `m1 pretrain`: which student, which drills in what mix, the schedule, evaluation and checkpoints."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, PositiveInt, model_validator

from m1.config import Strict, TinySpec, load_config
from m1.pretrain.drills import CHAINS, FAMILIES

TEXT = "text"  # the mix's name for plain next-token modelling on the world's texts


class Stage(Strict):
    """From step `start` on: frames per described glance (the context-length curriculum) and, when given, the mix of
    families (single steps alone first, then their chains); a stage without a mix keeps the one before it."""

    start: int = Field(ge=0)
    frames: PositiveInt = 16
    mix: dict[str, float] | None = None


class EvalSettings(Strict):
    every: PositiveInt = 500  # steps between held-out evaluations
    drills: PositiveInt = 100  # held-out drills per family at each evaluation
    final_drills: PositiveInt = 400  # per family, at the end (the record's accuracy)
    families: list[str] = Field(default_factory=lambda: list(FAMILIES))
    frames: PositiveInt = 16


class PretrainConfig(Strict):
    out_dir: str
    # the student: a tiny spec with the students' tokenizer (corpus: reading) and init (init_std: 0.02)
    student: TinySpec
    steps: PositiveInt = 20000
    batch_size: PositiveInt = 16
    lr: float = Field(default=1e-3, gt=0)
    warmup: int = Field(default=200, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)  # cosine decay to lr * this at the last step
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    # drill family (or "text") -> weight in each batch; singles and chains as m1/pretrain/drills.py names them
    mix: dict[str, float] = Field(default_factory=lambda: {**{f: 1.0 for f in FAMILIES}, TEXT: 1.0})
    # chains write each intermediate step before the answer (`bottom left -> C`); False: the answer alone
    steps_written: bool = True
    # loss: next-token loss over every token of a sequence (prompt included) plus `target_weight` times the loss
    # over the target's tokens; every token is what lets lookups leave their plateau (docs/experiments/mini_base.md)
    target_weight: float = Field(default=1.0, ge=0)
    max_tokens: PositiveInt = 768  # a longer drill is drawn again
    text_tokens: PositiveInt = 256  # a text is a random window of this many tokens
    curriculum: list[Stage] = Field(default_factory=lambda: [Stage(start=0, frames=16)])
    eval: EvalSettings = Field(default_factory=EvalSettings)
    checkpoint_every: PositiveInt = 250
    threads: PositiveInt = 1
    seed: int = 0
    world_duration: float = Field(default=120.0, ge=30, le=1200)

    @model_validator(mode="after")
    def _check(self) -> PretrainConfig:
        for where, mix in [("mix", self.mix)] + [(f"curriculum[{i}].mix", s.mix) for i, s in
                                                 enumerate(self.curriculum) if s.mix is not None]:
            unknown = sorted(set(mix) - set(FAMILIES) - {TEXT})
            if unknown:
                raise ValueError(f"{where}: unknown families {unknown}; known: {[*FAMILIES, TEXT]}")
            if not any(w > 0 for w in mix.values()):
                raise ValueError(f"{where}: at least one family needs a weight above 0")
        bad = sorted(set(self.eval.families) - set(FAMILIES))
        if bad:
            raise ValueError(f"eval.families: unknown {bad}; known: {list(FAMILIES)}")
        if not self.curriculum or self.curriculum[0].start != 0:
            raise ValueError("curriculum: the first stage must start at step 0")
        if [s.start for s in self.curriculum] != sorted(s.start for s in self.curriculum):
            raise ValueError("curriculum: stages must be in order of their start step")
        if self.student.arch not in ("qwen2", "qwen3"):
            raise ValueError(f"student.arch: a text student (qwen2 or qwen3), got {self.student.arch}")
        return self

    def frames_at(self, step: int) -> int:
        return [s.frames for s in self.curriculum if s.start <= step][-1]

    def mix_at(self, step: int) -> dict[str, float]:
        return ([self.mix] + [s.mix for s in self.curriculum if s.start <= step and s.mix is not None])[-1]

    @property
    def graded(self) -> list[str]:
        """The families the record reports as the base's reading (the chains the issue grades)."""
        return [f for f in self.eval.families if f in CHAINS]


def load_pretrain_config(path: str | Path, overrides: list[str] | None = None) -> PretrainConfig:
    return load_config(PretrainConfig, path, overrides, "pretrain")

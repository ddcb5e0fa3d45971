"""The settings of `m1 pretrain`: which student, which drills in what mix, the schedule, evaluation and checkpoints."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, PositiveInt, model_validator

from m1.attention_loss import AttentionLossSettings
from m1.config import Strict, TinySpec
from m1.config_files import load_config
from m1.marl.config import CheckpointConfig, LogConfig
from m1.pretrain.drills import CHAINS, FAMILIES

TEXT = "text"  # the mix's name for plain next-token modelling on the world's texts


class Stage(Strict):
    """From step `start` on: frames per described glance (the context-length curriculum) and, when given, the mix of
    families (single steps alone first, then their chains); a stage without a mix keeps the one before it."""

    start: int = Field(ge=0, description="The step this stage starts at.")
    frames: PositiveInt = Field(default=16, description="Frames per described glance from that step on.")
    mix: dict[str, float] | None = Field(default=None, description="Family -> weight from that step on; None: the "
                                                                    "mix before.")


class EvalSettings(Strict):
    every: PositiveInt = Field(default=500, description="Steps between held-out evaluations.")
    drills: PositiveInt = Field(default=100, description="Held-out drills per family at each evaluation.")
    final_drills: PositiveInt = Field(default=400, description="Held-out drills per family at the end (the record's "
                                                               "accuracy).")
    families: list[str] = Field(default_factory=lambda: list(FAMILIES), description="The drill families evaluated.")
    frames: PositiveInt = Field(default=16, description="Frames per described glance in the held-out drills.")


class PretrainConfig(Strict):
    out_dir: str = Field(description="Where checkpoints, metrics and the trained base (OUT_DIR/base) go.")
    student: TinySpec = Field(description=(
        "The student, a tiny spec; students use the reading tokenizer (corpus: reading) and init_std 0.02."))
    steps: PositiveInt = Field(default=20000, description="Training steps.")
    batch_size: PositiveInt = Field(default=16, description="Sequences per step.")
    lr: float = Field(default=1e-3, gt=0, description="Peak learning rate.")
    warmup: int = Field(default=200, ge=0, description="Steps of linear warm-up to lr.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Cosine decay to lr * this at the last step.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, gt=0, description="Clip the gradient norm to this.")
    mix: dict[str, float] = Field(default_factory=lambda: {**{f: 1.0 for f in FAMILIES}, TEXT: 1.0}, description=(
        "Drill family (or text, plain next-token modelling on the world's texts) -> its weight in each batch; "
        "families as m1/pretrain/drills.py names them."))
    steps_written: bool = Field(default=True, description=(
        "Chains write each intermediate step before the answer (`bottom left -> C`); False: the answer alone."))
    target_weight: float = Field(default=1.0, ge=0, description=(
        "The loss is next-token loss over every token (prompt included) plus this times the loss over the target's "
        "tokens; the every-token part lets lookups leave their plateau (docs/experiments/mini_base.md)."))
    attention: AttentionLossSettings = Field(default_factory=AttentionLossSettings, description=(
        "The evidence attention loss (m1/attention_loss.py): reading heads shown where each drill's target is read "
        "from, and optional previous-token / two-back heads."))
    max_tokens: PositiveInt = Field(default=768, description="A drill longer than this is drawn again.")
    text_tokens: PositiveInt = Field(default=256, description="A text sample is a random window of this many "
                                                              "tokens.")
    curriculum: list[Stage] = Field(default_factory=lambda: [Stage(start=0, frames=16)], description=(
        "Stages in order of their start step, the first at 0: frames per glance and, optionally, the mix."))
    eval: EvalSettings = Field(default_factory=EvalSettings, description="Held-out evaluation.")
    checkpoint_every: PositiveInt = Field(default=250, description="Steps between checkpoints.")
    name: str = Field(default="pretrain", description="The run's name in the trackers.")
    log: LogConfig = Field(default_factory=lambda: LogConfig(backends=[]), description=(
        "Trackers besides metrics.jsonl (its rows: one per evaluation) and the progress bar, as MARL's `log`."))
    threads: PositiveInt = Field(default=1, description="CPU threads torch may use.")
    seed: int = Field(default=0, description="Seed of the drills drawn and of training.")
    world_duration: float = Field(default=120.0, ge=30, le=1200, description="Seconds of each synth world video "
                                                                             "the drills are drawn from.")

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
    def checkpoint(self) -> CheckpointConfig:
        """The step loop's checkpoint settings (m1/marl/loop.py): one file, rewritten every `checkpoint_every`."""
        return CheckpointConfig(every=self.checkpoint_every, keep_last=1)

    @property
    def graded(self) -> list[str]:
        """The families the record reports as the base's reading: the eval's families that are chains (CHAINS)."""
        return [f for f in self.eval.families if f in CHAINS]


def load_pretrain_config(path: str | Path, overrides: list[str] | None = None) -> PretrainConfig:
    return load_config(PretrainConfig, path, overrides, "pretrain")

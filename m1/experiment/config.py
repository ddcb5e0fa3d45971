"""The experiment YAML (configs/experiments/<name>.yaml): which stages run, the arms that differ, the seeds.

Kept small on purpose: every stage is an ordinary `m1 sft` / `m1 train` / `m1 infer` run, so an arm is only a list
of dotted overrides per stage, and the stage configs themselves stay where they are (configs/sft, configs/marl,
configs/team).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from m1.config import Strict
from m1.config_files import load_config

STAGES = ("sft", "marl", "eval")
RESERVED = ("data", "logs", "plots")  # folders in <out_dir> that are not arms
# where the committable records of experiments go (`rows_dir` unset): <root>/<name>; M1_EXPERIMENT_ROWS moves the
# root (the tests point it at their own folder, so no test writes into the repository's docs/)
ROWS_ROOT = "docs/experiments"


class ExperimentError(ValueError):
    """An experiment that cannot run or be reported as it stands (what to do is in the message)."""


class TrainStage(Strict):
    """An SFT or MARL stage: a config (a name in configs/sft or configs/marl, or a YAML path) and overrides."""

    config: str
    overrides: list[str] = Field(default_factory=list)


class Benchmark(Strict):
    """A benchmark as `m1 eval` reads it; its questions are answered under ids `<name>:<id>` and reported as one
    family named `name`."""

    name: str
    format: str  # longvideobench | videomme | mlvu | charades_sta | vsibench | video_holmes | jsonl
    annotations: str
    videos: str


class EvalStage(Strict):
    """Answer a questions file (JSONL, as `m1 infer --questions` reads) or benchmarks with a team; graded rows give
    accuracy."""

    team: str  # a name in configs/team or a YAML path; trained agents of earlier stages are seated on it
    questions: Optional[str] = None
    benchmarks: list[Benchmark] = Field(default_factory=list)  # instead of `questions`: one family per benchmark
    video_dir: Optional[str] = None  # relative `video` fields are resolved against it
    overrides: list[str] = Field(default_factory=list)
    # the eval stage's folder in each <arm>/seed<k>/: two experiment files that share an out_dir (the same trained
    # stages) and differ in `folder` evaluate those weights on two question sets, e.g. a dev split to choose
    # settings on and the held-out set answered once per finished candidate
    folder: str = Field("eval", pattern=r"^eval[A-Za-z0-9_-]*$")

    @model_validator(mode="after")
    def _source(self) -> EvalStage:
        if (self.questions is None) == (not self.benchmarks):
            raise ValueError("eval: give `questions` (a JSONL) or `benchmarks`, one of the two")
        names = [b.name for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.benchmarks: names must be unique, got {names}")
        return self

    @property
    def source(self) -> str:
        return self.questions or ", ".join(b.name for b in self.benchmarks)

    # also write each question's JSON trace and HTML page to <stage>/traces (`m1 view`): every generation with its
    # phase and whether it parsed, for questions about format and behaviour that results rows do not answer
    traces: bool = False


class World(Strict):
    """An M1-Synth world the experiment renders once (`m1 synth make OUT --videos N --seed S ...`)."""

    out: str
    videos: int = Field(ge=1)
    seed: int
    duration: float = Field(300.0, ge=30.0, le=1200.0)
    questions_per_video: int = Field(10, ge=1)


class Dataset(Strict):
    """A training set split into question files once (`m1 data prepare`): OUT/<split>.jsonl with `video` relative
    to `videos` (stages then read `data.questions=OUT/sft.jsonl data.video_dir=VIDEOS`)."""

    annotations: str
    videos: str
    out: str
    format: str = "jsonl"
    split: str = "sft=0.5,marl=0.4,dev=0.1"
    seed: int = 0


class DataStage(Strict):
    """What every arm and seed shares, made once before they run: synthetic worlds, then the SFT stage's teacher
    examples (its `data.examples` file, built by its teacher). The eval videos are then checked to share no bytes
    with the training stages' videos."""

    worlds: list[World] = Field(default_factory=list)
    datasets: list[Dataset] = Field(default_factory=list)
    sft_examples: bool = True  # build the SFT examples here (only when the sft stage names a teacher)


class Arm(Strict):
    """What one arm changes, per stage: dotted overrides added after the stage's own; which of the experiment's stages
    it runs (the paper's "base / SFT / MARL / SFT + MARL" rows skip some); and the team it is evaluated on (a team
    that is not trained, e.g. the teacher, as a reference row)."""

    sft: list[str] = Field(default_factory=list)
    marl: list[str] = Field(default_factory=list)
    eval: list[str] = Field(default_factory=list)
    stages: Optional[list[Literal["sft", "marl", "eval"]]] = None  # None: all the experiment's stages
    eval_team: Optional[str] = None  # None: the eval stage's team


class Experiment(Strict):
    name: str
    out_dir: str
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    # seed k starts every randomly initialised (tiny) model of the first training stage from its spec seed
    # + k * init_seed_stride, so seeds differ in their initial weights too, not only in data order and sampling; an
    # arm that trains nothing gets the same shift on its eval team (and on rule-based synth chat models' error draws)
    init_seed_stride: int = Field(1000, ge=0)
    # torch threads of every seed, whatever --jobs is: float sums (and so a chaotic training run) differ with the
    # thread count, and a seed scored 50.0% in a 3-job run, 46.2% alone, when the jobs split the cores between them
    threads_per_seed: int = Field(1, ge=1)
    data: Optional[DataStage] = None
    sft: Optional[TrainStage] = None
    marl: Optional[TrainStage] = None
    eval: Optional[EvalStage] = None
    arms: dict[str, Optional[Arm]] = Field(min_length=1)
    # the arm the report's paired differences and answer changes are taken against; None: the first arm
    baseline: Optional[str] = None
    # the committable record of every finished stage (<rows_dir>/<arm>/seed<k>/<stage>.json: wall time, overrides,
    # load, config identity) and of every eval its per-question rows (<stage>.jsonl, .jsonl.gz past 50 rows: what
    # the report reads): a run on another day or machine, without out_dir, skips what they record. None:
    # docs/experiments/<name>
    rows_dir: Optional[str] = None
    # seeds in groups of `sft_share` (seed s in the group of s - s % sft_share, which must be a seed listed before
    # it) train SFT once, in the group's first seed; every MARL seed of the group starts from those weights (and
    # still samples its own rollouts and data order), and an arm that trains only SFT is answered once per group.
    # 1: every seed its own SFT
    sft_share: int = Field(1, ge=1)

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
        for i, seed in enumerate(self.seeds if self.sft is not None else []):
            head = seed - seed % self.sft_share
            if head not in self.seeds[:i + 1]:
                raise ValueError(f"seeds: with sft_share {self.sft_share}, seed {seed} starts from the SFT of seed "
                                 f"{head}, which must be listed before it (seeds: {self.seeds})")
        if not self.stages:
            raise ValueError("at least one of sft, marl, eval is needed")
        if self.baseline is not None and self.baseline not in self.arms:
            raise ValueError(f"baseline: {self.baseline!r} is not an arm (arms: {list(self.arms)})")
        for arm, spec in self.arms.items():
            if arm in RESERVED:
                raise ValueError(f"arm name {arm!r} is taken by the experiment's own folder <out_dir>/{arm}")
            for stage in spec.stages or []:
                if getattr(self, stage) is None:
                    raise ValueError(f"arms.{arm}.stages: {stage!r} is not a stage of the experiment")
            if spec.eval_team is not None and self.eval is None:
                raise ValueError(f"arms.{arm}.eval_team: the experiment has no eval stage")
            if spec.eval_team is not None and spec.stages != ["eval"]:
                raise ValueError(f"arms.{arm}.eval_team: trained agents are seated on the eval stage's team only; "
                                 f"an arm with its own team runs `stages: [eval]`")
            for stage in STAGES:
                if getattr(spec, stage) and getattr(self, stage) is None:
                    raise ValueError(f"arms.{arm}.{stage}: overrides for a stage the experiment does not have "
                                     f"(`{stage}:` is null)")
        return self

    @property
    def stages(self) -> list[str]:
        return [s for s in STAGES if getattr(self, s) is not None]

    @property
    def base_arm(self) -> str:
        """The arm of the report's paired comparisons."""
        return self.baseline or next(iter(self.arms))

    def arm(self, name: str) -> Arm:
        return self.arms[name]  # type: ignore[return-value]  # None arms are replaced by Arm() on validation

    def arm_stages(self, arm: str) -> list[str]:
        """The stages `arm` runs, in order."""
        only = self.arm(arm).stages
        return [s for s in self.stages if only is None or s in only]

    def _identity(self, arm: str, stage: str) -> list:
        spec = self.arm(arm)
        upto = self.stages[: self.stages.index(stage) + 1]
        return [(s, s in self.arm_stages(arm), getattr(spec, s)) for s in upto] + [spec.eval_team]

    def owner(self, arm: str, stage: str) -> str:
        """The first arm that runs the same stages with the same overrides as `arm` up to and including `stage`:
        both would compute the same thing, so the stage runs once, in that arm's folder (e.g. one SFT for a
        LoRA-vs-full MARL, or for the "SFT" and "SFT + MARL" rows)."""
        if stage not in self.arm_stages(arm):
            return arm
        mine = self._identity(arm, stage)
        return next(a for a in self.arms if stage in self.arm_stages(a) and self._identity(a, stage) == mine)

    def stage_seed(self, arm: str, seed: int, stage: str) -> int:
        """The seed whose run of `stage` seed `seed` uses: its SFT group's first seed (`sft_share`) for SFT, and for
        the eval of an arm whose only training stage is that SFT (the same weights: answered once); else itself."""
        shared = stage == "sft" or (stage == "eval" and self.arm_stages(arm)[:-1] == ["sft"])
        return seed - seed % self.sft_share if shared else seed

    def stage_dir(self, arm: str, seed: int, stage: str) -> Path:
        name = self.eval.folder if stage == "eval" and self.eval is not None else stage
        return Path(self.out_dir) / self.owner(arm, stage) / f"seed{self.stage_seed(arm, seed, stage)}" / name

    @property
    def rows_root(self) -> Path:
        return Path(self.rows_dir or Path(os.environ.get("M1_EXPERIMENT_ROWS", ROWS_ROOT)) / self.name)

    def record_path(self, arm: str, seed: int, stage: str) -> Path:
        """The committable record of a stage: its folder under out_dir, mirrored under rows_dir, + `.json` (an eval's
        rows beside it, `.jsonl` or `.jsonl.gz`: rows.rows_file)."""
        rel = self.stage_dir(arm, seed, stage).relative_to(self.out_dir)
        return self.rows_root / rel.parent / f"{rel.name}.json"


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> Experiment:
    """An experiment YAML: a path, or a name in configs/experiments/. Unknown keys are errors naming file and key."""
    return load_config(Experiment, path, overrides, "experiments")

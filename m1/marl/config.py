"""Configs of the MARL (multi-agent GRPO) and SFT runs: pydantic models for configs/marl and configs/sft.

Like the team configs, every block rejects unknown keys, and `load_train_config` / `load_sft_config` name the file
and the key of any mistake. Defaults are the paper's settings (K=4 rollouts, 8 questions per step, beta=1e-5,
temperature 1, 1024 prompt / 1024 completion tokens, LoRA r=8 alpha=16 dropout 0.05 at lr 2e-6, full fine-tune at
lr 1e-7) so a config only states what differs. The learner block is shared by MARL and SFT. The `grpo` block
(GRPOSettings) lives beside the entries it names, in m1/marl/algo/settings.py.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from m1.attention_loss import AttentionLossSettings
from m1.config import ModelSpec, Strict, TeamConfig, load_team
from m1.config_files import ConfigError, load_config
from m1.marl.algo.advantages import ESTIMATORS
from m1.marl.algo.credit import CREDITS, check_credit
from m1.marl.algo.objectives import OBJECTIVES
from m1.marl.algo.reductions import default_old_logprobs
from m1.marl.algo.settings import GRPOSettings
from m1.marl.entries import check_choice
from m1.marl.reward.rewards import RewardConfig, reward_kind
from m1.marl.team_training import CPP_PHASES, check_seed_policies, seed_phases, team_kind, team_seed_kind

# lr used when `learner.lr` is left empty (MARL: the paper's values; SFT: see SFTConfig)
DEFAULT_LR = {"lora": 2e-6, "full": 1e-7}


def scheduled_lr(peak: float, step: int, total_steps: int, warmup: int, schedule: str = "cosine",
                 floor: float = 0.0) -> float:
    """The lr of optimizer step `step` (0-based) of `total_steps`: linear warm-up to `peak` over `warmup` steps, then
    `schedule` (constant, linear or cosine) down to `peak * floor` at the last step. The one schedule of MARL, SFT
    and `m1 pretrain`."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant" or total_steps <= warmup:
        return peak
    frac = min(1.0, (step - warmup) / max(1, total_steps - warmup))  # 0 at the end of warm-up, 1 past the end
    decay = 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return peak * (floor + (1 - floor) * decay)


class LoraSettings(Strict):
    """peft LoRA adapter (paper: r=8, alpha=16, dropout 0.05)."""

    r: int = Field(8, ge=1, description="Rank of the adapter.")
    alpha: int = Field(16, ge=1, description="Scale of the adapter's update (alpha / r).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="The linear layers that get an adapter.")


class LearnerConfig(Strict):
    """How each agent's model is trained: one learner (policy, reference, optimizer) per agent."""

    finetune: Literal["lora", "full"] = Field(default="lora", description="Train a LoRA adapter or every weight.")
    gpus: int = Field(1, ge=1, description=(
        "GPUs of each agent's learner, one ZeRO-2 group; cluster.learner_gpus overrides it per agent "
        "(m1/marl/plan/placement_plan.py)."))
    lora: LoraSettings = Field(default_factory=LoraSettings, description="The adapter, with finetune lora.")
    lr: float | None = Field(None, gt=0.0, description="Peak learning rate; None: 2e-6 for lora, 1e-7 for full "
                                                       "(DEFAULT_LR).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip the gradient norm to this; None: no "
                                                                 "clipping.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up from lr / warmup_steps to lr.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(default="constant", description=(
        "After warm-up: keep lr (constant), or decay it to 0 at the last step (linear, TRL's default; cosine)."))
    micro_batch_size: int = Field(8, ge=1, description="Samples per forward/backward; gradients accumulate over a "
                                                       "step.")
    max_prompt_tokens: int = Field(1024, ge=1, description=(
        "A longer prompt is an error, never cut. The team's limits.max_prompt_tokens may not exceed it, and is set to "
        "it when the team has none (m1/team/budget.py)."))
    max_completion_tokens: int = Field(1024, ge=1, description="Longer completions are cut; the rest is not "
                                                               "trained.")
    precision: Literal["auto", "fp32", "bf16"] = Field(default="auto", description=(
        "auto: bf16 autocast on CUDA, fp32 on CPU. Master weights stay fp32 (a 1e-7 step vanishes in bf16)."))
    deepspeed: str | None = Field(default=None, description=(
        "Path of a DeepSpeed JSON (e.g. configs/deepspeed/zero2.json); None: plain torch."))
    gradient_checkpointing: bool = Field(default=False, description="Recompute activations in the backward pass to "
                                                                    "save memory.")
    share_prompt_forward: bool = Field(default=True, description=(
        "Run each distinct prompt of a micro-batch once and reuse its key/value cache for its completions (GRPO's K "
        "rollouts share a prompt); same log-probs and gradients as one joint pass. False: the joint pass."))
    micro_batch_tokens: int | None = Field(16384, ge=1, description=(
        "Cap on the padded tokens of a micro-batch (distinct prompts x longest prompt + rows x longest completion; "
        "a longer row goes alone). A step's samples are sorted by length and cut by this and micro_batch_size, so "
        "short prompts are not padded to long ones; any split gives the same gradient. None: rows only. On CPU a "
        "tiny model is fastest near one prompt per micro-batch; on a GPU larger budgets pay."))
    skip_zero_advantage: bool = Field(default=True, description=(
        "At grpo.beta 0, do not run samples with advantage 0 (they add no gradient; the step's weights still count "
        "them). Per-token diagnostics are then means over the tokens run. False: run every sample."))
    prompt_grad: bool = Field(default=True, description=(
        "False: a cheaper, different estimator. The prompt runs without gradient and its key/value cache feeds the "
        "completion pass, so no gradient reaches the prompt's keys and values (about 2.8x less update work on the "
        "mini team)."))
    prompt_loss: float = Field(0.0, ge=0.0, description=(
        "SFT only: weight of a loss on the prompt's tokens (frame descriptions, tool output, the question) against "
        "the completion's per-token mean; a tiny student learns to copy from context there. 0: completion-only "
        "loss, as TRL's default."))
    attention: AttentionLossSettings = Field(default_factory=AttentionLossSettings, description=(
        "SFT only: the evidence attention loss (m1/attention_loss.py): reading heads are pushed onto the prompt "
        "text each completion token is read from, as the teacher recorded it (examples' `evidence`; examples "
        "without it add only the structural heads' terms). Here rather than on the SFT run because the learner "
        "computes the loss and a learner (a Ray actor too) is handed only this block, like prompt_loss. Weight 0 "
        "(the default): off, the loss is exactly the plain one. Text students only."))

    @model_validator(mode="after")
    def _attention_passes(self) -> LearnerConfig:
        """The attention loss reads the prompt's keys and the supervised layers' inputs from the pass with
        gradient; these settings take it away."""
        if self.attention.on and self.gradient_checkpointing:
            raise ValueError("learner.attention with gradient_checkpointing: the layers' inputs the loss keeps would "
                             "carry no gradient; turn one of them off")
        if self.attention.on and not self.prompt_grad:
            raise ValueError("learner.attention with prompt_grad: false: the evidence sits in the prompt, whose keys "
                             "then get no gradient; set prompt_grad: true")
        return self

    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.finetune]

    def lr_at(self, step: int, total_steps: int) -> float:
        """The lr of optimizer step `step` (0-based) of `total_steps`: warm-up, then `lr_schedule`.

        A decaying schedule ends near 0, so the weights a run ends on are not one noisy full-size step away from
        where the loss had settled (the seed-to-seed spread of small runs shrinks).
        """
        return scheduled_lr(self.learning_rate(), step, total_steps, self.warmup_steps, self.lr_schedule)


class DataConfig(Strict):
    questions: str | None = Field(default=None, description=(
        "The training questions, a questions.jsonl as `m1 synth` and the benchmark loaders write."))
    video_dir: str | None = Field(default=None, description="Folder that relative `video` fields are read from.")
    shuffle: bool = Field(default=True, description="A new order every epoch, derived from `seed` and the epoch.")


class RolloutConfig(Strict):
    """K team episodes per question over one random DAG per training step (agent dropout)."""

    num_generations: int = Field(4, ge=1, description="K: episodes per question (the GRPO group).")
    questions_per_step: int = Field(8, ge=1, description="Questions per training step (the paper's batch size).")
    batch_episodes: PositiveInt | Literal["auto"] | None = Field(default=None, description=(
        "Episodes the team runs at once with engine hf. auto: as many of the step's as the KV cache fits in what the "
        "placement plan leaves on each learner GPU (m1/marl/plan/planner.py); a number: that many; None: the team's "
        "limits.batch_episodes. A vllm engine gets the whole step at once (auto only)."))
    engine: Literal["hf", "vllm"] = Field(default="hf", description=(
        "Who generates the trained agents' rollouts. hf: each learner's own policy. vllm: a vLLM server per trained "
        "agent (m1/models/vllm_client.py), weights synced after every update, launched by M1 (engine_command) or "
        "run by you (engine_url)."))
    engine_url: str | dict[str, str] | None = Field(default=None, description=(
        "vllm: the servers you run: one URL when one agent is trained, else {agent: URL}; None: M1 launches them."))
    engine_command: list[str] | None = Field(default=None, description=(
        "vllm: argv of a launched server, {model} {port} {lora_rank} {gpu_memory_utilization} filled in; None: "
        "`vllm serve ...`."))
    engine_timeout_s: float = Field(600.0, gt=0.0, description="vllm: seconds one request may take before a clear "
                                                               "error.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of every agent (unless an agent sets "
                                                        "its own).")
    phase_temperature: dict[str, float] = Field(default_factory=dict, description=(
        "Ours: a rollout temperature per CPP phase over `temperature`, e.g. {communicate: 1.5} to explore the "
        "revise-or-continue decision (the team's sampling.phase_temperature, set for the run; each generation is "
        "scored at the temperature it was sampled at)."))
    distinct_plans: int = Field(0, ge=0, description=(
        "Ours: n > 1 makes the K rollouts of a question start from distinct plans, each agent's tool lists drawn "
        "without replacement from its own distribution (n draws per rollout; the team's sampling.distinct_plans, "
        "set for the run). The kept plans keep the log-probs they were sampled with, and the loss treats them as "
        "the policy's draws: the group then compares K different plans, and a plan the policy rarely writes is "
        "trained on more often than the policy would draw it (the exploration this is for)."))
    plan_fill: Literal["repeat", "uniform", "shared"] = Field("repeat", description=(
        "Ours, with distinct_plans: what a rollout starts from when its group's draws held fewer distinct plans "
        "than K (the team's sampling.plan_fill, set for the run). repeat: the earliest draws again. uniform: a "
        "select x browse plan no rollout of the group took, drawn uniformly after the agent's own key info, so a "
        "plan the policy almost never writes is tried and credited; shared: in one order per question for every "
        "agent, so a filled rollout gives the seats one plan where their own draws agree (filled tokens are scored "
        "as the policy's: needs grpo.old_logprobs: policy)."))
    topology: Literal["random", "complete"] = Field(default="random", description=(
        "random: one random DAG per step (edge_prob, dropout); complete: every agent reads every earlier one."))
    edge_prob: float = Field(0.5, ge=0.0, le=1.0, description="random: chance each forward edge is kept.")
    dropout: float = Field(0.25, ge=0.0, lt=1.0, description="random: chance each agent sits out (one always "
                                                             "stays).")
    credit: str = Field(default="episode", description=(
        "episode (paper): every generation carries the advantage of its agent's total reward. phase (ours): answers "
        "and summaries carry the advantage of the outcome alone (w_res * R_res + w_format * parsed + w_team * "
        "team_res). agent (ours): question i focuses trained agent i mod n, sampling while teammates decode "
        "greedily, and only its generations are trained (m1/marl/algo/credit.py); raise questions_per_step to keep "
        "each agent's samples per step. Any rule registered with m1.marl.algo.credit.register_credit."))
    train_phases: list[Literal["plan", "communicate", "answer", "summary", "act"]] = Field(
        default_factory=lambda: list(CPP_PHASES), min_length=1, description=(
            "Ours: the phases whose generations are trained; the others run but carry no gradient (e.g. [answer, "
            "summary]). A seed-kind team writes act and answer turns: the default means both, a list of its own "
            "may name only those."))
    dynamic_sampling: bool = Field(default=False, description=(
        "DAPO's dynamic sampling: drop groups whose rewards all tie (no GRPO signal) and replace a question left "
        "without one by the next questions, for at most max_refill rounds per step."))
    max_refill: int = Field(2, ge=0, description="dynamic_sampling: extra rounds of questions per step.")
    max_staleness: int = Field(0, ge=0, description=(
        "Asynchronous rollouts (m1/marl/producer.py). 0: rollouts, then the update. k > 0: step t's rollouts run "
        "with the weights after update max(0, t - k) while the learners update, and the loss corrects with the "
        "sampler's log-probs (grpo.old_logprobs sampler or rollout). With engine hf, placement local only."))

    @field_validator("credit")
    @classmethod
    def _known_credit(cls, v: str) -> str:
        """Checked against the registry, not a Literal, so that a rule registered elsewhere is accepted."""
        if v not in CREDITS:
            raise ValueError(f"rollout.credit: unknown rule {v!r} (known: {list(CREDITS)})")
        return v


class JudgeConfig(Strict):
    """Judge of the collaboration reward: the offline rubric, an LLM (paper: GPT-4o), or none (w_col must be 0)."""

    RENAMED: ClassVar[dict[str, str]] = {"kind": "method"}
    method: Literal["rubric", "llm", "none"] = Field(default="rubric", serialization_alias="kind", description=(
        "How plans and collaboration are judged (`kind` before). rubric: the offline rule-based judge; llm: a chat "
        "model; none: no judge (rewards.w_col must be 0)."))
    model: ModelSpec | None = Field(default=None, description=(
        "llm: the judge's chat model, e.g. {interface: chat, backend: openai, path: gpt-4o}."))
    cache_dir: str | None = Field(default=None, description="llm: where verdicts are cached; None: "
                                                            "<out_dir>/judge_cache.")
    rate_per_minute: float | None = Field(None, gt=0.0, description="llm: most requests per minute; None: no limit.")
    plan_rubric: Literal["cues", "outcome", "none"] = Field(default="cues", description=(
        "How plans and tool choices are judged, by either judge (m1/marl/reward/judge.py). cues: the tools must fit "
        "cues of the question (the rule-based teacher's preferences). outcome (ours): any tools, judged on a "
        "well-formed plan that ran and gave notes the answer follows. none (ours): the plan's content is not judged."))

    @model_validator(mode="after")
    def _model_for_llm(self) -> JudgeConfig:
        if self.method == "llm" and self.model is None:
            raise ValueError("judge.model: an llm judge needs a chat model spec")
        if self.model is not None and self.model.interface != "chat":
            raise ValueError(f"judge.model: must be a chat model, got interface {self.model.interface!r}")
        return self


TRACKERS = ("tensorboard", "mlflow", "wandb")  # log.backends (m1/marl/trackers.py)


class MlflowSettings(Strict):
    """`log.mlflow`: where the mlflow run goes."""

    tracking_uri: str | None = Field(default=None, description=(
        "Where runs are recorded; None: $MLFLOW_TRACKING_URI, else the file store <out_dir>/mlruns."))
    experiment: str | None = Field(default=None, description="The mlflow experiment; None: the run's name.")


class WandbSettings(Strict):
    """`log.wandb`: offline by default (these machines reach no server); `wandb sync` uploads the run later."""

    project: str | None = Field(default=None, description="The wandb project; None: the run's name.")
    entity: str | None = Field(default=None, description="The wandb team or user; None: wandb's default.")
    mode: Literal["offline", "online"] = Field(default="offline", description=(
        "offline writes the run locally (`wandb sync` uploads it later); online sends it as it runs."))


class LogConfig(Strict):
    """Where a run's metrics go besides metrics.jsonl, and how often a step's episodes are written out.

    `tensorboard: true|false`, the key of earlier configs, is deprecated (a FutureWarning) and goes in M1 0.2.0:
    until then it adds or removes tensorboard from `backends`."""

    backends: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard"], description=(
            "Trackers that get the metrics besides metrics.jsonl. Replaces log.tensorboard (deprecated, removed in "
            "M1 0.2.0)."))
    progress: bool = Field(default=True, description="Show a tqdm progress bar.")
    samples_every: int | None = Field(None, ge=0, description=(
        "Every this many steps, write the step's episodes (prompts, completions, reward parts, advantages) and their "
        "trace pages to <out_dir>/samples/step-NNNNNN/ (m1/marl/samples.py); 0 or None: never."))
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings, description="Where the mlflow run goes.")
    wandb: WandbSettings = Field(default_factory=WandbSettings, description="Where the wandb run goes.")

    @model_validator(mode="before")
    @classmethod
    def _old_tensorboard_key(cls, data):
        if isinstance(data, dict) and "tensorboard" in data:
            data = dict(data)
            on = data.pop("tensorboard")
            if not isinstance(on, bool):
                raise ValueError(f"log.tensorboard: true or false, got {on!r} (or list it in log.backends)")
            warnings.warn("log.tensorboard is deprecated and will be removed in M1 0.2.0: list the trackers in "
                          "log.backends instead (tensorboard: false is backends: [])", FutureWarning, stacklevel=2)
            names = [b for b in data.get("backends", ["tensorboard"]) if b != "tensorboard"]
            data["backends"] = (["tensorboard"] if on else []) + names
        return data

    @model_validator(mode="after")
    def _once_each(self) -> LogConfig:
        doubled = sorted({b for b in self.backends if self.backends.count(b) > 1})
        if doubled:
            raise ValueError(f"log.backends: {doubled} named more than once")
        return self


class CheckpointConfig(Strict):
    every: int = Field(50, ge=1, description="Steps between checkpoints (the last step is always saved).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted.")
    resume: bool = Field(default=True, description="Continue from the newest checkpoint in out_dir when there is "
                                                   "one.")
    resume_from: Literal["latest", "previous"] = Field(default="latest", description=(
        "latest: resume from the newest checkpoint, and stop with an error naming the file when it is damaged. "
        "previous: skip damaged ones and resume from the newest intact one (`--resume-from previous`)."))


class RayConfig(Strict):
    address: str | None = Field(default=None, description="None: start a local Ray; auto: join a running cluster; "
                                                          "or the cluster's address.")
    num_gpus_per_learner: float = Field(0.0, ge=0.0, description="GPUs each learner actor asks Ray for when no "
                                                                 "placement plan places it.")
    num_cpus_per_learner: float = Field(0.0, ge=0.0, description="CPUs each learner actor asks Ray for when no "
                                                                 "placement plan places it.")


class ClusterConfig(Strict):
    """`cluster:` of a MARL or SFT config: the GPUs the run is planned on and the margins of the estimate."""

    gpus_per_node: int = Field(8, ge=1, description="GPUs per node: `--gpus N` means ceil(N / gpus_per_node) "
                                                    "nodes.")
    gpu_mem_gb: float | None = Field(None, gt=0, description="Memory of one GPU; None: --gpu-mem, else the local "
                                                             "GPUs'.")
    reserve_gb: float = Field(3.0, ge=0, description="Per GPU, memory outside the estimates: CUDA context, NCCL, "
                                                     "ZeRO buckets.")
    headroom: float = Field(0.1, ge=0, lt=1, description="Share of each GPU left unplanned (fragmentation, spikes).")
    engine_gpus: int = Field(1, ge=1, description="GPUs of each launched rollout engine (rollout.engine vllm; tensor "
                                                  "parallel).")
    learner_gpus: dict[str, PositiveInt] = Field(default_factory=dict, description="Agent -> GPUs of its learner; "
                                                                                   "overrides learner.gpus.")
    driver_gpus: dict[str, PositiveInt] = Field(default_factory=dict, description=(
        "A driver model's key (or judge) -> its GPUs."))
    driver_headroom: float = Field(0.5, ge=0, description="Activations and KV cache of an inference model, as a "
                                                          "share of its weights.")
    cpus_per_gpu: int = Field(4, ge=0, description="CPUs in each Ray bundle.")

    def gpus_of(self, agent: str, learner: LearnerConfig) -> int:
        """GPUs of `agent`'s learner group: its `learner_gpus` entry, else `learner.gpus`."""
        return self.learner_gpus.get(agent, learner.gpus)


def _budget_check(team: TeamConfig, learner: LearnerConfig) -> None:
    """The team's prompt budget must fit the learner's cap: the learner never cuts a prompt (m1/team/budget.py)."""
    budget = team.limits.max_prompt_tokens
    if budget is not None and budget > learner.max_prompt_tokens:
        raise ValueError(f"team {team.name!r}: limits.max_prompt_tokens={budget} exceeds learner.max_prompt_tokens="
                         f"{learner.max_prompt_tokens}; the learner never cuts a prompt, so the team's budget must be "
                         "at most the learner's")


def _team(team: str | TeamConfig, overrides: list[str]) -> TeamConfig:
    return team if isinstance(team, TeamConfig) else load_team(team, overrides)


class RunSettings(Strict):
    """Where a training run keeps its state and runs, the same for `m1 train` and `m1 sft`: checkpoints, trackers,
    learner placement, the Ray cluster and the GPUs it is planned on."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints and resuming.")
    log: LogConfig = Field(default_factory=LogConfig, description="Trackers and samples.")
    placement: Literal["local", "ray"] = Field(default="local", description=(
        "local: every learner in this process; ray: each trained agent's learner as Ray actors placed by the plan."))
    ray: RayConfig = Field(default_factory=RayConfig, description="The Ray cluster, with placement ray.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description=(
        "The GPUs the run is planned on (`m1 train --plan`, `m1 sft --plan`)."))


class TrainConfig(RunSettings):
    """One MARL run: a team, its questions, rollouts, rewards, GRPO and one learner per agent."""

    name: str = Field(default="marl", description="The run's name (trackers, records).")
    team: str | TeamConfig = Field(description="The team trained: a configs/team name, a YAML path, or the team "
                                               "inline.")
    team_overrides: list[str] = Field(default_factory=list, description="Dotted key=value overrides applied to a "
                                                                        "named team.")
    init_from: str | None = Field(default=None, description=(
        "The out_dir of the SFT run whose trained agents this run starts from, its newest checkpoint (the paper's "
        "recipe: SFT, then MARL; m1/marl/launch.py). None: the team's own weights."))
    train_agents: list[str] | None = Field(default=None, description="The agents that learn; None: all. The others "
                                                                     "still act, frozen.")
    data: DataConfig = Field(default_factory=DataConfig, description="The training questions.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="How episodes are sampled.")
    grpo: GRPOSettings = Field(default_factory=GRPOSettings, description="The loss.")
    rewards: RewardConfig = Field(default_factory=RewardConfig, description="Reward weights and mappings.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="The judge of the collaboration reward.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="How each agent's model is trained.")
    steps: int = Field(200, ge=1, description="Training steps.")
    seed: int = Field(default=0, description="Seed of the data order, the DAGs, sampling and training.")
    out_dir: str = Field(default="runs/marl", description="Where checkpoints, metrics and samples go.")

    @model_validator(mode="after")
    def _checks(self) -> TrainConfig:
        team = self.team_config()
        names = [a.name for a in team.agents]
        for a in self.train_agents or []:
            if a not in names:
                raise ValueError(f"train_agents: no agent named {a!r} in team {team.name!r} (agents: {names})")
        if self.judge.method == "none" and self.rewards.w_col != 0:
            raise ValueError(f"judge.method is 'none' but rewards.w_col={self.rewards.w_col}; set w_col: 0")
        r = self.rollout
        trained = list(self.train_agents or names)
        if r.engine == "hf" and (r.engine_url or r.engine_command):
            raise ValueError("rollout.engine_url / engine_command are for rollout.engine: vllm (it is 'hf')")
        if r.engine == "vllm" and self.grpo.old_logprobs == "policy":
            raise ValueError("grpo.old_logprobs: 'policy' with rollout.engine: 'vllm' never corrects for the "
                             "engine's numerics differing from the trainer's; use grpo.old_logprobs: sampler "
                             "(the default with engine vllm) or rollout")
        if r.engine == "vllm" and isinstance(r.batch_episodes, int):  # auto: what a vLLM engine does anyway
            raise ValueError(f"rollout.batch_episodes ({r.batch_episodes}) is for rollout.engine: hf; a vLLM engine "
                             "gets all of a step's episodes at once and batches them itself (leave it at auto)")
        if isinstance(r.engine_url, str) and len(trained) > 1:
            raise ValueError(f"rollout.engine_url: one URL for {len(trained)} trained agents {trained}; give one "
                             "per agent: {agent: URL}")
        if isinstance(r.engine_url, dict) and sorted(r.engine_url) != sorted(trained):
            raise ValueError(f"rollout.engine_url: needs exactly the trained agents {sorted(trained)}, got "
                             f"{sorted(r.engine_url)}")
        if r.max_staleness > 0 and self.grpo.old_logprobs == "policy":
            raise ValueError(f"grpo.old_logprobs: 'policy' with rollout.max_staleness {r.max_staleness} would treat "
                             "samples of older weights as the learner's own; use sampler (the default) or rollout")
        if r.max_staleness > 0 and r.engine == "hf" and self.placement == "ray":
            raise ValueError(f"rollout.max_staleness {r.max_staleness} with rollout.engine hf needs placement: local "
                             "(the sampler copies live beside the learners in the driver); under Ray use "
                             "rollout.engine: vllm")
        if r.distinct_plans > 1 and team_seed_kind(team) is not None:
            raise ValueError(f"rollout.distinct_plans: a {team_seed_kind(team)} agent writes no plan")
        if r.plan_fill != "repeat" and r.distinct_plans <= 1:
            raise ValueError(f"rollout.plan_fill: {r.plan_fill!r} fills a group of distinct plans; set "
                             "rollout.distinct_plans above 1")
        old = self.grpo.old_logprobs or default_old_logprobs(r.engine, r.max_staleness)
        if r.plan_fill != "repeat" and old != "policy":
            raise ValueError(f"rollout.plan_fill: {r.plan_fill} writes plans no sampler drew, so they have no sampler "
                             f"log-probs for grpo.old_logprobs: {old!r}; use grpo.old_logprobs: policy "
                             "(rollout.engine: hf, max_staleness: 0)")
        if self.learner.attention.on:
            raise ValueError("learner.attention: the evidence attention loss is for SFT (m1 sft), whose examples "
                             "carry the teacher's evidence; set its weight to 0 here")
        if self.grpo.loss_type == "dr_grpo" and self.learner.max_completion_tokens < 1:
            raise ValueError("grpo.loss_type dr_grpo needs learner.max_completion_tokens")
        _budget_check(team, self.learner)
        kind = team_kind(team)
        kind.check(self, team, trained)
        check_credit(self, kind)
        self._check_grpo()
        reward_kind(self.rewards, team)
        return self

    def _check_grpo(self) -> None:
        """The chosen objective's and estimator's own rules (m1/marl/entries.py), read with grpo.old_logprobs as
        the run will use it."""
        old = self.grpo.old_logprobs or default_old_logprobs(self.rollout.engine, self.rollout.max_staleness)
        run = self.model_copy(update={"grpo": self.grpo.model_copy(update={"old_logprobs": old})})
        defaults = {k: f.default for k, f in GRPOSettings.model_fields.items()}
        check_choice(OBJECTIVES, self.grpo.objective, "grpo.objective", run, defaults)
        check_choice(ESTIMATORS, self.grpo.baseline, "grpo.baseline", run, defaults)

    def team_config(self) -> TeamConfig:
        return _team(self.team, self.team_overrides)


class SFTDataConfig(Strict):
    """Where SFT examples come from: an existing JSONL, or a teacher team run over questions."""

    examples: str | None = Field(default=None, description=(
        "A JSONL of SFT examples: read when it exists, else written there from the teacher's run; None: "
        "<out_dir>/sft_examples.jsonl."))
    questions: str | None = Field(default=None, description="The questions the teacher answers (questions.jsonl).")
    video_dir: str | None = Field(default=None, description="Folder that relative `video` fields are read from.")
    teacher: str | TeamConfig | None = Field(default=None, description=(
        "The team that writes the plans (the rule-based teacher or an API team): a name, a path or inline."))
    teacher_overrides: list[str] = Field(default_factory=list, description="Dotted key=value overrides applied to a "
                                                                           "named teacher.")
    rollouts_per_question: int = Field(1, ge=1, description="Teacher episodes per question (a sampling teacher may "
                                                            "plan differently each time).")
    rotate_options: bool = Field(default=False, description=(
        "Ours: rollout r of a multiple-choice question shows its options rotated by r places, so a deterministic "
        "teacher still gives new answers under balanced letters (m1/marl/sft.py rotate_options)."))
    keep_revised_plans: bool = Field(default=False, description=(
        "Ours: also keep a plan its agent revised during the episode when that agent answered right (the paper "
        "drops every changed plan); the revision is learnt from the communicate example."))
    phases: list[Literal["plan", "communicate", "answer", "summary", "act"]] = Field(
        default_factory=lambda: ["plan"], description=(
            "The phases whose generations become examples. With a seed-kind teacher (weaver / zoomer / sage) the "
            "default means its act and answer turns."))
    assign: Literal["all", "same_name"] = Field(default="all", description=(
        "all: every student agent learns every kept example; same_name: each learns those of the teacher agent "
        "with its name."))
    communicate_per_episode: int | None = Field(None, ge=0, description=(
        "Ours: keep at most this many communicate examples per agent and question, the first ones (a data budget "
        "after the keep rule); None: all, so every round holds the teacher's own mix of continue() and revisions "
        "(the one setting whose student revises as its teacher does, docs/experiments/decision_space.md)."))
    communicate_revisions: Literal["thin", "keep"] = Field("thin", description=(
        "Ours: how communicate_per_episode treats a communicate example that adds a tool (a plan revision). thin: "
        "like any other (the majority continue() examples come first, so most revisions go); keep: every kept "
        "revision stays and the budget applies to the continue() examples only, so SFT sees the teacher's "
        "revisions; with communicate_pick first its later rounds then hold revisions only, and the student learnt "
        "to revise at every later round (docs/experiments/decision_space.md). The stats file counts both."))
    communicate_pick: Literal["first", "spread"] = Field("first", description=(
        "Ours: which communicate examples communicate_per_episode keeps per agent and question. first: the first "
        "ones (the first round: a rule teacher revises there mostly on open questions); spread: that many drawn "
        "from all the rounds (seeded), so the later rounds, where the teacher adds a tool after its browser saw "
        "nothing (order, attribute), are taught too (docs/experiments/decision_space.md)."))
    plan_filter: Literal["keep_rule", "all"] = Field(default="keep_rule", description=(
        "keep_rule: plans by the paper's rule (see keep_revised_plans). all (ours): every plan the teacher wrote, "
        "whatever the outcome, so SFT teaches the plan format rather than which plan is good."))
    workers: int = Field(1, ge=1, description=(
        "Teacher worker processes, each over whole videos; the examples are the same as one process's."))


class SFTConfig(RunSettings):
    """Supervised fine-tuning of every agent of a team on kept teacher plans."""

    name: str = Field(default="sft", description="The run's name (trackers, records).")
    team: str | TeamConfig = Field(description="The student team: a configs/team name, a YAML path, or inline.")
    team_overrides: list[str] = Field(default_factory=list, description="Dotted key=value overrides applied to a "
                                                                        "named team.")
    train_agents: list[str] | None = Field(default=None, description="The student agents that learn; None: all.")
    data: SFTDataConfig = Field(default_factory=SFTDataConfig, description="Where the examples come from.")
    rewards: RewardConfig = Field(default_factory=lambda: RewardConfig(w_col=0.0), description=(
        "Rewards of the teacher's episodes; R_res decides which answers are right."))
    learner: LearnerConfig = Field(default_factory=lambda: LearnerConfig(lr=1e-6, finetune="full"), description=(
        "How each student is trained (default here: full fine-tune at lr 1e-6)."))
    epochs: int = Field(1, ge=1, description="Passes over the examples.")
    batch_size: int = Field(8, ge=1, description="Examples per optimizer step, per agent.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps; None: after the epochs.")
    seed: int = Field(default=0, description="Seed of the example order and of training.")
    out_dir: str = Field(default="runs/sft", description="Where examples, checkpoints and metrics go.")

    @model_validator(mode="after")
    def _checks(self) -> SFTConfig:
        names = [a.name for a in self.team_config().agents]
        for a in self.train_agents or []:
            if a not in names:
                raise ValueError(f"train_agents: no agent named {a!r} (agents: {names})")
        d = self.data
        if d.examples is None and (d.teacher is None or d.questions is None):
            raise ValueError("data: give `examples` (a JSONL) or both `teacher` and `questions` to build it")
        try:  # a teacher that does not load yet is reported where it is built, not here
            teacher = self.teacher_config()
        except (ConfigError, OSError):
            teacher = None
        kind = team_seed_kind(teacher) if teacher is not None else None
        if kind is not None:
            seed_phases(d.phases, "data.phases", kind, ["plan"])
        elif "act" in d.phases:
            raise ValueError("data.phases: 'act' is a seed-kind phase; the teacher is a CPP team")
        student = self.team_config()
        _budget_check(student, self.learner)
        if team_seed_kind(student) is not None:
            check_seed_policies(student, list(self.train_agents or names), "train_agents")
        return self

    def team_config(self) -> TeamConfig:
        return _team(self.team, self.team_overrides)

    def teacher_config(self) -> TeamConfig | None:
        t = self.data.teacher
        return None if t is None else _team(t, self.data.teacher_overrides)


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    return load_config(TrainConfig, path, overrides, "marl")


def load_sft_config(path: str | Path, overrides: list[str] | None = None) -> SFTConfig:
    return load_config(SFTConfig, path, overrides, "sft")

"""Configs of the MARL (multi-agent GRPO) and SFT runs: pydantic models for configs/marl and configs/sft.

Like the team configs, every block rejects unknown keys, and `load_train_config` / `load_sft_config` name the file
and the key of any mistake. Defaults are the paper's settings (K=4 rollouts, 8 questions per step, beta=1e-5,
temperature 1, 1024 prompt / 1024 completion tokens, LoRA r=8 alpha=16 dropout 0.05 at lr 2e-6, full fine-tune at
lr 1e-7) so a config only states what differs. The learner block is shared by MARL and SFT.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from m1.config import ConfigError, ModelSpec, Strict, TeamConfig, load_config, load_team
from m1.marl.credit import check_credit
from m1.marl.grpo import LOSSES, OLD_LOGPROBS
from m1.marl.rewards import RewardConfig, reward_kind
from m1.marl.team_kinds import CPP_PHASES, check_seed_policies, seed_kind, seed_phases, team_kind

# lr used when `learner.lr` is left empty (MARL: the paper's values; SFT: see SFTConfig)
DEFAULT_LR = {"lora": 2e-6, "full": 1e-7}


class LoraSettings(Strict):
    """peft LoRA adapter (paper: r=8, alpha=16, dropout 0.05)."""

    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class LearnerConfig(Strict):
    """How each agent's model is trained: one learner (policy, reference, optimizer) per agent."""

    finetune: Literal["lora", "full"] = "lora"
    # GPUs of each agent's learner: one ZeRO-2 group (cluster.learner_gpus overrides it per agent; see
    # m1/marl/placement_plan.py)
    gpus: int = Field(1, ge=1)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    lr: float | None = Field(None, gt=0.0)  # None: DEFAULT_LR[finetune]
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)  # None: no clipping
    warmup_steps: int = Field(0, ge=0)  # linear warm-up from lr/warmup_steps to lr
    # after warm-up: keep lr ("constant"), or decay it to 0 at the last step ("linear", TRL's default; "cosine")
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    micro_batch_size: int = Field(8, ge=1)  # samples per forward/backward; gradients accumulate over a step
    # a longer prompt is an error, never cut; the team's limits.max_prompt_tokens may not exceed it (training sets the
    # team's budget to it when the team has none, m1/team/budget.py)
    max_prompt_tokens: int = Field(1024, ge=1)
    max_completion_tokens: int = Field(1024, ge=1)  # longer completions are cut (the rest is not trained)
    # auto: bf16 autocast on CUDA, fp32 on CPU. Master weights stay fp32 (a 1e-7 step vanishes in bf16).
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    deepspeed: str | None = None  # path of a DeepSpeed JSON (configs/deepspeed/zero2.json); None: plain torch
    gradient_checkpointing: bool = False
    # Run each distinct prompt of a micro-batch once and reuse its key/value cache for its completions (GRPO's K
    # rollouts share a prompt); same log-probs and gradients as one joint pass. Off: the joint pass.
    share_prompt_forward: bool = True
    # A step's samples are sorted by length and cut into micro-batches of at most micro_batch_size rows and at most
    # this many padded tokens (distinct prompts x longest prompt + rows x longest completion; one longer row still
    # goes alone), so short plan prompts are not padded to long communicate ones. The losses are weighted against
    # the whole step, so any split gives the same gradient. None: count only. On CPU a tiny model is fastest near
    # one prompt per micro-batch (no padding: causal attention without a mask); on a GPU larger budgets pay.
    micro_batch_tokens: int | None = Field(16384, ge=1)
    # GRPO at beta 0: a sample with advantage 0 adds no gradient (its surrogate is 0 * ratio), so it is not run; the
    # step's loss weights still count it, so the gradient is unchanged. Per-token diagnostics (ratio_mean, clip_frac,
    # is/*, logp_gap) are then means over the tokens that were run. Off: every sample is run.
    skip_zero_advantage: bool = True
    # False: a cheaper, different estimator. The prompt (all but its last token) runs without gradient and its
    # key/value cache feeds the completion pass, so the gradient reaches the completion tokens' own activations but
    # not the prompt's keys and values. About 2.8x less update work on the mini team; chosen on dev
    # like any other setting.
    prompt_grad: bool = True
    # SFT only: also predict the prompt's tokens (frame descriptions, tool observations, the question), weighted
    # against the completion's per-token mean. A tiny student trained from scratch sees ~30 completion tokens per
    # example but ~800 prompt tokens, many of them repeats (an object seen on several frames), which is where copying
    # a phrase from the context is learnt. 0: completion-only loss, as TRL's default.
    prompt_loss: float = Field(0.0, ge=0.0)

    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.finetune]

    def lr_at(self, step: int, total_steps: int) -> float:
        """The lr of optimizer step `step` (0-based) of `total_steps`: warm-up, then `lr_schedule`.

        A decaying schedule ends near 0, so the weights a run ends on are not one noisy full-size step away from
        where the loss had settled (the seed-to-seed spread of small runs shrinks).
        """
        lr = self.learning_rate()
        warm = self.warmup_steps
        if warm and step < warm:
            return lr * (step + 1) / warm
        if self.lr_schedule == "constant" or total_steps <= warm:
            return lr
        frac = min(1.0, (step - warm) / max(1, total_steps - warm))  # 0 at the end of warm-up, 1 past the end
        if self.lr_schedule == "linear":
            return lr * (1.0 - frac)
        return lr * 0.5 * (1.0 + math.cos(math.pi * frac))


class DataConfig(Strict):
    questions: str | None = None  # questions.jsonl (m1 synth / benchmark loaders write this format)
    video_dir: str | None = None  # relative `video` fields are resolved against this folder
    shuffle: bool = True  # a new permutation every epoch, derived from `seed` and the epoch number


class RolloutConfig(Strict):
    """K team episodes per question over one random DAG per training step (agent dropout)."""

    num_generations: int = Field(4, ge=1)  # K
    questions_per_step: int = Field(8, ge=1)  # the paper's batch size
    # Episodes the team runs at once in rollout.engine hf (each learner generates for all of them in one batch).
    # auto: as many of the step's episodes as the KV cache fits in the memory the placement plan leaves on each
    # learner GPU (m1/marl/planner.py `rollout_batch`); a number: that many; None: the team's limits.batch_episodes.
    # With rollout.engine vllm the engine gets the whole step at once: auto is accepted there, a number is not.
    batch_episodes: PositiveInt | Literal["auto"] | None = None
    # Where the trained agents' rollouts are generated. hf: by each learner's own policy (Hugging Face generate).
    # vllm: by a vLLM server per trained agent (m1/models/vllm_server.py), weights synced after every update: M1
    # launches `engine_command` (default `vllm serve ...`) on the GPUs the plan gives each engine, or uses the servers
    # the user runs at `engine_url` (one URL when one agent is trained, else {agent: URL}). All episodes of a step go to
    # each engine at once
    engine: Literal["hf", "vllm"] = "hf"
    engine_url: str | dict[str, str] | None = None
    # argv of the server, with {model} {port} {lora_rank} {gpu_memory_utilization} filled in; None: vLLM's
    engine_command: list[str] | None = None
    engine_timeout_s: float = Field(600.0, gt=0.0)  # one request, then a clear error
    temperature: float = Field(1.0, gt=0.0)  # sampling temperature of every agent (unless an agent sets its own)
    topology: Literal["random", "complete"] = "random"
    edge_prob: float = Field(0.5, ge=0.0, le=1.0)
    dropout: float = Field(0.25, ge=0.0, lt=1.0)
    # episode (paper): every generation of an agent carries the advantage of its total reward. phase (ours): its
    # answers and summaries carry the advantage of the outcome (w_res * R_res + w_format * answer parsed +
    # w_team * team_res) alone, so the plan's judged quality and the other generations' format do not decide which
    # answer is reinforced. agent (ours, per-agent credit): question i of the run focuses trained agent i mod n; its
    # K episodes have that agent sampling and every teammate greedy, and only the focus agent's generations are
    # trained on, credited within those K (m1/marl/credit.py). Same episodes per step as episode credit; each agent
    # gets 1/n of the step's questions, so raise questions_per_step to keep its samples per step.
    credit: Literal["episode", "phase", "agent"] = "episode"
    # ours: the phases whose generations are trained on; the others still run and shape the episode, but carry no
    # gradient (e.g. [answer, summary]: learn to read the notes while plans and tool use stay as SFT left them).
    # A seed-kind team (weaver / zoomer / sage) writes `act` (a tool-calling turn) and `answer`; there the default
    # list means every turn, and a list of its own may name only act and answer
    train_phases: list[Literal["plan", "communicate", "answer", "summary", "act"]] = Field(
        default_factory=lambda: list(CPP_PHASES), min_length=1)
    # Dynamic sampling (DAPO): a group (an agent's K rollouts of a question) whose rewards all tie carries no GRPO
    # signal and is dropped; a question with no informative group left is replaced by the next questions of the data
    # cursor, for at most `max_refill` extra rounds per step (the step trains on fewer groups when they run out).
    dynamic_sampling: bool = False
    max_refill: int = Field(2, ge=0)
    # Asynchronous rollouts (m1/marl/producer.py): 0 = the synchronous step (rollouts, then the update). k > 0: a
    # producer thread runs step t's rollouts with the weights after update max(0, t - k) while the learners update
    # the steps before it, so sampling and updating overlap; every sample of step t is min(t, k) versions old and
    # the loss corrects for it with the sampler's log-probs (grpo.old_logprobs sampler, the default then, or rollout).
    # On the hf engine a copy of each learner's model samples (placement local only)
    max_staleness: int = Field(0, ge=0)


class GRPOSettings(Strict):
    """Loss numerics; see m1/marl/grpo.py for the formulas."""

    beta: float = Field(1e-5, ge=0.0)  # k3 KL weight; 0 skips the reference forward entirely
    clip_eps_low: float = Field(0.2, ge=0.0)
    clip_eps_high: float | None = Field(None, ge=0.0)
    loss_type: str = "grpo"  # a name registered in m1/marl/grpo.py LOSSES
    scale_rewards: bool = True  # divide by the group std (False: Dr. GRPO)
    # group: advantages relative to the K rollouts' mean (GRPO). greedy (ours, after ReMax): each question is also
    # run once greedily (not trained on) and a rollout's advantage is its reward minus the greedy run's, so a sample
    # gains only by beating the greedy decoding the team is evaluated with, and matching it earns nothing
    baseline: Literal["group", "greedy"] = "group"
    # policy: old = logp.detach() (one update per rollout batch, TRL's on-policy case);
    # rollout: old = the sampler's log-probs (use when generation may lag the weights);
    # sampler: old = logp.detach(), and each token's policy term is weighted by min(exp(logp - logp_sampler),
    # is_cap): the truncated importance weight correcting for an engine (vLLM) whose numerics differ from the
    # trainer's (TRL's vLLM correction). Logs <agent>/is/ratio_mean, is/ratio_max and is/truncated (token share).
    # Left out (None): `resolve` picks sampler with rollout.engine vllm (the engine/trainer gap is exactly what it
    # corrects), else policy; policy with engine vllm is refused, since it would train on the trainer's numbers as if
    # they were the sampler's. The modes are registered in m1/marl/grpo.py OLD_LOGPROBS
    old_logprobs: str | None = None
    is_cap: float = Field(2.0, gt=0.0)

    @field_validator("loss_type")
    @classmethod
    def _registered_loss(cls, v: str) -> str:
        if v not in LOSSES:
            raise ValueError(f"unknown loss_type {v!r}; registered: {sorted(LOSSES)}")
        return v

    @field_validator("old_logprobs")
    @classmethod
    def _registered_old_logprobs(cls, v: str | None) -> str | None:
        if v is not None and v not in OLD_LOGPROBS:
            raise ValueError(f"unknown old_logprobs {v!r}; registered: {sorted(OLD_LOGPROBS)}")
        return v


class JudgeConfig(Strict):
    """Judge of the collaboration reward: the offline rubric, an LLM (paper: GPT-4o), or none (w_col must be 0)."""

    kind: Literal["rubric", "llm", "none"] = "rubric"
    model: ModelSpec | None = None  # llm: e.g. {kind: chat, backend: openai, path: gpt-4o}
    cache_dir: str | None = None  # llm: verdict cache (default <out_dir>/judge_cache)
    rate_per_minute: float | None = Field(None, gt=0.0)
    # How plans and tool choices are judged (m1/marl/judge.py): cues (the tools must fit cues of the question, the
    # rule-based teacher's preferences), outcome (ours: any tools, judged on a well-formed plan that ran and produced
    # notes the answer follows) or none (ours: the plan's content is not judged). Both judges follow it
    plan_rubric: Literal["cues", "outcome", "none"] = "cues"

    @model_validator(mode="after")
    def _model_for_llm(self) -> JudgeConfig:
        if self.kind == "llm" and self.model is None:
            raise ValueError("judge.model: an llm judge needs a chat model spec")
        if self.model is not None and self.model.kind != "chat":
            raise ValueError(f"judge.model: must be a chat model, got kind {self.model.kind!r}")
        return self


TRACKERS = ("tensorboard", "mlflow", "wandb")  # log.backends (m1/marl/trackers.py)


class MlflowSettings(Strict):
    """`log.mlflow`: where the mlflow run goes."""

    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else the file store <out_dir>/mlruns
    experiment: str | None = None  # None: the run's name


class WandbSettings(Strict):
    """`log.wandb`: offline by default (these machines reach no server); `wandb sync` uploads the run later."""

    project: str | None = None  # None: the run's name
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"


class LogConfig(Strict):
    """Where a run's metrics go besides metrics.jsonl, and how often a step's episodes are written out.

    `tensorboard: true|false`, the key of earlier configs, is deprecated (a FutureWarning) and goes in M1 0.2.0:
    until then it adds or removes tensorboard from `backends`."""

    backends: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=lambda: ["tensorboard"])
    progress: bool = True  # tqdm bar
    # every this many steps, the step's episodes (prompts, completions, reward parts, advantages) and their trace
    # pages go to <out_dir>/samples/step-NNNNNN/ (m1/marl/samples.py); 0 or None: never
    samples_every: int | None = Field(None, ge=0)
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)
    wandb: WandbSettings = Field(default_factory=WandbSettings)

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
    every: int = Field(50, ge=1)  # steps between checkpoints (the last step is always saved)
    keep_last: int = Field(2, ge=1)
    resume: bool = True  # continue from the newest checkpoint in out_dir when there is one
    # latest: resume from the newest checkpoint and stop with an error naming the file when it is damaged (its
    # manifest does not match). previous: skip damaged ones and resume from the newest intact checkpoint (what
    # `--resume-from previous` sets)
    resume_from: Literal["latest", "previous"] = "latest"


class RayConfig(Strict):
    address: str | None = None  # None: start a local Ray; "auto": join a running cluster
    num_gpus_per_learner: float = Field(0.0, ge=0.0)
    num_cpus_per_learner: float = Field(0.0, ge=0.0)


class ClusterConfig(Strict):
    """`cluster:` of a MARL or SFT config: the GPUs the run is planned on and the margins of the estimate."""

    gpus_per_node: int = Field(8, ge=1)  # `--gpus N` means ceil(N / gpus_per_node) nodes
    gpu_mem_gb: float | None = Field(None, gt=0)  # memory of one GPU; None: --gpu-mem, else the local GPUs
    reserve_gb: float = Field(3.0, ge=0)  # per GPU, outside the formulas: CUDA context, NCCL, ZeRO buckets
    headroom: float = Field(0.1, ge=0, lt=1)  # share of each GPU left unplanned (allocator fragmentation, spikes)
    engine_gpus: int = Field(1, ge=1)  # GPUs of each launched rollout engine (rollout.engine vllm; tensor parallel)
    learner_gpus: dict[str, PositiveInt] = Field(default_factory=dict)  # agent -> GPUs; overrides learner.gpus
    driver_gpus: dict[str, PositiveInt] = Field(default_factory=dict)  # driver model key (or "judge") -> GPUs
    driver_headroom: float = Field(0.5, ge=0)  # activations + KV of an inference model, as a share of its weights
    cpus_per_gpu: int = Field(4, ge=0)  # CPUs in each Ray bundle

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


class TrainConfig(Strict):
    """One MARL run: a team, its questions, rollouts, rewards, GRPO and one learner per agent."""

    name: str = "marl"
    team: str | TeamConfig  # a configs/team name, a YAML path, or the team inline
    team_overrides: list[str] = Field(default_factory=list)  # dotted overrides applied to a named team
    # the SFT run (its out_dir) whose trained agents this run starts from: the paper's recipe is SFT, then MARL.
    # Its newest checkpoint (m1/marl/launch.py `seat_init`).
    init_from: str | None = None
    train_agents: list[str] | None = None  # None: every agent learns; others still act, frozen
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    grpo: GRPOSettings = Field(default_factory=GRPOSettings)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    steps: int = Field(200, ge=1)
    seed: int = 0
    out_dir: str = "runs/marl"
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    placement: Literal["local", "ray"] = "local"  # ray: one learner actor per agent
    ray: RayConfig = Field(default_factory=RayConfig)
    # the GPUs the run is planned on (`m1 train --plan`)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _checks(self) -> TrainConfig:
        team = self.team_config()
        names = [a.name for a in team.agents]
        for a in self.train_agents or []:
            if a not in names:
                raise ValueError(f"train_agents: no agent named {a!r} in team {team.name!r} (agents: {names})")
        if self.judge.kind == "none" and self.rewards.w_col != 0:
            raise ValueError(f"judge.kind is 'none' but rewards.w_col={self.rewards.w_col}; set w_col: 0")
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
        if self.grpo.loss_type == "dr_grpo" and self.learner.max_completion_tokens < 1:
            raise ValueError("grpo.loss_type dr_grpo needs learner.max_completion_tokens")
        _budget_check(team, self.learner)
        kind = team_kind(team)
        kind.check(self, team, trained)
        check_credit(self, kind)
        reward_kind(self.rewards, team)
        return self

    def team_config(self) -> TeamConfig:
        return _team(self.team, self.team_overrides)


class SFTDataConfig(Strict):
    """Where SFT examples come from: an existing JSONL, or a teacher team run over questions."""

    examples: str | None = None  # JSONL of SFT examples (written by `build`); read when it exists
    questions: str | None = None
    video_dir: str | None = None
    teacher: str | TeamConfig | None = None  # team producing the plans (rule-based teacher or an API team)
    teacher_overrides: list[str] = Field(default_factory=list)
    rollouts_per_question: int = Field(1, ge=1)  # sampled teams may produce different plans
    # ours: rollout r of an MCQ question shows its options rotated by r places (m1/marl/sft.py rotate_options),
    # so a deterministic teacher still yields new answers, under balanced letters, from the same questions
    rotate_options: bool = False
    # ours: also keep a plan its agent revised during the episode when that agent answered right (the paper drops
    # every changed plan); the revision itself is learnt from the communicate example
    keep_revised_plans: bool = False
    # a seed-kind teacher (weaver / zoomer / sage) writes act and answer turns: there the default means both, as
    # every turn of a right episode is an example
    phases: list[Literal["plan", "communicate", "answer", "summary", "act"]] = Field(default_factory=lambda: ["plan"])
    # all: every student agent learns every kept example; same_name: only examples of the agent with its name
    assign: Literal["all", "same_name"] = "all"
    # ours: keep at most N communicate examples per agent and question (over all its rollouts), the first ones: they
    # are mostly `continue()` and the longest prompts, so this is a data budget applied after the keep rule
    communicate_per_episode: int | None = Field(None, ge=0)
    # keep_rule: plans by the paper's rule (see keep_revised_plans); all: every plan the teacher wrote, whatever the
    # outcome (ours: with a teacher that plans at random, SFT then teaches the plan format, not which plan is good)
    plan_filter: Literal["keep_rule", "all"] = "keep_rule"
    # run the teacher in this many worker processes, each over whole videos; the teacher's choices depend only on
    # its prompt, so the concatenated examples are those of one process (not part of the data's identity)
    workers: int = Field(1, ge=1)


class SFTConfig(Strict):
    """Supervised fine-tuning of every agent of a team on kept teacher plans."""

    name: str = "sft"
    team: str | TeamConfig  # the student team
    team_overrides: list[str] = Field(default_factory=list)
    train_agents: list[str] | None = None
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    rewards: RewardConfig = Field(default_factory=lambda: RewardConfig(w_col=0.0))  # R_res decides "right"
    learner: LearnerConfig = Field(default_factory=lambda: LearnerConfig(lr=1e-6, finetune="full"))
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(8, ge=1)  # examples per optimizer step (per agent)
    max_steps: int | None = Field(None, ge=1)
    seed: int = 0
    out_dir: str = "runs/sft"
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    # ray: each student's learner is a group of Ray actors placed by the plan, as in MARL
    placement: Literal["local", "ray"] = "local"
    ray: RayConfig = Field(default_factory=RayConfig)
    # the GPUs the run is planned on (`m1 sft --plan`)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _checks(self) -> SFTConfig:
        names = [a.name for a in self.team_config().agents]
        for a in self.train_agents or []:
            if a not in names:
                raise ValueError(f"train_agents: no agent named {a!r} (agents: {names})")
        d = self.data
        if d.examples is None and (d.teacher is None or d.questions is None):
            raise ValueError("data: give `examples` (a JSONL) or both `teacher` and `questions` to build it")
        try:  # a teacher that does not load yet is reported where it is built, as before
            teacher = self.teacher_config()
        except (ConfigError, OSError):
            teacher = None
        kind = seed_kind(teacher) if teacher is not None else None
        if kind is not None:
            seed_phases(d.phases, "data.phases", kind, ["plan"])
        elif "act" in d.phases:
            raise ValueError("data.phases: 'act' is a seed-kind phase; the teacher is a CPP team")
        student = self.team_config()
        _budget_check(student, self.learner)
        if seed_kind(student) is not None:
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

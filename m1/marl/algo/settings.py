"""The `grpo` block of a MARL config: the policy objective, the advantage estimator, the reduction and the old
log-probs, each a name of its registry in this package, and the numbers they read. Each objective and estimator
states which of these settings it reads, requires and refuses (m1/marl/entries.py); the run's config checks the
choice against its entry (m1/marl/config.py TrainConfig)."""
from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from m1.config import PLANNING_PHASES, Strict
from m1.marl.algo.advantages import ESTIMATORS
from m1.marl.algo.objectives import OBJECTIVES
from m1.marl.algo.reductions import LOSSES, OLD_LOGPROBS


class GRPOSettings(Strict):
    """Loss numerics: a policy objective (m1/marl/algo/objectives.py), an advantage estimator
    (m1/marl/algo/advantages.py), the reduction and old log-probs (m1/marl/algo/reductions.py). Each objective and
    estimator states which of these settings it reads, requires and refuses; the config refuses a combination its entry
    refuses."""

    objective: str = Field(default="clip", description=(
        "The policy objective, a name registered in m1/marl/algo/objectives.py OBJECTIVES. clip: PPO's clipped ratio "
        "(clip_eps_low both ways, delta). clip_higher (DAPO): the upper bound 1 + clip_eps_high. gspo: one ratio "
        "per sequence, exp of its mean token log-ratio, clipped (needs loss_type grpo). cispo (MiniMax-M1): the "
        "importance weight capped at 1 + clip_eps_high, without gradient, times A log p (needs a token-level "
        "loss_type such as dapo). clip_cov, kl_cov (Cui et al. 2025): against entropy collapse, the few tokens whose "
        "log-prob and advantage covary most are set apart: clip_cov cuts their gradient from clip (cov_ratio, "
        "cov_bounds), kl_cov adds kl_cov_coef |logp - old| on them (cov_ratio; needs old_logprobs rollout)."))
    beta: float = Field(1e-5, ge=0.0, description="Weight of the k3 KL term; 0 skips the reference forward.")
    clip_eps_low: float = Field(0.2, ge=0.0, description=(
        "clip, clip_higher, gspo: the ratio is clipped below at 1 - this (clip: above at 1 + this too)."))
    clip_eps_high: float | None = Field(None, ge=0.0, description=(
        "clip_higher, gspo: the ratio is clipped above at 1 + this (gspo: None means clip_eps_low). cispo: the "
        "importance weight is capped at 1 + this."))
    delta: float | None = Field(None, gt=1.0, description=(
        "clip, clip_higher, gspo: cap on the unclipped ratio, so a negative advantage cannot be multiplied by an "
        "unbounded ratio (INTELLECT-2's two-sided clip, TRL's delta); None: no cap."))
    loss_type: str = Field(default="grpo", description=(
        "How per-token losses are reduced to one: a name registered in m1/marl/algo/reductions.py LOSSES."))
    scale_rewards: bool = Field(default=True, description="group: divide advantages by the group's std; False: Dr. "
                                                          "GRPO.")
    baseline: str = Field(default="group", description=(
        "The advantage estimator, a name registered in m1/marl/algo/advantages.py ESTIMATORS. group: advantages "
        "against the K rollouts' mean, scaled by their std with scale_rewards (GRPO). greedy (ours, after ReMax): each "
        "question is also run once greedily, untrained, and a rollout's advantage is its reward minus that run's, "
        "so a sample gains only by beating the decoding the team is evaluated with. rloo: a reward minus the mean "
        "of the group's other rewards (REINFORCE leave-one-out). greedy and rloo need scale_rewards: false. "
        "reinforce_pp (REINFORCE++, token level): each token's return is the reward discounted by gamma per token "
        "the agent generates after it in the episode, whitened over the step's tokens of the agent. gigpo (GiGPO's "
        "anchor-state groups): group's advantage plus step_weight times a reply's reward against the replies the "
        "question's other rollouts wrote from the same state (agent, phase, prompt), so a decision is compared "
        "where rollouts that reached one state chose differently."))
    step_weight: float = Field(1.0, ge=0.0, description=(
        "gigpo: the weight of the step (anchor-state) advantage beside the episode's (GiGPO's omega)."))
    gamma: float = Field(1.0, gt=0.0, le=1.0, description=(
        "reinforce_pp: the discount per generated token of the agent between a token and the end of its episode "
        "(its later replies count; tool outputs and teammates' text do not). 1: every token gets the reward."))
    old_logprobs: str | None = Field(default=None, description=(
        "The old policy of the ratio. policy: logp.detach() (TRL's on-policy case). rollout: the sampler's "
        "log-probs (generation may lag the weights). sampler: logp.detach(), each token weighted by "
        "min(exp(logp - logp_sampler), is_cap) to correct an engine whose numerics differ (TRL's vLLM correction). "
        "None: sampler with rollout.engine vllm or max_staleness > 0, else policy. The modes: "
        "m1/marl/algo/reductions.py OLD_LOGPROBS."))
    is_cap: float = Field(2.0, gt=0.0, description="sampler: cap on the truncated importance weight.")
    cov_ratio: float | None = Field(None, gt=0.0, le=1.0, description=(
        "clip_cov, kl_cov: the share of a micro-batch's loss tokens set apart (at least one); None: the paper's, "
        "2e-4 for clip_cov, 2e-3 for kl_cov."))
    cov_bounds: tuple[float, float] = Field((1.0, 5.0), description=(
        "clip_cov: the band of covariance, (A - mean A)(logp - mean logp), its tokens are drawn from."))
    kl_cov_coef: float = Field(1.0, ge=0.0, description="kl_cov: the weight of |logp - old| on the chosen tokens.")
    entropy_coef: float = Field(0.0, ge=0.0, description=(
        "Entropy bonus on the team's decisions (ours, against plans and revisions that collapse onto one choice): "
        "the loss gains -entropy_coef x the entropy of the tokens of the phases in entropy_phases, estimated from "
        "the sampled tokens as sg(log p) log p (in expectation its gradient is minus the entropy's), summed over "
        "those tokens and divided by the step's completion tokens, beside any objective. Samples of those phases "
        "are trained even when their advantage is 0. 0: off."))
    entropy_phases: tuple[str, ...] = Field(("plan", "communicate"), min_length=1, description=(
        "The phases whose tokens the entropy bonus reaches: plan (the first plan) and communicate (continue or "
        "add a tool) are the CPP team's decisions; answer, summary, and a seed kind's act turns may be added."))

    @field_validator("entropy_phases")
    @classmethod
    def _phases(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        known = (*PLANNING_PHASES, "act")
        if any(p not in known for p in v) or len(set(v)) != len(v):
            raise ValueError(f"entropy_phases: each once, from {list(known)}; got {list(v)}")
        return v

    @field_validator("objective", "baseline", "loss_type", "old_logprobs")
    @classmethod
    def _registered(cls, v: str | None, info: ValidationInfo) -> str | None:
        """Each of these settings names an entry of its registry (old_logprobs may stay None)."""
        table = {"objective": OBJECTIVES, "baseline": ESTIMATORS, "loss_type": LOSSES,
                 "old_logprobs": OLD_LOGPROBS}[info.field_name]
        if v is not None and v not in table:
            raise ValueError(f"unknown {info.field_name} {v!r}; registered: {sorted(table)}")
        return v

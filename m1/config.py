"""Team configs: pydantic models for the YAMLs in configs/ (reading and overrides: config_files.py).

A config is checked completely before any model loads: an unknown key, a wrong type or a name
that points nowhere is a ConfigError naming the file and the key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

from m1.config_files import load_config, resolve_config_path
from m1.registry import (CPP, PAPER_TOOLS, TOOL_NAMES, agent_kinds, is_seed, seed_kind, seed_kind_names,
                         vision_model_attrs)

# Recorded identities (a results file's team signature, cache keys) hold only the settings a config changes from
# their defaults, so a new setting with a default leaves every record valid. Bump this when a default changes what a
# team or run computes: every record made before then becomes stale at once.
CONFIG_VERSION = 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    # a field's earlier name -> its name: read from config files and checkpoints written before the rename. The field
    # keeps the earlier name as its serialization alias, so identities (recorded(), the experiment's stage hashes)
    # and every record stored under them stay the same
    RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _earlier_names(cls, data: Any) -> Any:
        if not (cls.RENAMED and isinstance(data, dict)):
            return data
        for old, new in cls.RENAMED.items():
            if old in data:
                if new in data:
                    raise ValueError(f"`{old}` is the earlier name of `{new}`: give `{new}` only")
                data = {(new if k == old else k): v for k, v in data.items()}
        return data

    def recorded(self) -> dict[str, Any]:
        """This config as identities record it: the fields that differ from their defaults, and CONFIG_VERSION."""
        return {"config_version": CONFIG_VERSION, **self.model_dump(mode="json", exclude_defaults=True, by_alias=True)}


class TinySpec(Strict):
    """A tiny random model built offline from a config (tests and smoke runs only)."""

    arch: Literal["qwen2", "qwen3", "qwen2_5_vl", "open_clip"] = Field(
        description="Architecture of the random model (its Hugging Face config class, or an open_clip model).")
    hidden_size: int = Field(default=64, description="Width of the hidden states.")
    layers: int = Field(default=2, description="Number of transformer layers.")
    heads: int = Field(default=4, description="Attention heads per layer.")
    kv_heads: int = Field(default=2, description="Key/value heads per layer (grouped-query attention).")
    intermediate_size: int | None = Field(default=None, description="Width of the MLP; None: twice hidden_size.")
    image_size: int = Field(default=64, description="open_clip only: side of the square input image in pixels.")
    seed: int = Field(default=0, description="Seed of the random weights.")
    corpus: Literal["default", "synth", "seed_kinds", "reading"] = Field(default="default", description=(
        "Text the tokenizer of a chat model is trained on (m1/models/tiny.py). default: a built-in text. synth: a "
        "teacher team's prompts and replies on M1-Synth, so the world's prompts are short token runs (the mini "
        "team). seed_kinds: synth plus the rule-based Weaver / VideoZoomer / SAGE chats. reading: the seed_kinds "
        "texts with the students' tokenizer (whole words, no multi-word phrases), so a word is one token wherever "
        "it appears."))
    init_std: float | None = Field(default=None, gt=0, description=(
        "Std of the initial weights. None: INIT_STD (0.2), which random test models need for varied output; "
        "students trained from scratch use 0.02 (STUDENT_INIT_STD)."))


class ModelSpec(Strict):
    """Where a model comes from and how to run it. One instance is shared by all its users."""

    RENAMED: ClassVar[dict[str, str]] = {"kind": "interface"}
    interface: Literal["chat", "vision", "clip", "team"] = Field(serialization_alias="kind", description=(
        "What the model answers as (`kind` before): a chat (text) model, a vision-language model, a CLIP embedder, "
        "or team: a whole M1 team "
        "served by `m1 serve`, used as one agent (backend openai, `path` its /v1/models id, `base_url` its URL, "
        "video_input video_url; m1/team/member.py)."))
    backend: Literal["hf", "vllm", "openai", "open_clip", "synth", "eagle"] = Field(default="hf", description=(
        "How the model runs. eagle: Eagle2.5 through its own remote code, as a vision tool only (m1/models/eagle.py)."))
    path: str | None = Field(default=None, description="Local folder or hub id (hf, vllm, eagle); the model name "
                                                       "(openai). `./x` is relative to the YAML file.")
    tiny: TinySpec | None = Field(default=None, description="Build a tiny random model instead of loading `path`.")
    adapter: str | None = Field(default=None, description=(
        "A peft LoRA adapter folder put on top of `path`/`tiny` (chat models, hf or vllm), as `m1 train` with "
        "learner.finetune lora saves it (<checkpoint>/agents/<agent>/adapter). hf merges it once at load; vllm "
        "serves it as a LoRA request."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight dtype; auto: bfloat16 on cuda, float32 on cpu.")
    device: str = Field(default="auto", description="Where the model runs; auto: cuda when available, else cpu.")
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] | None = Field(
        default=None, description="Attention kernel of an hf model; None: the library's default.")
    trust_remote_code: bool = Field(default=False, description=(
        "Run the model's own code from its hub folder (needed by e.g. nvidia/Eagle2.5-8B); off unless a config "
        "asks for it."))
    max_pixels: int | None = Field(default=None, description="Vision: cap on the pixels per frame given to the "
                                                             "processor.")
    max_batch_requests: PositiveInt | Literal["auto"] = Field(default="auto", description=(
        "hf / eagle vision: the most requests in one `generate` call; longer lists are answered in batches, in "
        "order. auto: what the placement plan fits on the model's GPU when the run has a plan that placed it, else "
        "DEFAULT_VISION_BATCH (m1/models/hf.py)."))
    prefix_cache_mb: int = Field(default=256, ge=0, description=(
        "hf chat models: megabytes of prompt keys and values kept between calls (m1/models/sampler.py), so a prompt "
        "runs only the tokens after its longest already-computed prefix (the K rollouts' shared plan prompt, a "
        "second communicate round); emptied whenever the weights change. 0: every prompt runs whole, through "
        "transformers' generate."))
    clip_name: str | None = Field(default=None, description="open_clip architecture, e.g. ViT-B-16.")
    pretrained: str | None = Field(default=None, description="open_clip pretrained tag or checkpoint path.")
    base_url: str | None = Field(default=None, description="openai: the server's URL.")
    api_key_env: str = Field(default="OPENAI_API_KEY", description=(
        "openai: the *name* of the environment variable holding the API key (never the key itself)."))
    concurrency: int = Field(default=8, description="openai: requests in flight at once.")
    timeout: float = Field(default=120.0, description="openai: seconds before a request is given up and retried.")
    max_retries: int = Field(default=5, description="openai: retries of a failed request before it is an error.")
    gpu_memory_utilization: float = Field(default=0.85, description="vllm: share of GPU memory the engine may take.")
    tensor_parallel_size: int = Field(default=1, description="vllm: GPUs the model is split over.")
    error_rate: float = Field(0.0, ge=0.0, le=1.0, description="synth teacher: share of deliberately poor plans.")
    plans: Literal["rules", "uniform"] = Field(default="rules", description=(
        "synth teacher: rules plans by the question's cues; uniform draws each plan uniformly from the valid "
        "select x browse pairs (key info still from the question), a teacher that answers well but plans at random "
        "(the weak-plan SFT start, docs/weak_plan.md)."))
    seed: int = Field(default=0, description="synth teacher: seed of its error draws.")
    video_input: Literal["frames", "video_url"] = Field(default="frames", description=(
        "openai vision: how a clip reaches the server. frames: one JPEG image_url part per frame, its time in a "
        "text part (any server). video_url: the clip as one mp4 video_url part at its own frame rate, timing kept "
        "(vLLM, SGLang)."))
    video_transport: Literal["data", "file"] = Field(default="data", description=(
        "With video_url: data inlines the mp4 as a base64 data URL; file writes it under `video_root` and sends a "
        "file:// URL, removing the file once the batch is answered."))
    video_root: str | None = Field(default=None, description=(
        "With video_transport file: a folder the server may read (e.g. vLLM's --allowed-local-media-path)."))

    @model_validator(mode="after")
    def _source(self) -> ModelSpec:
        if self.backend in ("hf", "vllm", "openai") and not (self.path or self.tiny):
            raise ValueError("needs `path` (a local folder or hub id) or `tiny`")
        if self.backend == "eagle":
            if self.interface != "vision" or not self.path or self.tiny is not None:
                raise ValueError("backend eagle loads a vision model from `path` (a hub id such as nvidia/Eagle2.5-8B "
                                 "or its folder); interface must be vision and `tiny` unset")
            if not self.trust_remote_code:
                raise ValueError("backend eagle runs the model's own code from its folder; set trust_remote_code: true")
        if self.backend == "open_clip" and not (self.clip_name or self.tiny):
            raise ValueError("needs `clip_name` (e.g. ViT-B-16) or `tiny`")
        if self.attn_implementation == "flash_attention_2" and self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"attn_implementation flash_attention_2 runs only on bfloat16/float16 weights; set "
                             f"dtype: bfloat16 (got dtype {self.dtype!r})")
        if self.max_batch_requests != "auto" and (self.interface != "vision" or self.backend not in ("hf", "eagle")):
            raise ValueError("`max_batch_requests` applies to vision models of backend hf or eagle, not a "
                             f"{self.interface} "
                             f"model of backend {self.backend!r}")
        if self.adapter is not None and (self.interface != "chat" or self.backend not in ("hf", "vllm")):
            raise ValueError(f"`adapter` applies to chat models of backend hf or vllm, not a {self.interface} model "
                             f"of backend {self.backend!r}")
        if self.interface == "team" and (self.backend != "openai" or not self.path or self.tiny is not None):
            raise ValueError("interface team is a served M1 team (`m1 serve`) asked over HTTP: backend openai, "
                             "`path` = "
                             "the team's model name (its /v1/models id), `base_url` = where it is served")
        if self.interface == "team" and self.video_input != "video_url":
            raise ValueError("interface team sends each question's whole video: set video_input: video_url "
                             "(video_transport: file sends a file:// URL the server reads under its "
                             "--allowed-media-root; data inlines the video file)")
        self._check_video()
        return self

    def _check_video(self) -> None:
        """video_url settings apply only to an openai vision or team model, and a vision model's file transport needs
        its folder."""
        if self.video_input == "video_url" and (self.interface not in ("vision", "team") or self.backend != "openai"):
            raise ValueError(f"video_input: video_url applies to a vision model of backend openai (or a team model), "
                             f"not a {self.interface} model of backend {self.backend!r}")
        if self.interface == "team":  # the question's own video is sent (its file:// URL or its bytes): nothing written
            if self.video_root is not None:
                raise ValueError("video_root: a team model sends each question's video where it lies; leave "
                                 "video_root unset (the server must read that path, or use video_transport: data)")
            return
        if self.video_input == "frames":
            for key, default in (("video_transport", "data"), ("video_root", None)):
                if getattr(self, key) != default:
                    raise ValueError(f"{key}: applies only with video_input: video_url (video_input is frames)")
        if self.video_transport == "file" and not self.video_root:
            raise ValueError("video_transport: file writes each clip under `video_root`, which is not set; set "
                             "video_root to a folder the server may read (vLLM: --allowed-local-media-path), or use "
                             "video_transport: data")
        if self.video_transport == "data" and self.video_root is not None:
            raise ValueError("video_root: is used only with video_transport: file (video_transport is data)")


class AgentSpec(Strict):
    name: str = Field(description="The agent's name (unique in the team).")
    model: str = Field(description="The key of its model in `models`.")
    temperature: float | None = Field(default=None, description="This agent's sampling temperature; None: "
                                                                "sampling.temperature.")
    kind: str = Field(default=CPP, description=(
        "cpp: a policy agent of the CPP engine (m1/team/cpp.py). weaver | zoomer | sage: a seed system's single "
        "policy in a multi-turn tool loop, a team of one (m1/team/single.py, m1/kinds). Other kinds: those "
        "registered in m1/team/engines_registry.py."))

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        """Checked against the registry, not a Literal, so that a kind registered elsewhere is accepted."""
        if v not in agent_kinds():
            raise ValueError(f"unknown agent kind {v!r} (known: {agent_kinds()})")
        return v


class ToolsConfig(Strict):
    """The eight tools with the paper's parameters; `enabled` lists what agents may plan with."""

    enabled: list[str] = Field(default_factory=lambda: list(PAPER_TOOLS), description=(
        "The tools agents may plan with; at least one select tool and one browse tool."))
    clip: str | None = Field(default=None, description="Model key of the CLIP embedder (Video / Image Retrieval).")
    clip_cache_dir: str | None = Field(default=None, description=(
        "Keep CLIP frame embeddings on disk here, keyed by video hash and model; None: in memory only."))
    browser: str | None = Field(default=None, description="Model key of the Rough / Fine Browser's vision model.")
    space: str | None = Field(default=None, description="Model key of the Space Tool's vision model; None: browser.")
    grounding: str | None = Field(default=None, description="Model key of the Grounding Tool's vision model; None: "
                                                            "browser.")
    global_frames: int = Field(default=16, description="Global Sampling: frames taken uniformly over the video.")
    retrieval_clips: int = Field(default=6, description="Video Retrieval: equal clips the video is split into and "
                                                        "scored against the key info.")
    retrieval_frames: int = Field(default=16, description="Video Retrieval: frames sampled over the kept clip(s).")
    adjacent_threshold: float | None = Field(default=None, description=(
        "Video Retrieval: also keep neighbouring clips scoring above this (the paper's Charades setting: 0.35); "
        "None: the best clip alone."))
    max_adjacent_clips: int = Field(default=3, description="Video Retrieval: most consecutive clips kept in all.")
    timestamp_window: float = Field(default=60.0, description="Time Stamp Retrieval: seconds of video centred on the "
                                                              "stated time.")
    timestamp_frames: int = Field(default=16, description="Time Stamp Retrieval: frames sampled in that window.")
    image_fps: float = Field(default=2.0, description="Image Retrieval: rate at which candidate frames are scored.")
    image_top_k: int = Field(default=16, description="Image Retrieval: best-scoring frames kept.")
    rough_frames: int = Field(default=16, description="Rough Browser: frames it reads from the focus.")
    rough_tokens: int = Field(default=128, description="Rough Browser: new tokens of its description.")
    fine_frames: int = Field(default=32, description="Fine Browser: frames it reads over the focused span.")
    fine_tokens: int = Field(default=256, description="Fine Browser: new tokens of its description.")
    space_frames: int = Field(default=16, description="Space Tool: frames it reads over the focused span.")
    space_tokens: int = Field(default=256, description="Space Tool: new tokens of its answer.")
    grounding_fps: float = Field(default=2.0, description="Grounding Tool: frame rate over the focused span.")
    grounding_max_frames: int = Field(default=32, description="Grounding Tool: cap on the frames it reads.")
    grounding_tokens: int = Field(default=64, description="Grounding Tool: new tokens of its answer.")


class SeedSystemConfig(Strict):
    """The tool loop of a seed-kind agent (weaver / zoomer / sage). Unset fields take the kind's paper settings, written
    in its module (m1/kinds/weaver.py, ...): glance 128 / 64 / 128 frames, 10 / 5 / 11 turns, tool clips at 1 fps."""

    tools: list[str] | None = Field(default=None, description=(
        "The kind's tools the policy may call; None: all of them, []: answer from the glance alone."))
    glance_frames: int | None = Field(None, ge=1, description="Frames taken uniformly for the first user turn; "
                                                              "None: the kind's (its module in m1/kinds).")
    max_turns: int | None = Field(None, ge=1, description="Policy turns, the answer turn included; None: the kind's.")
    tool_fps: float | None = Field(None, gt=0, description="Frames per second inside a clip a tool returns; None: "
                                                           "the kind's.")
    max_tool_frames: int = Field(64, ge=1, description="Cap on the frames one tool result adds (ours: the papers "
                                                       "set none).")
    zoom_frames: int = Field(16, ge=1, description="zoomer: (end - start) * fps may not exceed this (VideoZoomer's "
                                                   "B = 16).")
    count_clips: int = Field(8, ge=1, description="weaver temporal_count: equal clips judged one by one (ours).")
    reply_tokens: int = Field(512, ge=1, description="New tokens per policy turn.")
    captioner: str | None = Field(default=None, description=(
        "Ours: the key of a vision model of the team that describes every frame put before the policy in words, so a "
        "text policy reads `<frame k at t s>[description]` where a vision policy sees the image. None: a text policy "
        "reads `[frame at t s]` alone."))
    caption_tokens: int = Field(48, ge=1, description="New tokens of one frame's description.")


class TopologyConfig(Strict):
    """Inference uses the complete graph; training samples a random DAG each step."""

    mode: Literal["complete", "random"] = Field(default="complete", description=(
        "complete: every agent reads every earlier one; random: a random DAG per question (edge_prob, dropout)."))
    edge_prob: float = Field(1.0, ge=0.0, le=1.0, description="random: chance each forward edge is kept.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="random: chance each agent sits out (one always stays).")
    seed: int = Field(default=0, description="Seed of the random DAGs.")


AggMode = Literal["vote", "summarizer", "best_score", "decide_by_agent", "median"]


class AggregationConfig(Strict):
    mcq: AggMode = Field(default="vote", description="How the agents' answers to a multiple-choice question become "
                                                     "the team's (m1/team/aggregate.py).")
    numeric: AggMode = Field(default="vote", description="The same for a numeric question.")
    open: AggMode = Field(default="summarizer", description="The same for an open-ended question.")
    grounding: AggMode = Field(default="summarizer", description=(
        "The same for a temporal grounding question; `median` (grounding only) takes the median start and end of "
        "the agents' spans, with no summary call."))
    summarizer: str | None = Field(default=None, description="The agent that writes summaries; None: the first "
                                                             "agent that is not a served team.")
    decider: str | None = Field(default=None, description="The agent whose answer decide_by_agent takes; None: the "
                                                          "first agent.")

    @model_validator(mode="after")
    def _median_spans_only(self) -> AggregationConfig:
        for task in ("mcq", "numeric", "open"):
            if getattr(self, task) == "median":
                raise ValueError(f"aggregation.{task}: 'median' takes the median of time spans, for grounding only; "
                                 f"use vote, summarizer, best_score or decide_by_agent")
        return self


class LimitsConfig(Strict):
    max_turns: int = Field(5, ge=1, description="Execute / communicate rounds of an episode before the answer.")
    max_tool_calls: int = Field(5, ge=1, description="Tool calls one agent may make in an episode.")
    plan_tokens: int = Field(default=256, description="New tokens of a plan.")
    comm_tokens: int = Field(default=128, description="New tokens of a communicate turn.")
    answer_tokens: int = Field(default=256, description="New tokens of an answer.")
    summary_tokens: int = Field(default=256, description="New tokens of the summary.")
    batch_episodes: int = Field(8, ge=1, description="Episodes (questions) run together as one batch.")
    frame_cache_mb: int = Field(4096, ge=16, description="Decoded frames kept in memory (LRU), shared by all agents "
                                                         "and episodes.")
    max_open_videos: int = Field(64, ge=1, description=(
        "Videos held open at once (one file handle and a decoder each); the least recently used are closed and "
        "opened again when next read, so a long `m1 serve` over ever new files keeps its handles and memory "
        "bounded. Keep it well under `ulimit -n`."))
    max_prompt_tokens: int | None = Field(None, ge=1, description=(
        "Prompt budget of every agent call in the agent's own tokens (m1/team/budget.py): over it, peers' notes are "
        "trimmed oldest first, and a prompt that still does not fit follows over_budget. None: no budget (training "
        "then uses learner.max_prompt_tokens)."))
    over_budget: Literal["error", "drop"] = Field(default="error", description=(
        "A prompt over max_prompt_tokens after trimming: error stops, drop ends that question's episode."))


PLANNING_PHASES = ("plan", "communicate", "answer", "summary")  # a CPP agent's calls, each known before it is made


class SamplingConfig(Strict):
    temperature: float = Field(default=0.0, description="Sampling temperature of every agent; 0: greedy.")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass.")
    seed: int = Field(default=0, description="First sampling seed; each call draws the next.")
    phase_temperature: dict[str, float] = Field(default_factory=dict, description=(
        "Ours: a temperature per CPP phase (plan, communicate, answer, summary) over every agent's own, e.g. "
        "{communicate: 1.5}: MARL rollouts then explore the revise-or-continue decision while plans and answers "
        "sample as before (a group whose K rollouts all make one decision gives GRPO no contrast on it). An "
        "episode's own temperature (credit: agent's greedy teammates) still wins; `greedy()` clears it; training "
        "scores each generation at the temperature it was sampled at."))
    distinct_plans: int = Field(default=0, ge=0, description=(
        "Ours, for MARL's groups (rollout.distinct_plans sets it): n > 1 makes the episodes of one question start "
        "from distinct plans. Each agent sampling above temperature 0 draws n plans per episode of the question, "
        "and the episodes take them in turn, each the next draw whose tools no earlier one took: the tool lists are "
        "sampled without replacement from the agent's own distribution (a plan repeats only when fewer distinct "
        "ones were drawn). The episodes of a question must share a batch (limits.batch_episodes). 0 or 1: off."))
    plan_fill: Literal["repeat", "uniform", "shared"] = Field(default="repeat", description=(
        "Ours, with distinct_plans: what an episode of the group starts from when the draws held fewer distinct "
        "plans than the group has episodes. repeat: the earliest draws again (every plan is the policy's own draw). "
        "uniform: a select x browse plan of the agent's enabled tools that no episode of the group took, drawn "
        "uniformly and written after the key info the agent wrote; it reaches plans the policy gives too little "
        "mass to be drawn at all (docs/experiments/decision_space.md: the students' better order plan, 2% a draw "
        "or less). shared: the same, in one uniform order of the plans per question for every agent, so where the "
        "agents' own draws agree a filled episode gives every seat one plan (a plan the team tries together). A "
        "filled plan's tokens carry no sampler log-probs: training scores them as the policy's "
        "(grpo.old_logprobs: policy)."))

    @field_validator("phase_temperature")
    @classmethod
    def _phases(cls, v: dict[str, float]) -> dict[str, float]:
        for phase, t in v.items():
            if phase not in PLANNING_PHASES:
                raise ValueError(f"phase {phase!r} is not one of {', '.join(PLANNING_PHASES)} (a seed-kind turn is "
                                 f"act or answer only once written)")
            if not t > 0:
                raise ValueError(f"phase {phase!r}: temperature {t} must be above 0")
        return v


class TeamConfig(Strict):
    name: str = Field(description="The team's name.")
    models: dict[str, ModelSpec] = Field(description="The models the team uses, by key.")
    agents: list[AgentSpec] = Field(description="The agents in order (the first is taken as the strongest).")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="The tools and their parameters.")
    topology: TopologyConfig = Field(default_factory=TopologyConfig, description="Who reads whose notes.")
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig,
                                           description="How the agents' answers become the team's.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Turns, tool calls, tokens and batching.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Decoding of every agent.")
    seed_system: SeedSystemConfig | None = Field(default=None, description="The loop of a weaver / zoomer / sage "
                                                                           "agent.")

    @model_validator(mode="after")
    def _phase_temperatures(self) -> TeamConfig:
        seeds = [a.name for a in self.agents if is_seed(a.kind)]
        if self.sampling.phase_temperature and seeds:
            raise ValueError(f"sampling.phase_temperature: agent {seeds[0]!r} is a seed kind, whose turn is act or "
                             f"answer only once written; set sampling.temperature instead")
        if self.sampling.distinct_plans > 1 and seeds:
            raise ValueError(f"sampling.distinct_plans: agent {seeds[0]!r} is a seed kind, which writes no plan")
        if self.sampling.plan_fill != "repeat" and self.sampling.distinct_plans <= 1:
            raise ValueError(f"sampling.plan_fill: {self.sampling.plan_fill!r} fills a group of distinct plans; set "
                             f"sampling.distinct_plans (rollout.distinct_plans) above 1")
        return self

    @model_validator(mode="after")
    def _references(self) -> TeamConfig:
        names = [a.name for a in self.agents]
        if not names:
            raise ValueError("agents: at least one agent is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"agents: names must be unique, got {names}")
        self._check_kinds()
        for i, a in enumerate(self.agents):
            if not is_seed(a.kind):
                spec = self.models.get(a.model)
                if spec is None or spec.interface != "team":  # a team model: a served M1 team as one agent
                    self._need(f"agents.{i}.model", a.model, "chat")
            else:  # a seed system's policy: a vision-language model, or a chat model that reads frames as text
                spec = self.models.get(a.model)
                if spec is None:
                    raise ValueError(f"agents.{i}.model: no model named {a.model!r} (models: {list(self.models)})")
                if spec.interface not in ("chat", "vision"):
                    raise ValueError(f"agents.{i}.model: model {a.model!r} is a {spec.interface} model; a {a.kind} "
                                     f"policy needs a chat or vision model")
        for key in ("clip", *vision_model_attrs()):
            ref = getattr(self.tools, key)
            if ref is not None:
                self._need(f"tools.{key}", ref, "clip" if key == "clip" else "vision")
        for key in ("summarizer", "decider"):
            ref = getattr(self.aggregation, key)
            if ref is not None and ref not in names:
                raise ValueError(f"aggregation.{key}: no agent named {ref!r} (agents: {names})")
        if self.aggregation.summarizer in self.served_teams:
            raise ValueError(f"aggregation.summarizer: agent {self.aggregation.summarizer!r} is a served team (model "
                             f"interface team), which answers questions but writes no summaries; name an agent of a "
                             f"chat model")
        for t in self.tools.enabled:
            if t not in TOOL_NAMES:
                raise ValueError(f"tools.enabled: unknown tool {t!r} (known: {list(TOOL_NAMES)})")
        groups = {TOOL_NAMES[t] for t in self.tools.enabled}
        if groups != {"select", "browse"}:
            raise ValueError("tools.enabled: a plan needs at least one select tool and one browse tool, "
                             f"got {self.tools.enabled}")
        return self

    def _check_kinds(self) -> None:
        """A seed-system agent runs alone; its `seed_system.tools` must be tools of its kind."""
        seeded = [(i, a) for i, a in enumerate(self.agents) if is_seed(a.kind)]
        if not seeded:
            if self.seed_system is not None:
                raise ValueError(f"seed_system: applies to agents of a seed kind ({', '.join(seed_kind_names())}); "
                                 f"every agent here is kind {CPP}")
            kinds = list(dict.fromkeys(a.kind for a in self.agents))
            if len(kinds) > 1:  # the team's kind picks its engine (m1/team/engines_registry.py)
                raise ValueError(f"agents: a team's agents share one kind, got {kinds}")
            return
        if len(self.agents) != 1:
            i, a = seeded[0]
            raise ValueError(f"agents.{i}.kind: a {a.kind!r} agent runs alone (a team of one), but the team has "
                             f"{len(self.agents)} agents")
        kind = seeded[0][1].kind
        if self.seed_system is not None and self.seed_system.captioner is not None:
            self._need("seed_system.captioner", self.seed_system.captioner, "vision")
        spec = seed_kind(kind)
        known = spec.tools
        for t in (self.seed_system.tools or []) if self.seed_system else []:
            if t not in known:
                why = f" ({spec.unavailable[t]})" if t in spec.unavailable else ""
                raise ValueError(f"seed_system.tools: {t!r} is not a {kind} tool{why} (known: {list(known)})")

    def _need(self, where: str, ref: str, interface: str) -> None:
        spec = self.models.get(ref)
        if spec is None:
            raise ValueError(f"{where}: no model named {ref!r} (models: {list(self.models)})")
        if spec.interface != interface:
            raise ValueError(f"{where}: model {ref!r} is a {spec.interface} model, {interface} needed")

    def greedy(self) -> "TeamConfig":
        """This team decoding greedily (temperature 0 for every agent): how teams are evaluated, and the baseline
        run of `grpo.baseline: greedy`."""
        return self.model_copy(update={"sampling": self.sampling.model_copy(update={"temperature": 0.0,
                                                                                   "phase_temperature": {},
                                                                                   "distinct_plans": 0,
                                                                                   "plan_fill": "repeat"}),
                                       "agents": [a.model_copy(update={"temperature": None}) for a in self.agents]})

    @property
    def served_teams(self) -> list[str]:
        """The agents whose model is a served M1 team (`interface: team`, m1/team/member.py)."""
        return [a.name for a in self.agents if a.model in self.models and self.models[a.model].interface == "team"]

    @property
    def summarizer(self) -> str:
        """aggregation.summarizer, else the first agent that is not a served team (else the first agent: a team of
        served teams only, whose engine falls back to the vote rule)."""
        local = [a.name for a in self.agents if a.name not in self.served_teams]
        return self.aggregation.summarizer or (local or [self.agents[0].name])[0]


def load_team(path: str | Path, overrides: list[str] | None = None) -> TeamConfig:
    """A team config; a model `path`, `adapter` or `video_root` written as `./x` or `../x` is taken relative to the
    YAML file's folder (so a config can name weights shipped beside it wherever the command runs), any other path as
    given."""
    cfg = load_config(TeamConfig, path, overrides, "team")
    folder = resolve_config_path(path, "team").parent
    models = {}
    for key, spec in cfg.models.items():
        for field in ("path", "adapter", "video_root"):
            value = getattr(spec, field)
            if value and value.startswith(("./", "../")):
                spec = spec.model_copy(update={field: str((folder / value).resolve())})
        models[key] = spec
    return cfg.model_copy(update={"models": models})

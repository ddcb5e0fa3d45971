"""Team configs: pydantic models for the YAMLs in configs/, loading and dotted overrides.

A config is checked completely before any model loads: an unknown key, a wrong type or a name
that points nowhere is a ConfigError naming the file and the key.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from m1.registry import DEFAULTS, SAGE_UNAVAILABLE, TOOL_NAMES

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # the repository's configs/ (a link), or the wheel's copy


class ConfigError(ValueError):
    pass


# Recorded identities (a results file's team signature, cache keys) hold only the settings a config changes from
# their defaults, so a new setting with a default leaves every record valid. Bump this when a default changes what a
# team or run computes: every record made before then becomes stale at once.
CONFIG_VERSION = 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    def recorded(self) -> dict[str, Any]:
        """This config as identities record it: the fields that differ from their defaults, and CONFIG_VERSION."""
        return {"config_version": CONFIG_VERSION, **self.model_dump(mode="json", exclude_defaults=True)}


class TinySpec(Strict):
    """A tiny random model built offline from a config (tests and smoke runs only)."""

    arch: Literal["qwen2", "qwen3", "qwen2_5_vl", "open_clip"]
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int | None = None
    image_size: int = 64  # open_clip only
    seed: int = 0
    # Tokenizer corpus (chat models): "default" = a built-in text; "synth" = the prompts and replies of a
    # teacher-team run on M1-Synth, so the world's prompts become short token runs (the mini team).
    # "seed_kinds" = that run plus the rule-based Weaver / VideoZoomer / SAGE chats (their mini policies).
    # m1/models/tiny.py builds them.
    # "reading" = the seed_kinds texts with the students' tokenizer (m1/models/tiny.py `reading_tokenizer`): whole
    # words, no multi-word phrases, so a word is the same token in a question, an option, a caption and a note.
    corpus: Literal["default", "synth", "seed_kinds", "reading"] = "default"
    # the weights' init std; None = INIT_STD (0.2), which random test models need for varied outputs. Students
    # trained from scratch use the usual 0.02 (STUDENT_INIT_STD).
    init_std: float | None = Field(default=None, gt=0)


class ModelSpec(Strict):
    """Where a model comes from and how to run it. One instance is shared by all its users."""

    # team: a whole M1 team behind `m1 serve`, one agent of this team (m1/team/member.py): backend openai, `path` =
    # the served team's model name (its /v1/models id), `base_url` = its URL, video_input: video_url
    kind: Literal["chat", "vision", "clip", "team"]
    # eagle: Eagle2.5 through its own remote code (m1/models/eagle.py), a vision tool only
    backend: Literal["hf", "vllm", "openai", "open_clip", "synth", "eagle"] = "hf"
    path: str | None = None  # local folder or hub id (hf, vllm); model name (openai)
    tiny: TinySpec | None = None  # build a tiny random model instead of loading `path`
    # a peft LoRA adapter folder applied on top of `path`/`tiny` (chat, hf or vllm): what `m1 train` with
    # `learner.finetune: lora` saves as <checkpoint>/agents/<agent>/adapter. hf merges it into the weights once
    # at load; vllm serves it as a LoRA request
    adapter: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] | None = None
    # run the model's own code from its hub folder (needed by e.g. nvidia/Eagle2.5-8B); off unless a config says so.
    trust_remote_code: bool = False
    max_pixels: int | None = None  # vision: cap on pixels per frame given to the processor
    # hf / eagle vision: most requests in one `generate` call; a longer list is answered in batches of this many, in
    # order. auto: the placement plan's number (what fits the model's GPU after its weights) when the run has a plan
    # that placed it, else DEFAULT_VISION_BATCH (m1/models/hf.py)
    max_batch_requests: PositiveInt | Literal["auto"] = "auto"
    clip_name: str | None = None  # open_clip architecture, e.g. ViT-B-16
    pretrained: str | None = None  # open_clip pretrained tag or checkpoint path
    base_url: str | None = None  # openai
    api_key_env: str = "OPENAI_API_KEY"  # openai: the *name* of the variable holding the key
    concurrency: int = 8
    timeout: float = 120.0
    max_retries: int = 5
    gpu_memory_utilization: float = 0.85  # vllm
    tensor_parallel_size: int = 1  # vllm
    error_rate: float = Field(0.0, ge=0.0, le=1.0)  # synth teacher: share of deliberately poor plans
    # synth teacher: `uniform` draws every plan uniformly from the valid select x browse pairs (key info still from
    # the question): a teacher that answers well but plans at random, the weak-plan SFT start of docs/weak_plan.md
    plans: Literal["rules", "uniform"] = "rules"
    seed: int = 0  # synth teacher: seeds its error draws
    # openai vision: how a clip reaches the server. `frames`: one JPEG image_url part per frame, its time in a text
    # part (any server). `video_url`: the clip as one mp4 video_url part at its own frame rate, timing kept (vLLM,
    # SGLang). For video_url, `video_transport: data` inlines the mp4 as a base64 data URL; `file` writes it under
    # `video_root` (a folder the server reads, e.g. vLLM's --allowed-local-media-path) and sends a file:// URL, the
    # file removed once the batch is answered
    video_input: Literal["frames", "video_url"] = "frames"
    video_transport: Literal["data", "file"] = "data"
    video_root: str | None = None

    @model_validator(mode="after")
    def _source(self) -> ModelSpec:
        if self.backend in ("hf", "vllm", "openai") and not (self.path or self.tiny):
            raise ValueError("needs `path` (a local folder or hub id) or `tiny`")
        if self.backend == "eagle":
            if self.kind != "vision" or not self.path or self.tiny is not None:
                raise ValueError("backend eagle loads a vision model from `path` (a hub id such as nvidia/Eagle2.5-8B "
                                 "or its folder); kind must be vision and `tiny` unset")
            if not self.trust_remote_code:
                raise ValueError("backend eagle runs the model's own code from its folder; set trust_remote_code: true")
        if self.backend == "open_clip" and not (self.clip_name or self.tiny):
            raise ValueError("needs `clip_name` (e.g. ViT-B-16) or `tiny`")
        if self.attn_implementation == "flash_attention_2" and self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"attn_implementation flash_attention_2 runs only on bfloat16/float16 weights; set "
                             f"dtype: bfloat16 (got dtype {self.dtype!r})")
        if self.max_batch_requests != "auto" and (self.kind != "vision" or self.backend not in ("hf", "eagle")):
            raise ValueError(f"`max_batch_requests` applies to vision models of backend hf or eagle, not a {self.kind} "
                             f"model of backend {self.backend!r}")
        if self.adapter is not None and (self.kind != "chat" or self.backend not in ("hf", "vllm")):
            raise ValueError(f"`adapter` applies to chat models of backend hf or vllm, not a {self.kind} model "
                             f"of backend {self.backend!r}")
        if self.kind == "team" and (self.backend != "openai" or not self.path or self.tiny is not None):
            raise ValueError("kind team is a served M1 team (`m1 serve`) asked over HTTP: backend openai, `path` = "
                             "the team's model name (its /v1/models id), `base_url` = where it is served")
        if self.kind == "team" and self.video_input != "video_url":
            raise ValueError("kind team sends each question's whole video: set video_input: video_url "
                             "(video_transport: file sends a file:// URL the server reads under its "
                             "--allowed-media-root; data inlines the video file)")
        self._check_video()
        return self

    def _check_video(self) -> None:
        """video_url settings apply only to an openai vision or team model, and a vision model's file transport needs
        its folder."""
        if self.video_input == "video_url" and (self.kind not in ("vision", "team") or self.backend != "openai"):
            raise ValueError(f"video_input: video_url applies to a vision model of backend openai (or a team model), "
                             f"not a {self.kind} model of backend {self.backend!r}")
        if self.kind == "team":  # the question's own video is sent (its file:// URL or its bytes): nothing written
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


AgentKind = Literal["cpp", "weaver", "zoomer", "sage"]


class AgentSpec(Strict):
    name: str
    model: str  # key in TeamConfig.models
    temperature: float | None = None  # overrides sampling.temperature for this agent
    # cpp: a policy agent of the CPP engine (m1/team/cpp.py). weaver | zoomer | sage: a seed system's single VLM
    # policy in a multi-turn tool loop (m1/team/single.py, m1/kinds), a team of one
    kind: AgentKind = "cpp"


class ToolsConfig(Strict):
    """The eight tools with the paper's parameters; `enabled` lists what agents may plan with."""

    enabled: list[str] = Field(default_factory=lambda: [
        "Global Sampling", "Video Retrieval", "Time Stamp Retrieval", "Image Retrieval",
        "Rough Browser", "Fine Browser", "Space Tool", "Grounding Tool"])
    clip: str | None = None  # model key of the CLIP embedder
    clip_cache_dir: str | None = None  # keep CLIP frame embeddings on disk (keyed by video hash + model)
    browser: str | None = None  # model key of the Rough/Fine Browser VLM
    space: str | None = None  # model key of the Space Tool VLM (defaults to browser)
    grounding: str | None = None  # model key of the Grounding Tool VLM (defaults to browser)
    global_frames: int = 16
    retrieval_clips: int = 6
    retrieval_frames: int = 16
    adjacent_threshold: float | None = None  # Charades setting: 0.35
    max_adjacent_clips: int = 3
    timestamp_window: float = 60.0
    timestamp_frames: int = 16
    image_fps: float = 2.0
    image_top_k: int = 16
    rough_frames: int = 16
    rough_tokens: int = 128
    fine_frames: int = 32
    fine_tokens: int = 256
    space_frames: int = 16
    space_tokens: int = 256
    grounding_fps: float = 2.0
    grounding_max_frames: int = 32
    grounding_tokens: int = 64


class SeedSystemConfig(Strict):
    """The tool loop of a weaver / zoomer / sage agent. Unset fields take the kind's paper settings
    (m1/registry.py): glance 128 / 64 / 128 frames, 10 / 5 / 11 turns, tool clips at 1 fps."""

    tools: list[str] | None = None  # the kind's tools the policy may call (None: all; []: answer from the glance)
    glance_frames: int | None = Field(None, ge=1)  # uniform frames in the first user turn
    max_turns: int | None = Field(None, ge=1)  # policy turns, the answer turn included
    tool_fps: float | None = Field(None, gt=0)  # frames per second inside a clip a tool returns
    max_tool_frames: int = Field(64, ge=1)  # cap on the frames one tool result adds (ours: the papers set none)
    zoom_frames: int = Field(16, ge=1)  # zoomer: (end - start) * fps may not exceed this (VideoZoomer's B = 16)
    count_clips: int = Field(8, ge=1)  # weaver temporal_count: equal clips judged one by one (ours)
    reply_tokens: int = Field(512, ge=1)  # new tokens per policy turn
    # ours: a vision model of the team (its key) that describes, in words, every frame put before the policy. A text
    # policy reads `<frame k at t s>[description]` where a vision-language policy sees the image: how a text policy
    # perceives the video. None: a text policy reads `[frame at t s]` alone
    captioner: str | None = None
    caption_tokens: int = Field(48, ge=1)  # new tokens of one frame's description


class TopologyConfig(Strict):
    """Inference uses the complete graph; training samples a random DAG each step."""

    mode: Literal["complete", "random"] = "complete"
    edge_prob: float = Field(1.0, ge=0.0, le=1.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = 0


AggMode = Literal["vote", "summarizer", "best_score", "decide_by_agent"]


class AggregationConfig(Strict):
    mcq: AggMode = "vote"
    numeric: AggMode = "vote"
    open: AggMode = "summarizer"
    grounding: AggMode = "summarizer"
    summarizer: str | None = None  # agent name; default: the first agent (the strongest)
    decider: str | None = None  # agent name for decide_by_agent; default: the first agent


class LimitsConfig(Strict):
    max_turns: int = Field(5, ge=1)
    max_tool_calls: int = Field(5, ge=1)
    plan_tokens: int = 256
    comm_tokens: int = 128
    answer_tokens: int = 256
    summary_tokens: int = 256
    batch_episodes: int = Field(8, ge=1)
    frame_cache_mb: int = Field(4096, ge=16)  # decoded frames shared by all agents/episodes (LRU)
    # the prompt budget of every agent call, in the agent's own tokens (m1/team/budget.py): over it, the peers' notes
    # are trimmed oldest first; a prompt that still does not fit is an error, or with `over_budget: drop` ends that
    # question's episode. None: no budget (training then uses learner.max_prompt_tokens)
    max_prompt_tokens: int | None = Field(None, ge=1)
    over_budget: Literal["error", "drop"] = "error"


class SamplingConfig(Strict):
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


class TeamConfig(Strict):
    name: str
    models: dict[str, ModelSpec]
    agents: list[AgentSpec]
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    # settings of a weaver / zoomer / sage agent's loop
    seed_system: SeedSystemConfig | None = None

    @model_validator(mode="after")
    def _references(self) -> TeamConfig:
        names = [a.name for a in self.agents]
        if not names:
            raise ValueError("agents: at least one agent is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"agents: names must be unique, got {names}")
        self._check_kinds()
        for i, a in enumerate(self.agents):
            if a.kind == "cpp":
                spec = self.models.get(a.model)
                if spec is None or spec.kind != "team":  # a team model: a served M1 team as one agent
                    self._need(f"agents.{i}.model", a.model, "chat")
            else:  # a seed system's policy: a vision-language model, or a chat model that reads frames as text
                spec = self.models.get(a.model)
                if spec is None:
                    raise ValueError(f"agents.{i}.model: no model named {a.model!r} (models: {list(self.models)})")
                if spec.kind not in ("chat", "vision"):
                    raise ValueError(f"agents.{i}.model: model {a.model!r} is a {spec.kind} model; a {a.kind} "
                                     f"policy needs a chat or vision model")
        for key in ("clip", "browser", "space", "grounding"):
            ref = getattr(self.tools, key)
            if ref is not None:
                self._need(f"tools.{key}", ref, "clip" if key == "clip" else "vision")
        for key in ("summarizer", "decider"):
            ref = getattr(self.aggregation, key)
            if ref is not None and ref not in names:
                raise ValueError(f"aggregation.{key}: no agent named {ref!r} (agents: {names})")
        if self.aggregation.summarizer in self.served_teams:
            raise ValueError(f"aggregation.summarizer: agent {self.aggregation.summarizer!r} is a served team (model "
                             f"kind team), which answers questions but writes no summaries; name an agent of a "
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
        seeded = [(i, a) for i, a in enumerate(self.agents) if a.kind != "cpp"]
        if not seeded:
            if self.seed_system is not None:
                raise ValueError("seed_system: applies to agents of kind weaver, zoomer or sage; every agent here "
                                 "is kind cpp")
            return
        if len(self.agents) != 1:
            i, a = seeded[0]
            raise ValueError(f"agents.{i}.kind: a {a.kind!r} agent runs alone (a team of one), but the team has "
                             f"{len(self.agents)} agents")
        kind = seeded[0][1].kind
        if self.seed_system is not None and self.seed_system.captioner is not None:
            self._need("seed_system.captioner", self.seed_system.captioner, "vision")
        known = DEFAULTS[kind].tools
        for t in (self.seed_system.tools or []) if self.seed_system else []:
            if t not in known:
                why = " (it needs audio or the web, which M1 does not have)" if t in SAGE_UNAVAILABLE else ""
                raise ValueError(f"seed_system.tools: {t!r} is not a {kind} tool{why} (known: {list(known)})")

    def _need(self, where: str, ref: str, kind: str) -> None:
        spec = self.models.get(ref)
        if spec is None:
            raise ValueError(f"{where}: no model named {ref!r} (models: {list(self.models)})")
        if spec.kind != kind:
            raise ValueError(f"{where}: model {ref!r} is a {spec.kind} model, {kind} needed")

    def greedy(self) -> "TeamConfig":
        """This team decoding greedily (temperature 0 for every agent): how teams are evaluated, and the baseline
        run of `grpo.baseline: greedy`."""
        return self.model_copy(update={"sampling": self.sampling.model_copy(update={"temperature": 0.0}),
                                       "agents": [a.model_copy(update={"temperature": None}) for a in self.agents]})

    @property
    def served_teams(self) -> list[str]:
        """The agents whose model is a served M1 team (`kind: team`, m1/team/member.py)."""
        return [a.name for a in self.agents if a.model in self.models and self.models[a.model].kind == "team"]

    @property
    def summarizer(self) -> str:
        """aggregation.summarizer, else the first agent that is not a served team (else the first agent: a team of
        served teams only, whose engine falls back to the vote rule)."""
        local = [a.name for a in self.agents if a.name not in self.served_teams]
        return self.aggregation.summarizer or (local or [self.agents[0].name])[0]


def resolve_config_path(path: str | Path, group: str = "team") -> Path:
    """Accept a file path or a bare name from configs/<group>/ (e.g. `tiny`)."""
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        raise ConfigError(f"{p}: is a folder; give a YAML config file (or a name in {CONFIG_DIR / group})")
    for cand in (CONFIG_DIR / group / f"{path}.yaml", CONFIG_DIR / group / str(path)):
        if cand.is_file():
            return cand
    raise ConfigError(f"config not found: {path} (looked in {CONFIG_DIR / group})")


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; the value is parsed as YAML (numbers, lists, null...)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source}: override {item!r} must look like key.path=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        value = yaml.safe_load(raw) if raw.strip() else ""
        node: Any = data
        for depth, key in enumerate(keys[:-1]):
            node = _step(node, key, ".".join(keys[: depth + 1]), source, create=True)
        last = keys[-1]
        if isinstance(node, list):
            idx = _index(node, last, dotted, source)
            node[idx] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"{source}: override {dotted!r}: {'.'.join(keys[:-1])} is not a mapping")
    return data


def _index(node: list, key: str, where: str, source: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(f"{source}: override {where!r}: {key!r} is not an index below {len(node)}")
    return int(key)


def _step(node: Any, key: str, where: str, source: str, create: bool) -> Any:
    if isinstance(node, list):
        return node[_index(node, key, where, source)]
    if not isinstance(node, dict):
        raise ConfigError(f"{source}: override path {where!r} goes through a non-mapping value")
    if key not in node or node[key] is None:
        node[key] = {}
    return node[key]


def _override_of(loc: str, overrides: list[str]) -> str | None:
    """The override (the last one) that set the key at `loc`, or a key inside or above it; None when the file did."""
    for item in reversed(overrides):
        key = item.split("=", 1)[0].strip()
        if key == loc or loc.startswith(key + ".") or key.startswith(loc + "."):
            return item
    return None


def _format_errors(err: ValidationError, source: str, overrides: list[str] | None = None) -> str:
    """One line per problem, naming the override that caused it (`--set` or an experiment's) or else the file."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        item = _override_of(loc, list(overrides or [])) if e["loc"] else None
        if item is None:
            where, tail = source, ""
        else:
            where, tail = f"override {item!r}", f"; the override applies to {source}"
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key {loc!r}{tail}")
        else:
            lines.append(f"{where}: {loc}: {e['msg']} (got {e.get('input')!r:.80}){tail}")
    return "\n".join(lines)


def load_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping; a file that cannot be read, is not UTF-8 or not YAML is a ConfigError naming it."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as "
                          f"UTF-8") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^${}]*))?\}")
_HELD = re.compile(r"\x00(\d+)\x00")  # a variable's value, held aside while the references around it are read


def expand_env(data: Any, source: str, where: str = "") -> Any:
    """`${NAME}` and `${NAME:-default}` in a config's string values, from the environment, so one shipped YAML
    (configs/team/hosted.yaml) points at whatever endpoints and model names a user exports. Defaults may hold
    references (`${A:-${B:-x}}`: the innermost is read first). An unset `${NAME}` without a default is an error
    naming the file and field: a URL or model name must never silently be empty. Keys are not expanded, and the
    values of secrets are never here (a config names the variable that holds a key, `api_key_env`)."""
    if isinstance(data, dict):
        return {k: expand_env(v, source, f"{where}.{k}" if where else str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [expand_env(v, source, f"{where}.{i}") for i, v in enumerate(data)]
    if not isinstance(data, str) or "${" not in data:
        return data

    held: list[str] = []

    def one(m: re.Match) -> str:
        value = os.environ.get(m.group(1))
        if value:  # taken as it is: a `${` or a brace inside it is text, never read as part of a reference
            held.append(value)
            return f"\x00{len(held) - 1}\x00"
        if m.group(2) is not None:
            return m.group(2)
        raise ConfigError(f"{source}: {where}: the environment variable {m.group(1)} is not set (the field reads "
                          f"{data!r}); export it, or give a default as ${{{m.group(1)}:-value}}")

    text = data
    while True:
        expanded = _ENV_REF.sub(one, text)
        if expanded == text:
            return _HELD.sub(lambda h: held[int(h.group(1))], text)
        text = expanded


def load_config(model: type[BaseModel], path: str | Path, overrides: list[str] | None = None,
                group: str = "team") -> Any:
    p = resolve_config_path(path, group)
    data = expand_env(apply_overrides(load_yaml(p), list(overrides or []), str(p)), str(p))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, str(p), list(overrides or []))) from None


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

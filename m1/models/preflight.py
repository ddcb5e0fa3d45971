"""Every model a run will load, checked before any weights load.

A model that cannot be built (a config transformers does not know, remote code without the class the backend asks
for, a processor without what the model's role needs) otherwise fails when the run loads it: for `m1 train`, minutes
in and after its GPUs are reserved. `m1 train --plan`, `m1 sft --plan`, `m1 infer`, `m1 eval` and the start of
`m1 train` / `m1 sft` run `check_models` first and stop on the first refusal with one line naming the model and why.

What is checked depends on where a model comes from:
- a local folder, or a hub id whose config.json is in the Hugging Face cache: config.json loads with AutoConfig; the
  backend's class is built from it on the meta device (no weights, no memory; no weights file is opened); the
  tokenizer (a chat model needs a chat template) or the processor (a browse tool needs a video processor, or with
  backend eagle an image processor; a seed kind's VLM policy an image processor) loads from its files.
- a hub id of the paper's teams not in the cache: its public config's model_type and remote-code classes
  (KNOWN_HUB_CONFIGS) are checked against the backend's class, and a native VLM's processor class against the role;
  its files are not ("checked by class").
- any other hub id not in the cache: reported as not checked; nothing is downloaded (the check runs offline).
- tiny specs: their shapes. API models (openai), M1-Synth's models and open_clip names: nothing to build here.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from m1.config import ModelSpec, TeamConfig
from m1.models.base import ModelError
from m1.models.hub import BACKENDS
from m1.models.shapes import _read_config

# What a run asks of a model.
AGENT = "agent"  # a CPP agent's chat policy (also a learner's model)
JUDGE = "judge"  # the LLM judge of training rewards (a chat model)
VLM_POLICY = "vlm policy"  # a seed kind's vision-language policy: chats with frames as images
BROWSE = "browse tool"  # Rough/Fine Browser, Space or Grounding Tool: describes a clip's frames
CLIP = "clip"

# The transformers auto class each (backend, kind) loads its model with.
AUTO_CLASS = {("hf", "chat"): "AutoModelForCausalLM", ("vllm", "chat"): "AutoModelForCausalLM",
              ("hf", "vision"): "AutoModelForImageTextToText", ("eagle", "vision"): "AutoModel"}

# model_type and remote-code classes (config auto_map keys) of the public config.json of the hub ids the shipped
# configs name, so a config that asks the wrong loader of them is refused without their files.
KNOWN_HUB_CONFIGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Qwen/Qwen3-8B": ("qwen3", ()),
    "Qwen/Qwen3-4B": ("qwen3", ()),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2", ()),
    "Qwen/Qwen2.5-3B-Instruct": ("qwen2", ()),
    "Qwen/Qwen2.5-7B": ("qwen2", ()),
    "Qwen/Qwen2.5-3B": ("qwen2", ()),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2_5_vl", ()),
    "Qwen/Qwen2.5-VL-3B-Instruct": ("qwen2_5_vl", ()),
    "OpenGVLab/InternVL3_5-8B-HF": ("internvl", ()),
    "OpenGVLab/InternVL3_5-8B": ("internvl_chat", ("AutoConfig", "AutoModel", "AutoModelForCausalLM")),
    "nvidia/Eagle2.5-8B": ("eagle_2_5_vl", ("AutoConfig", "AutoModel")),
}

MIN_VOCABULARY = 16  # fewer tokens than this: a tokenizer built without its files

Status = Literal["ok", "class", "unchecked", "skipped", "refused"]


class PreflightError(ModelError):
    """A model of the run cannot be built: one line naming it and why."""


@dataclass(frozen=True)
class ModelCheck:
    """The outcome for one model: ok (built from its files), class (checked by class only), unchecked (nothing known
    about it here), skipped (nothing to build: an API, synth or open_clip model), refused."""

    key: str
    source: str
    roles: tuple[str, ...]
    status: Status
    why: str

    def line(self) -> str:
        return f"model {self.key!r} ({self.source}, {' + '.join(self.roles) or 'unused'}): {self.why}"


def team_models(team: TeamConfig, prefix: str = "") -> dict[str, tuple[ModelSpec, set[str]]]:
    """The models a run of `team` loads, each with its roles; keys get `prefix` (e.g. "teacher.")."""
    roles: dict[str, set[str]] = defaultdict(set)
    for a in team.agents:
        roles[a.model].add(AGENT if a.kind == "cpp" or team.models[a.model].kind == "chat" else VLM_POLICY)
    t, enabled = team.tools, set(team.tools.enabled)
    seeded = any(a.kind != "cpp" for a in team.agents)

    def use(key: str | None, role: str) -> None:
        if key is not None:
            roles[key].add(role)

    if seeded:  # a seed kind's tools reach their models through tools.*
        for key in (t.browser, t.space, t.grounding):
            use(key, BROWSE)
        use(t.clip, CLIP)
    else:
        if enabled & {"Rough Browser", "Fine Browser"}:
            use(t.browser, BROWSE)
        if "Space Tool" in enabled:
            use(t.space or t.browser, BROWSE)
        if "Grounding Tool" in enabled:
            use(t.grounding or t.browser, BROWSE)
        if enabled & {"Video Retrieval", "Image Retrieval"}:
            use(t.clip, CLIP)
    return {prefix + key: (team.models[key], r) for key, r in roles.items()}


def check_models(models: dict[str, tuple[ModelSpec, set[str]]]) -> list[ModelCheck]:
    """One ModelCheck per model, in the given order."""
    return [check_model(key, spec, roles) for key, (spec, roles) in models.items()]


def require(checks: list[ModelCheck]) -> list[ModelCheck]:
    """`checks` when none is refused; else PreflightError with the first refusal's line (and the other keys)."""
    bad = [c for c in checks if c.status == "refused"]
    if bad:
        more = f" (also refused: {', '.join(repr(c.key) for c in bad[1:])})" if len(bad) > 1 else ""
        raise PreflightError(bad[0].line() + more)
    return checks


def summary(checks: list[ModelCheck]) -> list[str]:
    """Lines for the plan: which models were checked how, and which were not."""
    groups = [("ok", "models checked (class built from the config, no weights; tokenizer/processor loaded)"),
              ("class", "models checked by class only (their hub files are not in the cache)")]
    lines = [f"{title}: {', '.join(c.key for c in checks if c.status == status)}"
             for status, title in groups if any(c.status == status for c in checks)]
    lines += [f"model not checked: {c.line()}" for c in checks if c.status == "unchecked"]
    return lines


def check_model(key: str, spec: ModelSpec, roles: set[str]) -> ModelCheck:
    source = spec.path or (f"tiny {spec.tiny.arch}" if spec.tiny else None) or spec.clip_name or spec.backend

    def result(status: Status, why: str) -> ModelCheck:
        return ModelCheck(key, source, tuple(sorted(roles)), status, why)

    if spec.backend == "openai":
        return result("skipped", "an API model: its server answers, nothing to build here")
    if spec.backend == "synth":
        return result("skipped", "M1-Synth's own model")
    if spec.backend == "open_clip":
        return result("skipped", "open_clip builds it by name at load")
    if (spec.backend, spec.kind) not in BACKENDS:
        return result("refused", f"backend {spec.backend!r} has no {spec.kind} models")
    if spec.backend == "eagle" and roles - {BROWSE}:
        return result("refused", f"backend eagle serves the browse tools only, not a {' or '.join(sorted(roles))}")
    if spec.tiny is not None:
        why = _tiny_problem(spec)
        return result("refused", why) if why else result("ok", "tiny model, built from its spec")
    path = os.path.expanduser(spec.path or "")
    if os.path.isdir(path):
        return _check_files(spec, roles, path, result, hub=False)
    if spec.path.startswith((".", "/", "~")) or spec.path.count("/") > 1:
        return result("refused", f"{spec.path} is not a folder (nor a hub id); fix `path`, or make the model there "
                                 "first")
    if _cached(spec.path):
        return _check_files(spec, roles, spec.path, result, hub=True)
    if spec.path in KNOWN_HUB_CONFIGS:
        return _check_known(spec, roles, result)
    return result("unchecked", "not in the Hugging Face cache, and not a model whose config M1 knows; download its "
                               "config and tokenizer files first to have it checked (nothing is downloaded here)")


def _cached(hub_id: str) -> bool:
    """Whether the hub id's config.json is in the Hugging Face cache (read, never downloaded)."""
    try:
        return _read_config(hub_id) is not None
    except ValueError:  # a damaged cached config: the file check names it
        return True


def _tiny_problem(spec: ModelSpec) -> str | None:
    t = spec.tiny
    arches = {"chat": ("qwen2", "qwen3"), "vision": ("qwen2_5_vl",), "clip": ("open_clip",)}[spec.kind]
    if t.arch not in arches:
        return f"tiny arch {t.arch!r} is not a {spec.kind} model (use {' or '.join(arches)})"
    if t.arch != "open_clip" and (t.hidden_size % t.heads or t.heads % t.kv_heads):
        return (f"tiny shape: hidden_size {t.hidden_size} must divide by heads {t.heads}, and heads by kv_heads "
                f"{t.kv_heads}")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _class_problem(spec: ModelSpec, model_type: str | None, auto_map, auto: str) -> str | None:
    """Why the backend's auto class cannot build this model_type / remote code, or None."""
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    version = f"transformers {transformers.__version__}"
    if not model_type:
        return "its config.json has no model_type"
    native = model_type in CONFIG_MAPPING_NAMES
    if not native and not auto_map:
        return f"its config.json has model_type {model_type!r}, which {version} does not know (and it ships no code)"
    if not native and not spec.trust_remote_code:
        return (f"model_type {model_type!r} is not in {version}; the model ships its own code (auto_map), which "
                "runs only with trust_remote_code: true")
    if spec.trust_remote_code and auto in auto_map:
        return None
    mapping = {"AutoModelForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
               "AutoModelForImageTextToText": modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
               "AutoModel": modeling_auto.MODEL_MAPPING_NAMES}[auto]
    if native and model_type in mapping:
        return None
    known = f"is in {version} but not as an {auto} model" if native else f"is not in {version}"
    offers = sorted(k for k in auto_map if k.startswith("AutoModel"))
    hint = ""
    if "eagle" in model_type and "AutoModel" in auto_map and spec.backend != "eagle":
        hint = "; load it with backend: eagle (m1/models/eagle.py, its model card's AutoModel + AutoProcessor)"
    return (f"{auto} cannot build it: model_type {model_type!r} {known}, and its own code offers "
            f"{offers or 'no model class'}{hint}")


def _needs(spec: ModelSpec, roles: set[str]) -> list[str]:
    """The processor parts the model's roles use."""
    if spec.backend == "eagle":
        return ["image_processor"]  # Eagle reads a clip's frames as images
    needs = ["video_processor"] if BROWSE in roles else []  # HFVisionModel sends a clip as one video
    return needs + (["image_processor"] if VLM_POLICY in roles else [])


def _no_vocabulary(tok, source: str, hub: bool, result) -> ModelCheck | None:
    """None when the tokenizer has a vocabulary. transformers 5 builds a tokenizer of one token, without an error,
    when a folder has no tokenizer files; for a cached hub id the run would fetch them."""
    if len(tok) >= MIN_VOCABULARY:
        return None
    why = f"its tokenizer has {len(tok)} token(s): no tokenizer files (tokenizer.json, vocab.json) in {source}"
    return result("class", why + "; the run fetches them") if hub else result("refused", why)


def _check_files(spec: ModelSpec, roles: set[str], source: str, result, hub: bool) -> ModelCheck:
    """Config, class (built on the meta device) and tokenizer/processor from a folder or the HF cache."""
    import torch
    import transformers

    try:
        raw = _read_config(source)
    except ValueError as exc:  # json.JSONDecodeError
        return result("refused", f"its config.json is not JSON: {exc}")
    if raw is None:
        return result("refused", f"no config.json in {source}")
    auto = AUTO_CLASS[(spec.backend, spec.kind)]
    why = _class_problem(spec, raw.get("model_type"), raw.get("auto_map") or {}, auto)
    if why:
        return result("refused", why)
    trust = {"trust_remote_code": True} if spec.trust_remote_code else {}
    # Remote code and config classes can raise anything; each failure becomes the refusal's reason.
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True, **trust)
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        return result("refused", f"its config.json does not load: {_first_line(exc)}")
    try:
        with torch.device("meta"):
            built = getattr(transformers, auto).from_config(config, **trust)
    except Exception as exc:  # noqa: BLE001
        return result("refused", f"{auto} cannot build it from its config: {_first_line(exc)}")
    cls = type(built).__name__
    try:
        if spec.kind == "chat":
            tok = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True, **trust)
            empty = _no_vocabulary(tok, source, hub, result)
            if empty:
                return empty
            if getattr(tok, "chat_template", None) is None:
                return result("refused", f"its tokenizer ({type(tok).__name__}) has no chat template; an agent's "
                                         "prompts are chats")
            return result("ok", f"{cls} from its config; tokenizer with a chat template")
        proc = transformers.AutoProcessor.from_pretrained(source, local_files_only=True, **trust)
    except OSError as exc:
        if hub:  # config cached, tokenizer/processor files not: the run would fetch them
            return result("class", f"{cls} from its cached config; tokenizer/processor files not in the cache "
                                   f"({_first_line(exc)})")
        return result("refused", f"its tokenizer/processor does not load: {_first_line(exc)}")
    except Exception as exc:  # noqa: BLE001
        return result("refused", f"its tokenizer/processor does not load: {_first_line(exc)}")
    tok = getattr(proc, "tokenizer", None)
    if tok is None:
        return result("refused", f"AutoProcessor gives a bare {type(proc).__name__}, no processor (no "
                                 f"preprocessor_config.json / processor_config.json in {source}); a "
                                 f"{' + '.join(sorted(roles))} reads frames")
    empty = _no_vocabulary(tok, source, hub, result)
    if empty:
        return empty
    missing = [part for part in _needs(spec, roles) if getattr(proc, part, None) is None]
    if missing:
        return result("refused", f"its processor {type(proc).__name__} has no {' or '.join(missing)}, which a "
                                 f"{' + '.join(sorted(roles))} of backend {spec.backend} needs for its frames")
    if (getattr(proc, "chat_template", None) or getattr(tok, "chat_template", None)) is None:
        return result("refused", f"its processor {type(proc).__name__} has no chat template")
    return result("ok", f"{cls} from its config; {type(proc).__name__} with what its role needs")


def _check_known(spec: ModelSpec, roles: set[str], result) -> ModelCheck:
    """A hub id not in the cache whose public config M1 knows: the class, and a native processor's parts."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type, auto_map = KNOWN_HUB_CONFIGS[spec.path]
    auto = AUTO_CLASS[(spec.backend, spec.kind)]
    why = _class_problem(spec, model_type, {k: "" for k in auto_map}, auto)
    if why:
        return result("refused", f"{why} (from its public config; its files are not in the cache)")
    parts = ""
    needs = _needs(spec, roles) if spec.kind == "vision" else []
    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if name and spec.backend != "eagle" else None
    if needs and cls is not None:
        missing = [p for p in needs if p not in cls.get_attributes()]
        if missing:
            return result("refused", f"its processor {name} has no {' or '.join(missing)}, which a "
                                     f"{' + '.join(sorted(roles))} needs (from its public config)")
        parts = f"; {name} has {' and '.join(needs)}"
    return result("class", f"{auto} builds model_type {model_type!r}{parts}; files not in the cache, not checked")

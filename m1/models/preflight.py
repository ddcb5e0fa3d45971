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
- tiny specs: their shapes. M1-Synth's models and open_clip names: nothing to build here.
- API models (openai): nothing to build, but their servers are asked (`check_endpoints`, `m1 infer`, `m1 eval`
  and `m1 serve` only, after `check_models`), since a wrong URL, key or model name otherwise fails the first question, and a
  text-only model in a vision role fails every browse. Once per endpoint (base_url and key variable): GET /models
  (is it reachable, is the key accepted, is each model served); once per vision model: one chat with one small
  JPEG and max_tokens 1 (and with `video_input: video_url` one small mp4). Requests wait at most ENDPOINT_TIMEOUT;
  the key is never shown (the backend's scrubbing). A team without openai models asks nothing.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from m1.config import ModelSpec, TeamConfig
from m1.models.base import ModelError
from m1.models.hub import BACKENDS
from m1.models.shapes import _read_config
from m1.registry import TOOLS, is_seed, vision_model_attrs

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
    about it here), skipped (nothing to build: an API, synth or open_clip model), refused. For an API model's server
    (check_endpoints): ok (served, takes what its role sends), unchecked (the server was busy or slow), refused."""

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
        roles[a.model].add(AGENT if not is_seed(a.kind) or team.models[a.model].interface == "chat" else VLM_POLICY)
    t, enabled = team.tools, set(team.tools.enabled)
    seeded = any(is_seed(a.kind) for a in team.agents)

    def use(key: str | None, role: str) -> None:
        if key is not None:
            roles[key].add(role)

    if seeded:  # a seed kind's tools reach their models through tools.*
        for attr in vision_model_attrs():
            use(getattr(t, attr), BROWSE)
        use(t.clip, CLIP)
    else:
        specs = [s for name, s in TOOLS.items() if name in enabled]
        for spec in specs:
            use(spec.vision_model(t), BROWSE)
        if any(spec.clip for spec in specs):
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
    if (spec.backend, spec.interface) not in BACKENDS:
        return result("refused", f"backend {spec.backend!r} has no {spec.interface} models")
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
    arches = {"chat": ("qwen2", "qwen3"), "vision": ("qwen2_5_vl",), "clip": ("open_clip",)}[spec.interface]
    if t.arch not in arches:
        return f"tiny arch {t.arch!r} is not a {spec.interface} model (use {' or '.join(arches)})"
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
    auto = AUTO_CLASS[(spec.backend, spec.interface)]
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
        if spec.interface == "chat":
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
    auto = AUTO_CLASS[(spec.backend, spec.interface)]
    why = _class_problem(spec, model_type, {k: "" for k in auto_map}, auto)
    if why:
        return result("refused", f"{why} (from its public config; its files are not in the cache)")
    parts = ""
    needs = _needs(spec, roles) if spec.interface == "vision" else []
    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if name and spec.backend != "eagle" else None
    if needs and cls is not None:
        missing = [p for p in needs if p not in cls.get_attributes()]
        if missing:
            return result("refused", f"its processor {name} has no {' or '.join(missing)}, which a "
                                     f"{' + '.join(sorted(roles))} needs (from its public config)")
        parts = f"; {name} has {' and '.join(needs)}"
    return result("class", f"{auto} builds model_type {model_type!r}{parts}; files not in the cache, not checked")


# -- API models: their servers are asked (check_endpoints) ------------------------------------------------------
ENDPOINT_TIMEOUT = 10.0  # seconds: the most a start-up request waits (less when the model's own timeout is less)
SHORT_DETAIL = 200  # characters of a server's error message kept in a line
TRANSIENT = (408, 429)  # with 5xx: a busy server, not a wrong setting; the run's retries handle it


def startup_problems(team: TeamConfig) -> tuple[list[str], list[str]]:
    """What `m1 infer`, `m1 eval` and `m1 serve` check before the first question: (warning lines, error lines).

    Every model must build from its config (`check_models`; the first that cannot raises PreflightError), then the
    servers of its API models are asked (`check_endpoints`): every refusal is an error line, so each endpoint can be
    fixed before the next try; a server too busy to answer a probe is a warning line."""
    require(check_models(team_models(team)))
    checks = check_endpoints(team)
    return ([c.line() for c in checks if c.status == "unchecked"], [c.line() for c in checks if c.status == "refused"])


def check_endpoints(team: TeamConfig) -> list[ModelCheck]:
    """Ask the servers of the team's openai models whether a run could use them, before any question.

    Rows: refused, one per problem (several for a model with several); unchecked where a server was busy or slow to
    answer a probe (the run's own retries may still get through); ok for a model without problems. No openai model:
    no rows and no network."""
    models = {k: v for k, v in team_models(team).items() if v[0].backend == "openai"}
    if not models:
        return []
    from m1.models.openai import OpenAIChatModel, OpenAIVisionModel

    rows: list[ModelCheck] = []
    built: dict[str, object] = {}
    endpoints: dict[tuple[str | None, str], list[str]] = defaultdict(list)
    for key, (spec, _) in models.items():
        cls = OpenAIVisionModel if spec.interface == "vision" else OpenAIChatModel
        try:  # the run's own constructor: a missing key, path or video_root is refused with its message
            built[key] = cls(spec, key)
        except ModelError as exc:
            rows.append(_api_row(team, key, spec, "refused",
                                 str(exc).removeprefix(f"openai model {key!r} ({spec.path}): ")))
            continue
        endpoints[(built[key].base_url, spec.api_key_env)].append(key)
    probed: dict[tuple, tuple[Status, str] | None] = {}
    try:
        for keys in endpoints.values():
            rows += _check_endpoint(team, models, built, keys, probed)
    finally:
        for model in built.values():
            model.close()
    order = list(models)
    return sorted(rows, key=lambda c: order.index(c.key))


def _api_row(team: TeamConfig, key: str, spec: ModelSpec, status: Status, why: str) -> ModelCheck:
    """A row naming the model, its URL and who uses it; the key, should any text hold it, shown as ***."""
    from m1.models.openai import DEFAULT_BASE_URL, PLACEHOLDER_KEY

    url = spec.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    source, secret = f"{spec.path} at {url}", os.environ.get(spec.api_key_env)
    if secret and secret != PLACEHOLDER_KEY:
        source, why = source.replace(secret, "***"), why.replace(secret, "***")
    return ModelCheck(key, source, _users(team, key), status, why)


def _users(team: TeamConfig, key: str) -> tuple[str, ...]:
    """Who asks the model: its agents by name, then the tools (by name where the team enables them by name)."""
    users = [f"{a.kind} agent {a.name}" if is_seed(a.kind) else f"agent {a.name}" for a in team.agents
             if a.model == key]
    t, enabled = team.tools, team.tools.enabled
    if any(is_seed(a.kind) for a in team.agents):  # a seed kind's tools reach their models through tools.*
        return tuple(users + ([BROWSE] if key in {getattr(t, a) for a in vision_model_attrs()} else []))
    return tuple(users + [tool for tool in enabled if tool in TOOLS and TOOLS[tool].vision_model(t) == key])


def _short(model, exc: BaseException) -> str:
    """A server's error message, scrubbed of the key and cut short (without the client's "Error code: 400 - ", as
    the line names the status)."""
    text = re.sub(r"^Error code: \d+ - ", "", model._detail(exc))
    return text if len(text) <= SHORT_DETAIL else text[:SHORT_DETAIL] + "..."


def _check_endpoint(team: TeamConfig, models, built, keys: list[str], probed) -> list[ModelCheck]:
    """GET /models once for the endpoint's models (through the first one's client), then each vision model's probes."""
    import openai

    first = built[keys[0]]
    var = first.spec.api_key_env
    wait = min([ENDPOINT_TIMEOUT] + [models[k][0].timeout for k in keys])

    def every(status: Status, why: str) -> list[ModelCheck]:
        return [_api_row(team, k, models[k][0], status, why) for k in keys]

    hint = "; is the server up, and is base_url right?"
    try:
        page = first._client.models.list(timeout=wait)
    except openai.APITimeoutError:
        return every("refused", f"unreachable (no answer within {wait:g} s){hint}")
    except openai.APIConnectionError as exc:
        cause = exc.__cause__
        return every("refused", f"unreachable ({_short(first, cause) if cause is not None else _short(first, exc)})"
                                f"{hint}")
    except openai.APIStatusError as exc:
        status, detail = exc.status_code, _short(first, exc)
        if status in (401, 403):
            unset = "" if first._secret is not None else " is not set, and the server asks for a key"
            return every("refused", f"key rejected (env {var}{unset}): HTTP {status}: {detail}")
        if status == 404:
            return every("refused", f"GET /models answered HTTP 404: no OpenAI-compatible API at this URL (base_url "
                                    f"usually ends in /v1): {detail}")
        if status in TRANSIENT or status >= 500:
            return every("unchecked", f"not checked: GET /models answered HTTP {status}: {detail}")
        return every("refused", f"GET /models answered HTTP {status}: {detail}")
    except openai.OpenAIError as exc:
        return every("refused", f"GET /models failed: {type(exc).__name__}: {_short(first, exc)}")
    try:
        served = [str(m.id) for m in page.data]
    except (AttributeError, TypeError):
        return every("refused", "GET /models answered something that is not a list of models; is this an "
                                "OpenAI-compatible server?")
    rows = []
    for key in keys:
        spec = models[key][0]
        if spec.path not in served:
            shown = ", ".join(served[:20]) + (f", ... ({len(served)} in all)" if len(served) > 20 else "")
            rows.append(_api_row(team, key, spec, "refused",
                                 f"model {spec.path!r} is not served there; served: {shown or 'none'}"))
            continue
        problems = _probe_vision(first, built[key], probed) if spec.interface == "vision" else []
        rows += [_api_row(team, key, spec, status, why) for status, why in problems]
        if not any(status == "refused" for status, _ in problems):
            takes = {"frames": "; takes images", "video_url": "; takes images and video"}[spec.video_input]
            probed_ok = spec.interface == "vision" and not problems  # an unchecked probe: served, the input not known
            rows.append(_api_row(team, key, spec, "ok", f"served{takes if probed_ok else ''}"))
    return rows


def _probe_vision(client_model, model, probed) -> list[tuple[Status, str]]:
    """One tiny chat with one small JPEG (max_tokens 1), and with video_url one with a small mp4; each asked once per
    endpoint, served model and way of sending."""
    import numpy as np

    from m1.models.base import VisionRequest
    from m1.models.openai import video_messages, vision_messages

    spec = model.spec
    written: list = []  # a probe clip written under video_root, removed once asked
    where = (model.base_url, spec.api_key_env, spec.path)
    frame = np.full((1, 64, 64, 3), 128, dtype=np.uint8)
    image = VisionRequest(frames=frame, timestamps=[0.0], prompt="Say yes.")
    probes = [("image", where, lambda: vision_messages(image),
               "does not accept images (a text-only model in the vision role?)")]
    if spec.video_input == "video_url":
        clip = VisionRequest(frames=np.repeat(frame, 4, axis=0), timestamps=[0.0, 0.5, 1.0, 1.5], prompt="Say yes.")

        def video() -> list:
            return video_messages(clip, model._video_url(clip, written))

        probes.append(("video", (*where, spec.video_transport, spec.video_root), video,
                       f"does not accept video (video_input: video_url, video_transport: {spec.video_transport})"))
    out = []
    try:
        for what, cache_key, messages, refusal in probes:
            cache_key = (what, *cache_key)
            if cache_key not in probed:
                probed[cache_key] = _ask(client_model, model, messages(), what, refusal)
            if probed[cache_key] is not None:
                out.append(probed[cache_key])
    except ModelError as exc:  # the clip could not be encoded or written under video_root
        out.append(("refused", str(exc).removeprefix(model._where() + ": ")))
    finally:
        for path in written:
            path.unlink(missing_ok=True)
    return out


def _ask(client_model, model, messages: list, what: str, refusal: str) -> tuple[Status, str] | None:
    """One chat of max_tokens 1 through the endpoint's client: None when answered, else (status, why). A 4xx is
    the model refusing the input; a busy or slow server leaves it unchecked."""
    import openai

    spec = model.spec
    body = {"model": spec.path, "messages": messages, "max_tokens": 1}
    wait = min(spec.timeout, ENDPOINT_TIMEOUT)
    for _ in range(2):  # once more with max_completion_tokens, for servers that want that field
        try:
            client_model._client.chat.completions.create(**body, timeout=wait)
            return None
        except openai.APIStatusError as exc:
            status, detail = exc.status_code, _short(model, exc)
        except openai.APITimeoutError:
            return "unchecked", f"not checked whether it takes {what}s: no answer within {wait:g} s"
        except openai.OpenAIError as exc:
            return "unchecked", f"not checked whether it takes {what}s: {type(exc).__name__}: {_short(model, exc)}"
        if status == 400 and "max_tokens" in body and "max_completion_tokens" in detail.lower():
            body["max_completion_tokens"] = body.pop("max_tokens")
            continue
        if status in TRANSIENT or status >= 500:
            return "unchecked", f"not checked whether it takes {what}s: HTTP {status}: {detail}"
        return "refused", f"{refusal}: HTTP {status}: {detail}"
    return "refused", f"{refusal}: HTTP {status}: {detail}"

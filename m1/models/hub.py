"""ModelHub: one loaded instance per model key, shared by every agent and tool that names it.

Loading is lazy (first use) and guarded by a lock so two threads asking for the same key still
load it once. Backends whose modules are optional (openai, vllm, synth, eagle) are imported only when
a spec asks for them.
"""
from __future__ import annotations

import importlib
import threading
from typing import Any

from m1.config import ModelSpec
from m1.models.base import ChatModel, ClipModel, ModelError, VisionModel

# (backend, interface) -> (module, class name)
BACKENDS: dict[tuple[str, str], tuple[str, str]] = {
    ("hf", "chat"): ("m1.models.hf", "HFChatModel"),
    ("hf", "vision"): ("m1.models.hf", "HFVisionModel"),
    ("eagle", "vision"): ("m1.models.eagle", "EagleVisionModel"),
    ("open_clip", "clip"): ("m1.models.clip", "OpenClipModel"),
    ("openai", "chat"): ("m1.models.openai", "OpenAIChatModel"),
    ("openai", "vision"): ("m1.models.openai", "OpenAIVisionModel"),
    ("openai", "team"): ("m1.models.served_team", "ServedTeamModel"),  # a served M1 team as one agent
    ("vllm", "chat"): ("m1.models.vllm_offline", "VLLMChatModel"),
    ("synth", "vision"): ("m1.synth.vision", "SynthVisionModel"),
    ("synth", "chat"): ("m1.synth.teacher", "TeacherChatModel"),
}


class ModelHub:
    def __init__(self, specs: dict[str, ModelSpec]):
        self.specs = dict(specs)
        self._models: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self.loads: dict[str, int] = {}  # how many times each key was built (should stay 1)

    def chat(self, key: str) -> ChatModel:
        return self._get(key, "chat")

    def vision(self, key: str) -> VisionModel:
        return self._get(key, "vision")

    def clip(self, key: str) -> ClipModel:
        return self._get(key, "clip")

    def team(self, key: str) -> Any:
        """A served M1 team (`interface: team`): asked whole questions (m1/team/member.py)."""
        return self._get(key, "team")

    def register(self, key: str, model: Any, interface: str | None = None) -> None:
        """Use an already built model (a fake in tests, a model shared with a trainer) for `key`."""
        if interface is None:
            spec = self.specs.get(key)
            interface = spec.interface if spec is not None else _guess_interface(model)
        if interface not in ("chat", "vision", "clip", "team"):
            raise ModelError(f"register({key!r}): cannot tell whether the model is chat, vision, clip "
                             f"or team; pass interface=")
        with self._lock:
            self._models[key] = (interface, model)

    def loaded(self) -> list[str]:
        return list(self._models)

    def _get(self, key: str, interface: str) -> Any:
        with self._lock:
            entry = self._models.get(key)
            if entry is None:
                if key not in self.specs:
                    known = sorted(set(self.specs) | set(self._models))
                    raise ModelError(f"unknown model key {key!r} (known: {known})")
                key_lock = self._key_locks.setdefault(key, threading.Lock())
        if entry is not None:
            return self._check_interface(key, entry[0], interface, entry[1])
        spec = self.specs[key]
        self._check_interface(key, spec.interface, interface, None)
        with key_lock:  # one loader per key; other keys keep loading in parallel
            entry = self._models.get(key)
            if entry is None:
                model = self._build(key, spec)
                self.loads[key] = self.loads.get(key, 0) + 1
                entry = (spec.interface, model)
                with self._lock:
                    self._models[key] = entry
        return entry[1]

    @staticmethod
    def _check_interface(key: str, have: str, want: str, model: Any) -> Any:
        if have != want:
            raise ModelError(f"model {key!r} is a {have} model, asked for as a {want} model")
        return model

    def _build(self, key: str, spec: ModelSpec) -> Any:
        target = BACKENDS.get((spec.backend, spec.interface))
        if target is None:
            interfaces = sorted(k for b, k in BACKENDS if b == spec.backend)
            raise ModelError(f"model {key!r}: backend {spec.backend!r} has no {spec.interface} models "
                             f"(it offers: {interfaces})")
        module_name, class_name = target
        try:
            module = importlib.import_module(module_name)
            cls = getattr(module, class_name)
        except (ImportError, AttributeError, RuntimeError) as exc:
            raise ModelError(f"model {key!r}: backend {spec.backend!r} is unavailable "
                             f"({module_name}.{class_name}: {exc})") from exc
        return cls(spec, key)


def _guess_interface(model: Any) -> str | None:
    if hasattr(model, "ask"):
        return "team"
    if hasattr(model, "generate"):
        return "chat"
    if hasattr(model, "describe"):
        return "vision"
    if hasattr(model, "encode_images"):
        return "clip"
    return None

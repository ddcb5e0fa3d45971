"""Config files: reading a YAML, `${NAME}` from the environment, dotted `--set` overrides and the errors that
name the file and key. Each config model (team, marl, sft, pretrain, experiments) is loaded through `load_config`."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # the repository's configs/ (a link), or the wheel's copy


class ConfigError(ValueError):
    pass


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

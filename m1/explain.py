"""`m1 config explain FILE [KEY]` (mounted by m1/cli.py): every setting of a config with its value, its default and its
help, read from the models' `Field(description=...)`, so people and tools read the same text the code is checked by.
"""
from __future__ import annotations

import difflib
import json
import shutil
import textwrap
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from m1.config_files import ConfigError, load_yaml, resolve_config_path
from m1.errors import fail

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Config files: what each setting means, its value and its default.")


def _loaders() -> dict[str, tuple[type[BaseModel], Callable[..., BaseModel]]]:
    """Config kind (its configs/ folder) -> model class and the loader the matching command uses."""
    from m1.config import TeamConfig, load_team
    from m1.marl.config import SFTConfig, TrainConfig, load_sft_config, load_train_config
    from m1.pretrain.config import PretrainConfig, load_pretrain_config

    return {"team": (TeamConfig, load_team), "marl": (TrainConfig, load_train_config),
            "sft": (SFTConfig, load_sft_config), "pretrain": (PretrainConfig, load_pretrain_config)}


KINDS = ("team", "marl", "sft", "pretrain")  # team: `m1 infer/eval/demo/serve --team`; the others: their command


@dataclass
class Row:
    key: str  # dotted, as `--set` takes it
    value: Any  # JSON-able; None also for the children of a block that is unset
    default: Any
    required: bool
    help: str


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (`TinySpec | None` -> [TinySpec])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _model_classes(arg)]


def rows(model: type[BaseModel], instance: BaseModel | None, defaults: BaseModel | None = None,
         prefix: str = "") -> list[Row]:
    """One row per setting of `model`, nested blocks (and the entries of dicts and lists of blocks) walked, keys
    dotted. `instance` None: a block the config leaves unset, listed so that its settings can still be explained.
    `defaults`: the block's default instance, when its parent gives one."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        value = getattr(instance, name) if instance is not None else None
        required = field.is_required()
        default = None if required else (getattr(defaults, name) if defaults is not None else
                                         field.default_factory() if field.default_factory else field.default)
        out.append(Row(key, to_jsonable_python(value), to_jsonable_python(default), required, field.description or ""))
        nested = default if isinstance(default, BaseModel) else None
        if isinstance(value, BaseModel):
            out += rows(type(value), value, nested if type(nested) is type(value) else None, key + ".")
        elif isinstance(value, dict):
            out += [r for k, v in value.items() if isinstance(v, BaseModel)
                    for r in rows(type(v), v, None, f"{key}.{k}.")]
        elif isinstance(value, list):
            out += [r for i, v in enumerate(value) if isinstance(v, BaseModel)
                    for r in rows(type(v), v, None, f"{key}.{i}.")]
        elif value is None:  # an unset `Block | None`; not `str | Block` (a team named rather than inline)
            args = [a for a in typing.get_args(field.annotation) if a is not type(None)]
            if len(args) == 1 and _model_classes(args[0]) == [args[0]]:
                out += rows(args[0], None, None, key + ".")
    return out


def config_kind(path: str, kind: str | None) -> tuple[str, Path]:
    """The kind of a config and its file: `kind` when given; else the configs/ folder the file sits in; else the one
    kind whose top-level keys hold the file's keys and whose required keys it has; else an error asking for --kind."""
    if kind is not None:
        if kind not in KINDS:
            raise ConfigError(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
        return kind, resolve_config_path(path, kind)
    p = Path(path)
    if not p.is_file():  # a bare name, as the commands take it: the configs/ folders that hold it
        found = []
        for k in KINDS:
            try:
                found.append((k, resolve_config_path(path, k)))
            except ConfigError:
                pass
        if len(found) == 1:
            return found[0]
        if not found:
            raise ConfigError(f"config not found: {path} (give a YAML path, or a name in "
                              f"configs/{{{','.join(KINDS)}}})")
        raise ConfigError(f"{path}: a config of that name is in {', '.join(f'configs/{k}' for k, _ in found)}; "
                          f"say which with --kind {{{','.join(k for k, _ in found)}}}")
    if p.resolve().parent.name in KINDS:
        return p.resolve().parent.name, p
    keys = set(load_yaml(p))
    fits = []
    for k, (model, _) in _loaders().items():
        required = {n for n, f in model.model_fields.items() if f.is_required()}
        if required <= keys <= set(model.model_fields):
            fits.append(k)
    if len(fits) == 1:
        return fits[0], p
    which = f"it could be {' or '.join(fits)}" if fits else "its keys fit no config kind"
    raise ConfigError(f"{p}: cannot tell which config this is ({which}); give --kind, one of {', '.join(KINDS)}")


def explain(path: str, key: str | None = None, kind: str | None = None,
            overrides: list[str] | None = None) -> tuple[str, list[Row]]:
    """The config's kind and its rows (those of `key` and below when given), loaded as its command loads it."""
    kind, file = config_kind(path, kind)
    model, load = _loaders()[kind]
    cfg = load(str(file), list(overrides or []))
    table = rows(model, cfg)
    if key is None:
        return kind, table
    picked = [r for r in table if r.key == key or r.key.startswith(key + ".")]
    if not picked:
        keys = [r.key for r in table]
        last = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(key, keys, n=5, cutoff=0.6)
        close += [k for k in keys if k.rsplit(".", 1)[-1] == last and k not in close][:5]
        hint = f"; close matches: {', '.join(close)}" if close else "; run without KEY to list every setting"
        raise ConfigError(f"{file}: no setting {key!r} in a {kind} config{hint}")
    return kind, picked


def _cell(value: Any, width: int = 28) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _summary(value: Any) -> str:
    """A block's cell: its settings are the rows below it."""
    return "{…}" if isinstance(value, dict) else "[…]" if isinstance(value, list) else _cell(value)


def render(table: list[Row], columns: int | None = None) -> str:
    """An aligned table of key, value and default, the help wrapped beside them, or under each row (indented) when
    fewer than 40 columns are left for it."""
    columns = columns or shutil.get_terminal_size((120, 24)).columns
    keys = [r.key for r in table]
    cells = []
    for r in table:
        show = _summary if any(k.startswith(r.key + ".") for k in keys) else _cell
        cells.append((r.key, show(r.value), "(required)" if r.required else show(r.default)))
    head = ("KEY", "VALUE", "DEFAULT")
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(3)]
    indent = sum(widths) + 6
    beside = columns - indent >= 40
    lines = []
    for (key, value, default), row in zip([head, *cells], [None, *table]):
        left = f"{key:<{widths[0]}}  {value:<{widths[1]}}  {default:<{widths[2]}}"
        if not beside:
            lines.append(left.rstrip())
            lines += ["    " + p for p in textwrap.wrap(row.help if row else "", columns - 4, break_on_hyphens=False)]
            continue
        parts = textwrap.wrap("HELP" if row is None else row.help, columns - indent, break_on_hyphens=False) or [""]
        lines.append(f"{left}  {parts[0]}".rstrip())
        lines += [" " * indent + p for p in parts[1:]]
    return "\n".join(lines)


@app.command("explain")
def explain_command(
    config: str = typer.Argument(..., help="A config YAML, or a name in configs/<kind>/."),
    key: Optional[str] = typer.Argument(None, help="One setting, dotted (e.g. grpo.beta); a block lists its "
                                                    "settings."),
    kind: Optional[str] = typer.Option(None, "--kind", help=f"The config's kind when its folder and keys do not "
                                                             f"tell: {', '.join(KINDS)}."),
    overrides: Optional[list[str]] = typer.Option(None, "--set", "-s", help="Config override key.path=value "
                                                                            "(repeat), as the command takes it."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as a JSON list."),
) -> None:
    """Print each setting of CONFIG (or only KEY) with its value, its default and what it does."""
    try:
        kind_, table = explain(config, key, kind, overrides)
    except ConfigError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"kind": kind_, "rows": [asdict(r) for r in table]}, indent=1))
    else:
        typer.echo(render(table))

"""What a registered piece of the GRPO step (a policy objective, an advantage estimator) says about the run's
settings, and the one check a config runs against it.

An entry names the `grpo` settings it reads (`settings`: exactly those reach it, as its own settings), the
conditions it needs (`requires`) and the ones it cannot work under (`refuses`), each a `Rule` on one dotted setting
of the run with the reason an error gives. The rules live with the entry; `check_choice`, called by the config's
validator, reads them from there. A setting another entry of the same registry reads, set away from its default
while the chosen entry neither reads it nor has a rule about it, is refused too: it would be silently ignored.

The registries follow m1/registry.py's rule (`add_entry`): a frozen spec per name, registering the same spec
again is a no-op, another spec under a taken name is refused.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any


@dataclass(frozen=True)
class Rule:
    """A condition on one setting of the run: `test(value)` of the setting at `setting` (dotted, as a config writes
    it: `grpo.loss_type`, `rollout.dynamic_sampling`)."""

    setting: str
    test: Callable[[Any], bool]
    why: str  # the reason, as the error states it


@dataclass(frozen=True, kw_only=True)
class Entry:
    """The part of a registered spec the config reads: its name, the `grpo` settings it reads, and its rules."""

    name: str
    settings: tuple[str, ...] = ()  # fields of the `grpo` block that reach it (its own settings)
    requires: tuple[Rule, ...] = ()  # each must hold
    refuses: tuple[Rule, ...] = ()  # none may hold

    def own_settings(self, grpo: Any) -> SimpleNamespace:
        """Its settings read off a `grpo` block (a GRPOSettings, or any object with those attributes)."""
        return SimpleNamespace(**{k: getattr(grpo, k) for k in self.settings})

    def concerns(self) -> set[str]:
        """The `grpo` settings it reads or has a rule about."""
        ruled = {r.setting.split(".", 1)[1] for r in (*self.requires, *self.refuses) if r.setting.startswith("grpo.")}
        return set(self.settings) | ruled


def setting_value(cfg: Any, dotted: str) -> Any:
    """The value of a dotted setting (`grpo.loss_type`) on a config object."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def check_choice(table: Mapping[str, Entry], chosen: str, key: str, cfg: Any, defaults: Mapping[str, Any]) -> None:
    """Raise ValueError when the entry `chosen` (the value of setting `key`, e.g. `grpo.objective`) cannot run
    under `cfg`: a rule it requires fails, a rule it refuses holds, or a `grpo` setting only other entries of
    `table` read is set away from its default (`defaults`: field -> default)."""
    entry = table[chosen]
    broken = [r for r in entry.requires if not r.test(setting_value(cfg, r.setting))]
    broken += [r for r in entry.refuses if r.test(setting_value(cfg, r.setting))]
    if broken:
        rule = broken[0]
        raise ValueError(f"{key} {chosen!r} cannot run with {rule.setting}={setting_value(cfg, rule.setting)!r}: "
                         f"{rule.why}")
    mine = entry.concerns()
    for name in sorted({s for e in table.values() for s in e.settings} - mine):
        value = getattr(cfg.grpo, name)
        if value != defaults[name]:
            readers = [e.name for e in table.values() if name in e.settings]
            raise ValueError(f"grpo.{name}={value!r} is not read by {key} {chosen!r}; leave it at its default "
                             f"({defaults[name]!r}) or choose one that reads it: {readers}")

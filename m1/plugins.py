"""Extensions from installed packages: a package names a module in the entry point group `m1.plugins`, and importing
that module registers what it adds (tools, team or seed kinds, credit rules, objectives, estimators: the register_*
functions docs/extending.md shows). Every `m1` command loads them before it runs (m1/errors.py GuardedGroup), so a
config on the command line can name what a plugin registered; Python callers import the module themselves."""
from __future__ import annotations

GROUP = "m1.plugins"


class PluginError(RuntimeError):
    """An installed plugin that does not import: the message names it, its package and what it raised."""


def load_plugins() -> list[str]:
    """Import every module of the `m1.plugins` entry points (once per process: imports are cached); returns their
    names."""
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=GROUP):
        try:
            ep.load()
        except Exception as exc:  # any error in a plugin's import is the plugin's, named as such
            package = ep.dist.name if ep.dist is not None else "an unknown package"
            raise PluginError(f"plugin {ep.name!r} ({ep.value}, from {package}) does not load: "
                              f"{type(exc).__name__}: {exc}; fix or uninstall it") from exc
        loaded.append(ep.name)
    return loaded

"""The package's imports point one way (DESIGN: a module never imports one listed above it): no cycles between
modules, counting imports inside functions; every package imports only its own layer and those below it (LAYERS,
written out in docs/layout.md), and inside m1/marl every sub-package and module only its own floor and those below
it (MARL_FLOORS, written out there too); and the models never import the synthetic world or the run layer."""
import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "m1"
LAYOUT = PKG.parent / "docs" / "layout.md"

# The package's layers, lowest first: a module may import from its own layer and the layers before it, never from a
# later one. A unit is a top-level module or package of m1/ ("m1" is m1/__init__.py); "cli" is the command layer:
# m1/cli.py and each package's cli.py that it mounts (m1/data/cli.py, m1/experiment/cli.py, m1/synth/cli.py), which
# may reach any layer. Units on one line are peers (they may import each other, never in a cycle).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("m1", "schema", "text", "files", "locks", "signature", "video", "plots", "registry", "errors", "signals", "evidence",
     "gc_pauses", "plugins", "config_files"),
    ("config", "attention_loss"),
    ("models", "contracts"),
    ("agents", "memory"),
    ("tools",),
    ("kinds",),
    ("team",),
    ("data",),
    ("trace", "trace_index", "results"),
    ("run",),
    ("marl", "synth", "pretrain"),
    ("experiment",),
    ("serve", "demo", "explain"),
    ("cli", "__main__"),
)
# (importing module, imported module) -> why this upward import stays. Empty: none does.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}

# m1/marl's floors, lowest first, checked the same way inside m1/marl: a unit is one of its sub-packages or one of
# its top-level modules ("__init__" is m1/marl/__init__.py), and an import from one m1/marl module to another runs
# only to its own floor or a lower one. Units on one floor are peers.
MARL_FLOORS: tuple[tuple[str, ...], ...] = (
    ("__init__", "entries", "rollout", "reward"),
    ("algo", "sft_examples", "team_training"),
    ("config",),
    ("plan", "preflight"),
    ("actor",),
    ("rollout_engines", "producer", "resolve", "checkpoint", "guard", "samples", "trackers", "view"),
    ("loop",),
    ("trainer", "parts", "launch", "sft"),
)
# (importing module, imported module) -> why this upward import inside m1/marl stays. Empty: none does.
MARL_UPWARD_ALLOWED: dict[tuple[str, str], str] = {}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the m1 modules it imports anywhere in its file (a `from m1.a import b` naming a submodule counts
    as importing m1.a.b)."""
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("m1")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("m1") and not node.level:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_models_do_not_import_the_world_or_the_run_layer():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.startswith(("m1.synth", "m1.run", "m1.marl", "m1.team")))
           for m, deps in graph.items() if m.startswith("m1.models")}
    assert {m: d for m, d in bad.items() if d} == {}


def unit(module: str) -> str:
    """The layer unit of an m1 module: its top-level package or module; a package's cli.py is the command layer."""
    parts = module.split(".")
    if len(parts) == 1:
        return "m1"
    if len(parts) > 2 and parts[-1] == "cli":
        return "cli"
    return parts[1]


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """Every (module, imported module) whose import runs to a later layer than the module's own."""
    rank = {u: i for i, line in enumerate(layers) for u in line}
    return sorted((m, d) for m, deps in graph.items() for d in deps if rank[unit(d)] > rank[unit(m)])


def test_every_package_has_a_layer():
    placed = {u for line in LAYERS for u in line}
    assert sorted({unit(m) for m in import_graph()} - placed) == [], "add the new package to LAYERS and docs/layout.md"
    assert len(placed) == sum(len(line) for line in LAYERS), "a unit named on two layers"


def test_no_import_runs_upward():
    """No import from a package to one above it, counting imports inside functions."""
    found = upward_imports(import_graph())
    assert [f for f in found if f not in UPWARD_ALLOWED] == []
    assert sorted(set(UPWARD_ALLOWED) - set(found)) == [], "an allowed upward import is gone: drop it from the list"


def test_the_checker_finds_an_upward_import():
    graph = {"m1.config": {"m1.tools"}, "m1.tools.browse": {"m1.config", "m1.tools"}, "m1.tools": set(),
             "m1.data.cli": {"m1.marl.sft"}, "m1.data.prepare": {"m1.marl.sft", "m1.data.loaders"},
             "m1.marl.sft": {"m1.data"}, "m1.data": set(), "m1.data.loaders": set()}
    layers = (("config",), ("tools",), ("data",), ("marl",), ("cli",))
    assert upward_imports(graph, layers) == [("m1.config", "m1.tools"), ("m1.data.prepare", "m1.marl.sft")]


def _doc_block(heading: str) -> list[list[str]]:
    """The words before the "|" of each line of the first code block under `heading` in docs/layout.md."""
    block = LAYOUT.read_text().split(heading, 1)[1].split("```")[1]
    return [line.split("|")[0].split() for line in block.strip().splitlines()]


def _unit_name(word: str) -> str:
    return re.sub(r"\.py$|/$", "", word)


def test_the_layers_are_written_in_the_layout_doc():
    """docs/layout.md's layer block ("N  unit unit ...  | what") names the same layers in the same order."""
    lines = _doc_block("## Layers")
    assert [int(line[0]) for line in lines] == list(range(len(LAYERS)))
    names = [tuple(_unit_name(u).replace("__init__", "m1") for u in line[1:]) for line in lines]
    assert names == list(LAYERS)


# ------------------------------------------------------------------------------------------------ inside m1/marl
def marl_unit(module: str) -> str | None:
    """The floor unit of an m1/marl module: its sub-package or top-level module of m1/marl; None outside m1/marl."""
    parts = module.split(".")
    if parts[:2] != ["m1", "marl"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def marl_upward_imports(graph: dict[str, set[str]], floors=MARL_FLOORS) -> list[tuple[str, str]]:
    """Every (m1/marl module, m1/marl module it imports) whose import runs to a higher floor than its own."""
    rank = {u: i for i, line in enumerate(floors) for u in line}
    return sorted((m, d) for m, deps in graph.items() if marl_unit(m) is not None for d in deps
                  if marl_unit(d) is not None and rank[marl_unit(d)] > rank[marl_unit(m)])


def test_every_marl_unit_has_a_floor():
    placed = {u for line in MARL_FLOORS for u in line}
    units = {marl_unit(m) for m in import_graph()} - {None}
    assert sorted(units - placed) == [], "add the new m1/marl module or sub-package to MARL_FLOORS and docs/layout.md"
    assert sorted(placed - units) == [], "a floor names a unit m1/marl no longer has"
    assert len(placed) == sum(len(line) for line in MARL_FLOORS), "a unit named on two floors"


def test_no_marl_import_runs_upward():
    """Inside m1/marl no import runs to a higher floor, counting imports inside functions."""
    found = marl_upward_imports(import_graph())
    assert [f for f in found if f not in MARL_UPWARD_ALLOWED] == []
    assert sorted(set(MARL_UPWARD_ALLOWED) - set(found)) == [], "an allowed upward import is gone: drop it"


def test_the_checker_finds_an_upward_marl_import():
    graph = {"m1.marl.algo.credit": {"m1.marl.rollout.episodes", "m1.config"},
             "m1.marl.rollout.episodes": {"m1.marl.config"}, "m1.marl.config": {"m1.marl.algo.credit"},
             "m1.marl": set(), "m1.config": {"m1.marl.trainer"}}
    floors = (("__init__", "rollout"), ("algo",), ("config",), ("trainer",))
    assert marl_upward_imports(graph, floors) == [("m1.marl.rollout.episodes", "m1.marl.config")]


def test_the_marl_floors_are_written_in_the_layout_doc():
    """docs/layout.md's floor block under "## Training floors" names the same floors in the same order."""
    lines = _doc_block("## Training floors")
    assert [int(line[0]) for line in lines] == list(range(len(MARL_FLOORS)))
    assert [tuple(_unit_name(u) for u in line[1:]) for line in lines] == list(MARL_FLOORS)

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
# Loads by name: a module that names a module of a higher layer in a string and imports it with importlib when a
# config asks for it. Each is a registration table entry (the table named here), so that the lower layer offers the
# choice without importing the higher one; no other module may name a higher layer's module. (importing module, named
# module) -> the table.
BY_NAME: dict[tuple[str, str], str] = {
    ("m1.models.hub", "m1.synth.vision"): "BACKENDS: (backend synth, vision) -> the synth vision model",
    ("m1.models.hub", "m1.synth.teacher"): "BACKENDS: (backend synth, chat) -> the rule-based teacher",
    ("m1.models.clip", "m1.synth.clip_train"): "NAMED_CLIPS: clip_name m1-synth -> the world's CLIP, trained once",
    ("m1.models.tiny", "m1.synth.corpus"): "CORPORA: a tiny tokenizer's corpus (synth, seed_kinds, reading)",
    ("m1.registry", "m1.kinds"): "SHIPPED_SEED_KINDS: the seed kinds register themselves on the first look-up",
}

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


def _module(path: Path, root: Path = PKG.parent) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
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


def named_modules(pkg: Path = PKG) -> set[tuple[str, str]]:
    """(module, m1 module named in one of its strings): the modules a file could import by name. A string naming
    the file's own module or one of its packages (a logger's name, an entry point group) is not a load."""
    found = set()
    for path in pkg.rglob("*.py"):
        me = _module(path, pkg.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"m1(\.[A-Za-z_]\w*)+", node.value)):
                continue
            target = pkg.parent.joinpath(*node.value.split("."))
            if (target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()) \
                    and not (me + ".").startswith(node.value + "."):
                found.add((me, node.value))
    return found


def test_every_upward_load_by_name_is_a_declared_registration():
    """importlib loads are invisible to the import graph: each one that reaches a higher layer is declared in
    BY_NAME (and written in docs/layout.md), and a declared one that is gone is dropped."""
    graph: dict[str, set[str]] = {}
    for m, d in named_modules():
        graph.setdefault(m, set()).add(d)
    upward = set(upward_imports(graph))
    assert sorted(upward - set(BY_NAME)) == [], "declare the load by name in BY_NAME and docs/layout.md, or import it"
    assert sorted(set(BY_NAME) - upward) == [], "a declared load by name is gone: drop it from BY_NAME"
    doc = LAYOUT.read_text().split("### Loads by name", 1)[1].split("\n## ", 1)[0]
    assert [(m, d) for m, d in BY_NAME if f"`{m}` -> `{d}`" not in doc] == []


def test_the_by_name_scan_finds_a_load_and_skips_a_logger_name(tmp_path):
    pkg = tmp_path / "m1"
    (pkg / "models").mkdir(parents=True)
    (pkg / "synth").mkdir()
    for f in ("__init__.py", "models/__init__.py", "synth/__init__.py", "synth/vision.py"):
        (pkg / f).write_text("")
    (pkg / "models" / "hub.py").write_text('import logging\nlog = logging.getLogger("m1.models")\n'
                                           'TABLE = {"synth": ("m1.synth.vision", "Model"), "x": "m1.nowhere"}\n')
    assert named_modules(pkg) == {("m1.models.hub", "m1.synth.vision")}


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

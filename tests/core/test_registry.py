"""The tool registry (m1/registry.py) is the one place a tool is named: everything else reads `TOOLS`.

A tool's name may still appear in prose (docstrings, error messages, the tiny tokenizer's corpus sentences, the
report legend "RB Rough / FB Fine Browser", whose bytes committed reports pin); what must not appear elsewhere is
the name as a string literal of its own, the spelling that would silently go stale when a tool is added or renamed.
"""
import ast
from functools import cache
from pathlib import Path

import pytest

from m1.registry import PAPER_TOOLS, TOOLS

M1 = Path(__file__).resolve().parents[2] / "m1"


@cache
def _modules() -> tuple[tuple[str, ast.Module], ...]:
    """(path as m1/..., its syntax tree) of every module of m1/, parsed once for the tests below."""
    return tuple((path.relative_to(M1.parent).as_posix(), ast.parse(path.read_text(), str(path)))
                 for path in sorted(M1.rglob("*.py")))


def _literal_homes(names=PAPER_TOOLS) -> dict[str, set[str]]:
    """name -> the modules of m1/ holding it as a whole string literal."""
    homes: dict[str, set[str]] = {t: set() for t in names}
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in homes:
                homes[node.value].add(rel)
    return homes


def test_each_paper_tool_is_spelled_out_in_the_registry_alone():
    assert len(PAPER_TOOLS) == 8
    assert _literal_homes() == {t: {"m1/registry.py"} for t in PAPER_TOOLS}


def test_each_agent_kind_is_spelled_out_in_one_place():
    """Kind names too: CPP in the registry, each seed kind in its own module (m1/kinds/<kind>.py, which holds all of
    it); everything else reads them through the registry."""
    from m1.registry import CPP, seed_kind_names

    assert _literal_homes((CPP,)) == {CPP: {"m1/registry.py"}}
    assert _literal_homes(seed_kind_names()) == {k: {f"m1/kinds/{k}.py"} for k in seed_kind_names()}


def test_each_seed_kind_tool_is_spelled_out_in_its_kind_alone():
    """A seed kind's tools (and those of its paper M1 cannot run) are named in its module; the loop, the config and
    the results read them from its spec or import its constant."""
    from m1.registry import seed_kind, seed_kind_names

    for kind in seed_kind_names():
        spec = seed_kind(kind)
        names = (*spec.tools, *spec.unavailable)
        assert _literal_homes(names) == {t: {f"m1/kinds/{kind}.py"} for t in names}


def kind_branches(tree: ast.AST, names: set[str], aliases: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each place `tree` branches on a seed kind by name: a comparison with one (`kind == ...`,
    `kind in (...)`, a `case`), a table keyed by one (a dict, or pairs whose first item is one), or a subscript by one
    (`TABLE[...]`). A name is the kind's string or an identifier bound to it (`aliases`: WEAVER = "weaver")."""

    def names_kind(node: ast.AST | None) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_kind(e) for e in node.elts)
        return (isinstance(node, ast.Name) and node.id in aliases) or (
            isinstance(node, ast.Attribute) and node.attr in aliases)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(names_kind(x) for x in (node.left, *node.comparators)):
            found.append((node.lineno, "comparison"))
        elif isinstance(node, ast.Dict) and any(names_kind(k) for k in node.keys):
            found.append((node.lineno, "dict keyed by kind"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and any(
                k.arg in names for k in node.keywords):
            found.append((node.lineno, "dict keyed by kind"))
        elif isinstance(node, (ast.Tuple, ast.List)) and any(
                isinstance(e, ast.Tuple) and e.elts and names_kind(e.elts[0]) for e in node.elts):
            found.append((node.lineno, "pairs keyed by kind"))
        elif isinstance(node, ast.Subscript) and names_kind(node.slice):
            found.append((node.lineno, "subscript by kind"))
        elif isinstance(node, ast.MatchValue) and names_kind(node.value):
            found.append((node.lineno, "case"))
    return found


def _kind_aliases(names: set[str]) -> set[str]:
    """Identifiers any module of m1/ binds to a seed kind's name (`A = "weaver"`, `A, B = "weaver", "sage"`)."""
    out = set()
    for _, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                out |= {t.id for t, v in pairs if isinstance(t, ast.Name) and isinstance(v, ast.Constant)
                        and v.value in names}
    return out


def test_no_module_but_its_own_branches_on_a_seed_kind():
    """A seed kind is one spec. Outside m1/kinds/<kind>.py nothing compares a kind with a seed kind's
    name or keeps a table keyed by them: the loop, the trainer, the rewards and M1-Synth read the kind's spec."""
    from m1.registry import seed_kind_names

    names = set(seed_kind_names())
    aliases = _kind_aliases(names)
    own = {f"m1/kinds/{k}.py" for k in names}
    found = {rel: hits for rel, tree in _modules() if rel not in own
             for hits in [kind_branches(tree, names, aliases)] if hits}
    assert found == {}


def test_the_branch_checker_finds_branches_on_a_seed_kind():
    code = """
if kind == WEAVER: pass
if kind in ("sage", "cpp"): pass
TABLE = {"zoomer": 1, other: 2}
LOOPS = dict(weaver=1)
x = SPECS[m.ZOOMER]
match kind:
    case "sage": pass
if kind == "timestamp" or kind == CPP: pass
MARKS = ((SAGE, ("<json>",)), (CPP, ()))
"""
    found = kind_branches(ast.parse(code), {"weaver", "zoomer", "sage"}, {"WEAVER", "ZOOMER", "SAGE"})
    assert sorted(found) == [(2, "comparison"), (3, "comparison"), (4, "dict keyed by kind"), (5, "dict keyed by kind"),
                             (6, "subscript by kind"), (8, "case"), (10, "pairs keyed by kind")]


def test_prompt_templates_outside_python_do_not_name_tools():
    """Prompt text lives in Python (m1/agents/prompts.py) and takes tool names from the registry; a template file
    that named a tool would be a second home."""
    texts = [p for p in M1.rglob("*") if p.is_file() and p.suffix in (".txt", ".j2", ".jinja", ".tmpl", ".prompt")]
    named = [(p.name, t) for p in texts for t in PAPER_TOOLS if t in p.read_text(errors="replace")]
    assert named == []


def test_paper_tools_keep_their_order_groups_and_short_names():
    """The order is the default tools.enabled and the tiny tokenizer's vocabulary: it must not move."""
    assert [(TOOLS[t].group, TOOLS[t].short) for t in PAPER_TOOLS] == [
        ("select", "GS"), ("select", "VR"), ("select", "TSR"), ("select", "IR"),
        ("browse", "RB"), ("browse", "FB"), ("browse", "ST"), ("browse", "GT")]
    assert [t for t in PAPER_TOOLS if TOOLS[t].clip] == [PAPER_TOOLS[1], PAPER_TOOLS[3]]
    assert all((TOOLS[t].model_attr is not None) == (TOOLS[t].group == "browse") for t in PAPER_TOOLS)


def test_a_browse_tool_resolves_its_vision_model_with_the_browser_as_fallback():
    from m1.config import ToolsConfig

    t = ToolsConfig(browser="b", grounding="g")
    assert {s.short: s.vision_model(t) for s in TOOLS.values() if s.name in PAPER_TOOLS} == {
        "GS": None, "VR": None, "TSR": None, "IR": None, "RB": "b", "FB": "b", "ST": "b", "GT": "g"}


def test_registering_a_name_twice_with_other_settings_is_refused():
    from dataclasses import replace

    from m1.registry import register_tool

    spec = TOOLS[PAPER_TOOLS[0]]
    assert register_tool(spec) is spec  # the same spec again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_tool(replace(spec, short="XX"))
    with pytest.raises(ValueError, match="unknown group"):
        register_tool(replace(spec, name="Odd Tool", group="zoom"))


# ------------------------------------------------------------------------------------------------ extending M1
@pytest.fixture
def registries():
    """Restore the tool, tool implementation, team kind, seed kind, credit, policy objective and advantage
    estimator registries after a test registers into them (they are module-level, mutated in place, and other tests
    count their entries)."""
    from m1 import registry
    from m1.marl.algo import advantages, credit, objectives
    from m1.team import engines_registry
    from m1.tools import browse, select

    registry.seed_kinds()  # M1's own seed kinds registered before the copy, so that restoring keeps them
    tables = (registry.TOOLS, registry.TOOL_NAMES, registry.SELECT_TOOLS, registry.BROWSE_TOOLS, registry.PLAN_KINDS,
              registry.SEED_KINDS, select.SELECT, browse.KIND, engines_registry.TEAM_KINDS, credit.CREDITS,
              objectives.OBJECTIVES, advantages.ESTIMATORS)
    saved = [type(x)(x) for x in tables]
    yield
    for live, old in zip(tables, saved):
        live.clear()
        live.update(old) if isinstance(live, dict) else live.extend(old)


DEPTH = "Depth Tool"  # a tool M1 does not ship, registered from here


def _register_depth():
    from m1.registry import ToolSpec, register_tool

    return register_tool(ToolSpec(DEPTH, "browse", "DT", "a vision model judges how far each object is.",
                                  aliases=("depth", "depthestimation"), model_attr="space",
                                  tokens_attr="space_tokens"))


def test_a_tool_registered_outside_m1_is_accepted_everywhere_names_are_read(registries):
    from m1.agents import parsers, prompts
    from m1.config import load_team
    from m1.experiment.rows import plan_name, tools
    from m1.models.preflight import BROWSE, _users, team_models
    from m1.registry import GLOBAL_SAMPLING
    from m1.schema import Question

    _register_depth()
    team = load_team("tiny", [f"tools.enabled=[{GLOBAL_SAMPLING.name}, {DEPTH}]"])
    assert team.tools.enabled == [GLOBAL_SAMPLING.name, DEPTH]
    assert parsers.tool_group(DEPTH) == "browse"
    assert parsers.canonical_tool("<depth estimation>", team.tools.enabled) == DEPTH
    assert parsers.parse_plan(f"##key info: x\n##tool use: <{GLOBAL_SAMPLING.name}>, <depth>",
                              team.tools.enabled).plan.tools == [GLOBAL_SAMPLING.name, DEPTH]
    q = Question(id="q", video="v.mp4", text="How far is the cup?", task="open")
    assert f"- {DEPTH}: a vision model judges how far each object is." in \
        prompts.plan_messages(q, team.tools.enabled)[0]["content"]
    assert plan_name((GLOBAL_SAMPLING.name, DEPTH), "+") == "GS+DT" and tools("GS+DT") == (GLOBAL_SAMPLING.name, DEPTH)
    # tools.space unset: the Depth Tool's vision model falls back to tools.browser, which preflight then checks
    assert BROWSE in team_models(team)["browser"][1] and "clip" not in team_models(team)
    assert DEPTH in _users(team, "browser")


def test_unknown_tool_and_credit_names_are_refused_naming_the_known_ones(registries):
    from m1.config import load_team
    from m1.marl.algo.credit import CREDITS, EpisodeCredit, register_credit
    from tests.marl.test_trainer import train_cfg

    _register_depth()

    @register_credit
    class LastWord(EpisodeCredit):
        """Credit only the last agent (a rule of this test's own)."""

        name = "last_word"

    assert CREDITS["last_word"] is LastWord
    assert train_cfg("/tmp/unused", rollout={"credit": "last_word"}).rollout.credit == "last_word"
    with pytest.raises(ValueError, match=r"rollout.credit: unknown rule 'lastword' \(known: \[.*'last_word'\]\)"):
        train_cfg("/tmp/unused", rollout={"credit": "lastword"})
    with pytest.raises(ValueError, match=r"tools.enabled: unknown tool 'Depth Tools' \(known: \[.*'Depth Tool'\]\)"):
        load_team("tiny", ["tools.enabled=[Depth Tools]"])
    with pytest.raises(ValueError, match="already registered"):
        register_credit(type("Other", (EpisodeCredit,), {"name": "last_word"}))


def test_the_registry_imports_nothing_from_m1():
    """m1/config.py validates against it, so it must sit below everything else in the package (M1's own seed kinds,
    which register themselves, it imports by name on the first look-up); the standard library only."""
    tree = ast.parse((M1 / "registry.py").read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert imported <= {"__future__", "dataclasses", "collections.abc", "typing", "importlib"}

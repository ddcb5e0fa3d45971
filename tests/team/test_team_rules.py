"""Topology sampling, aggregation rules and shared memory, on hand-built inputs."""
import random

from tests.conftest import is_dag
from m1.config import TopologyConfig
from m1.memory import SharedMemory
from m1.schema import AgentAnswer, Decision, Plan, Turn
from m1.team import aggregate, topology as topo

AGENTS = ["a", "b", "c", "d"]


def ans(agent, answer, reason=""):
    return AgentAnswer(agent=agent, answer=answer, reason=reason or f"{agent} thinks {answer}")


def test_complete_graph_at_inference():
    t = topo.sample(AGENTS, TopologyConfig(), random.Random(0))
    assert t.active == AGENTS and len(t.edges) == 12
    assert t.visible_to("a") == ["b", "c", "d"]


def test_random_dag_statistics_match_config():
    rng = random.Random(0)
    n, p, drop = 4000, 0.6, 0.2
    edges = actives = 0
    for _ in range(n):
        t = topo.random_dag(AGENTS, p, drop, rng)
        assert is_dag(t)
        assert t.active, "at least one agent stays active"
        for a, b in t.edges:
            assert a in t.active and b in t.active
        actives += len(t.active)
        edges += len(t.edges)
    # E[active] ~ 4 * 0.8 (+ tiny correction for the all-dropped case); E[edges] = C(k,2) * p
    assert abs(actives / n - 3.2) < 0.06
    exp_pairs = sum(__import__("math").comb(k, 2) * __import__("math").comb(4, k) * 0.8**k * 0.2**(4 - k)
                    for k in range(2, 5))
    assert abs(edges / n - exp_pairs * p) < 0.08


def test_random_dag_is_seeded():
    a = [topo.random_dag(AGENTS, 0.5, 0.3, random.Random(7)) for _ in range(2)]
    assert a[0] == a[1]


def test_majority_vote_and_tie_rule():
    order = AGENTS
    r = aggregate.vote([ans("a", "B"), ans("b", "C"), ans("c", "C"), ans("d", "A")], order)
    assert r.answer == "C" and not r.tie and r.counts == {"B": 1, "C": 2, "A": 1}
    r = aggregate.vote([ans("a", "B"), ans("b", "C"), ans("c", "C"), ans("d", "B")], order)
    assert r.tie and r.answer == "B" and r.tied == ["B", "C"]  # a (first in order) said B
    r = aggregate.vote([ans("d", "B"), ans("c", "C"), ans("b", "C"), ans("a", "B")], ["c", "a", "b", "d"])
    assert r.answer == "C"  # c comes first in this order
    r = aggregate.vote([ans("a", ""), ans("b", "D")], order)
    assert r.answer == "D" and not r.tie  # unreadable answers do not vote
    assert aggregate.vote([ans("a", "")], order).answer is None


def test_best_score_and_decide_by_agent():
    answers = [ans("a", "A"), ans("b", "B"), ans("c", "B")]
    assert aggregate.best_score(answers, {"a": -0.1, "b": -2.0, "c": None}, AGENTS) == "A"
    assert aggregate.best_score(answers, {}, AGENTS) == "B"  # no scores -> vote
    assert aggregate.decide_by_agent(answers, "a", AGENTS) == "A"
    assert aggregate.decide_by_agent(answers, "d", AGENTS) == "B"  # decider silent -> vote


def test_grounding_fallback_is_median_span():
    answers = [ans("a", "[1 - 5]"), ans("b", "[2 - 6]"), ans("c", "[10 - 12]"), ans("d", "garbage")]
    assert aggregate.fallback_answer("grounding", answers, AGENTS) == "[2 - 6]"
    assert aggregate.fallback_answer("grounding", [ans("a", "x")], AGENTS) is None


def test_agreeing_reason_keeps_only_consensus():
    text = aggregate.agreeing_reason([ans("a", "A", "red"), ans("b", "B", "blue"), ans("c", "A", "crimson")], "A")
    assert "red" in text and "crimson" in text and "blue" not in text


def test_memory_views_and_round_trip():
    mem = SharedMemory(AGENTS)
    mem.set_plan("a", Plan(key_info="the dog", tools=["Global Sampling", "Rough Browser"]))
    mem.add_turn("a", Turn(step=1, tool="Global Sampling", key_info="the dog", output="16 frames",
                           timestamps=[0.5, 10.0]))
    mem.set_decision("a", Decision(action="add_tool", tool="Fine Browser", key_info="the dog's collar"))
    mem.set_plan("b", Plan(key_info="x", tools=["Image Retrieval", "Rough Browser"]))
    mem.set_answer("b", "C", "seen")
    view = mem.view("c", ["a", "b"])
    assert "[a] plan" in view and "[b] answer: C" in view and "[c]" not in view
    assert "Fine Browser" in view and "collar" in view
    assert "[b]" not in mem.view("c", ["a"])
    assert mem["a"].key_info == "the dog's collar"
    back = SharedMemory.from_json(mem.to_json())
    assert back.to_dict() == mem.to_dict()

"""The trainer's numbers are pinned: a fixed tiny SFT run and a fixed two-step MARL run per credit strategy give
the figures recorded in tests/fixtures/trainer_losses.json.

The record pins the algorithm, whatever shape the code takes: a change of code that moves a loss, a gradient norm
or a reward here changes the algorithm. Counts and rewards (samples, tokens, rewards
and their means: integers or means of integers) must match exactly; losses and gradient norms match within the
tolerances stored beside the record (its `_tolerances`), set from the spread measured across CPUs and thread counts
(scripts/float_spread.py; tests/README.md, "Float records"). To re-record after an intended change:
`M1_RECORD_LOSSES=1 pytest tests/marl/test_trainer_regression.py` (and say why in the commit).
"""
import json
import os
from pathlib import Path

import pytest

from m1.marl.config import SFTConfig, TrainConfig
from m1.schema import Question

RECORD = Path(__file__).parents[1] / "fixtures" / "trainer_losses.json"
AGENTS = ["alpha", "beta"]
TINY = {"hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1}

pytestmark = pytest.mark.slow


def cpp_team():
    return {"name": "regression", "models": {
        "qa": {"interface": "chat", "device": "cpu", "tiny": {"arch": "qwen3", **TINY, "seed": 1}},
        "qb": {"interface": "chat", "device": "cpu", "tiny": {"arch": "qwen2", **TINY, "seed": 2}},
        "vlm": {"interface": "vision", "backend": "synth"}},
        "agents": [{"name": "alpha", "model": "qa"}, {"name": "beta", "model": "qb"}],
        "tools": {"enabled": ["Global Sampling", "Rough Browser"], "browser": "vlm", "global_frames": 4,
                  "rough_frames": 4},
        "limits": {"max_turns": 2, "max_tool_calls": 3, "plan_tokens": 12, "comm_tokens": 6, "answer_tokens": 8,
                   "summary_tokens": 8, "batch_episodes": 16}}


def weaver_team():
    return {"name": "regression_weaver", "models": {
        "policy": {"interface": "chat", "device": "cpu", "tiny": {"arch": "qwen3", **TINY, "seed": 3}},
        "vision": {"interface": "vision", "backend": "synth"}},
        "agents": [{"name": "weaver", "model": "policy", "kind": "weaver"}], "tools": {"browser": "vision"},
        "seed_system": {"glance_frames": 4, "max_turns": 2, "reply_tokens": 12}, "limits": {"batch_episodes": 16}}


class Breakdown:
    """A reward with an outcome part that differs between rollouts (random tiny models earn the same task
    rewards everywhere): total from all of an agent's tokens, outcome from its answers' tokens only."""

    def __init__(self, total, outcome):
        self.total, self.outcome = total, outcome


def varied_reward(episodes):
    out = []
    for e in episodes:
        names = {g.agent for g in e.generations}
        out.append({a: Breakdown(
            float(sum(sum(g.completion_ids) for g in e.generations if g.agent == a) % 7),
            float(sum(sum(g.completion_ids) for g in e.generations if g.agent == a and g.phase == "answer") % 3))
            for a in names})
    return out


# name -> (team, overrides of the MARL config); every strategy that survives the redesign has its run
MARL_CASES = {
    "episode": ("cpp", {}),
    "phase": ("cpp", {"rollout": {"credit": "phase"}}),
    "agent": ("cpp", {"rollout": {"credit": "agent"}}),
    "greedy_baseline": ("cpp", {"rollout": {"credit": "phase"}, "grpo": {"baseline": "greedy", "scale_rewards": False}}),
    "dynamic_sampling": ("cpp", {"rollout": {"dynamic_sampling": True, "max_refill": 1}}),
    "no_prompt_grad": ("cpp", {"rollout": {"topology": "complete"}, "learner": {"prompt_grad": False}}),
    "weaver": ("weaver", {}),
}


def marl_cfg(out, team, over, lr=1e-2):
    data = {"team": cpp_team() if team == "cpp" else weaver_team(),
            "rollout": {"num_generations": 2, "questions_per_step": 2},
            "grpo": {"beta": 0.05}, "judge": {"method": "rubric"},
            "learner": {"finetune": "full", "lr": lr, "micro_batch_size": 4, "max_completion_tokens": 16,
                        "max_prompt_tokens": 2048},
            "steps": 2, "seed": 7, "out_dir": str(out), "checkpoint": {"every": 2, "keep_last": 1},
            "log": {"progress": False, "backends": []}}
    for k, v in over.items():
        data[k] = {**data[k], **v}
    return TrainConfig.model_validate(data)


def questions(video, n=4):
    return [Question(id=f"q{i}", video=video, text=f"What colour is the square in scene {i}?",
                     options=["white", "red"], task="mcq", answer="A") for i in range(n)]


KEYS = ("loss", "reward/mean")
AGENT_KEYS = ("loss", "grad_norm", "samples", "reward")


def numbers(row, agents):
    out = {k: row[k] for k in KEYS if k in row}
    for a in agents:
        out.update({f"{a}/{k}": row[f"{a}/{k}"] for k in AGENT_KEYS if f"{a}/{k}" in row})
    return out


def run_marl(name, tmp_path, video, lr=1e-2):
    from m1.marl.parts import make_trainer

    team, over = MARL_CASES[name]
    tr = make_trainer(marl_cfg(tmp_path / name, team, over, lr), questions=questions(video),
                 reward_fn=varied_reward)
    try:
        return [numbers(r, tr.trained) for r in tr.train()]
    finally:
        tr.close()


def run_sft(tmp_path, lr=1e-2):
    from m1.marl.sft import SFTTrainer
    from m1.marl.sft_examples import SFTExample

    examples = [SFTExample(agent=a, question_id=f"q{i}", phase="plan",
                           messages=[{"role": "user", "content": f"Plan tools for question {i}."}],
                           completion=f"##key info: square {i}\n##tool use: <Global Sampling>, <Rough Browser>")
                for i in range(4) for a in AGENTS]
    team = cpp_team()
    cfg = SFTConfig.model_validate({
        "team": team, "data": {"examples": str(tmp_path / "sft" / "examples.jsonl")},
        "learner": {"finetune": "full", "lr": lr, "micro_batch_size": 4}, "epochs": 2, "batch_size": 4,
        "seed": 7, "out_dir": str(tmp_path / "sft"), "checkpoint": {"every": 4},
        "log": {"progress": False, "backends": []}})
    tr = SFTTrainer(cfg, examples=examples)
    return [{k: v for k, v in r.items() if k.endswith(("/loss", "/grad_norm", "/tokens"))} for r in tr.train()]


def mismatches(name, got):
    """Where `got` differs from the record of `name`: [] when every figure is within its tolerance."""
    record = json.loads(RECORD.read_text())
    want, tol = record[name], record["_tolerances"]
    if [sorted(r) for r in got] != [sorted(r) for r in want]:
        return [f"{name}: figures {[sorted(r) for r in got]} != {[sorted(r) for r in want]}"]
    out = []
    for step, (g, w) in enumerate(zip(got, want), 1):
        for k in w:
            t = tol.get(k.rsplit("/", 1)[-1], {})  # "alpha/grad_norm" -> the grad_norm tolerance; none: exact
            if g[k] != pytest.approx(w[k], abs=t.get("abs", 0.0), rel=t.get("rel", 0.0)):
                out.append(f"{name}, step {step}, {k}: {g[k]!r} != {w[k]!r} (tolerance {t or 'exact'})")
    return out


def check(name, got):
    if os.environ.get("M1_RECORD_LOSSES"):
        record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
        record[name] = got
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        return
    bad = mismatches(name, got)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", sorted(MARL_CASES))
def test_marl_losses_match_the_record(name, tmp_path, video, m1_cache):
    rows = run_marl(name, tmp_path, video)
    assert len(rows) == 2 and any(abs(r["loss"]) > 0 for r in rows), rows  # a step that trains on something
    check(f"marl/{name}", rows)


def test_sft_losses_match_the_record(tmp_path, m1_cache):
    rows = run_sft(tmp_path)
    assert len(rows) == 4
    check("sft", rows)


def test_a_one_percent_learning_rate_change_is_caught(tmp_path, video, m1_cache):
    """The tolerances are loose enough for other CPUs and tight enough for a real change: a learning rate 1% off
    moves the second step's figures of both pinned kinds of run outside them (the weaver run, whose figures move
    least, and the SFT run)."""
    sft = mismatches("sft", run_sft(tmp_path / "sft_lr", lr=1.01e-2))
    marl = mismatches("marl/weaver", run_marl("weaver", tmp_path / "marl_lr", video, lr=1.01e-2))
    assert sft and all(", step 1," not in m for m in sft), sft  # step 1 runs before any update: unchanged
    assert any("grad_norm" in m for m in sft) and any("/loss" in m for m in sft), sft
    assert any("weaver/loss" in m for m in marl) and any("weaver/grad_norm" in m for m in marl), marl

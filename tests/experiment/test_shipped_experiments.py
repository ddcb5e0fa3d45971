"""Every shipped experiment config loads with every arm's stage configs and eval team (`check_configs`, what
`m1 experiment run` does before anything runs), and the mini-base recipe's arms train what their comments say."""
from pathlib import Path

import pytest

from m1.config_files import CONFIG_DIR
from m1.experiment.config import load_experiment
from m1.experiment.stages import StageRun, check_configs, load_stage_config

EXPERIMENTS = sorted((CONFIG_DIR / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_every_shipped_experiment_resolves(path):
    check_configs(load_experiment(path))


def _sft(exp, arm):
    run = StageRun(arm, 0, "sft", exp.stage_dir(arm, 0, "sft"))
    return load_stage_config(exp, run)[0]


@pytest.mark.parametrize("name", ["mini_base_recipe", "mini_base_recipe_dev"])
def test_the_mini_base_recipe_starts_from_the_base_with_the_loss(name):
    exp = load_experiment(name)
    sft = _sft(exp, "sft")
    team = sft.team_config()
    assert sft.learner.attention.weight == 1.0 and sft.max_steps == 800
    base = (Path(__file__).parents[2] / "assets" / "mini_base").resolve()
    assert {Path(m.path).resolve() for k, m in team.models.items() if m.interface == "chat"} == {base}
    assert all(m.tiny is None for m in team.models.values() if m.interface == "chat")
    if "sft_plain" in exp.arms:
        plain = _sft(exp, "sft_plain")
        assert plain.learner.attention.weight == 0 and plain.team_config().models["qwen3_big"].path == \
            team.models["qwen3_big"].path
        assert exp.owner("sft_plain", "sft") == "sft_plain"  # its own SFT run, not the loss arm's
    if "random_sft" in exp.arms:
        rnd = _sft(exp, "random_sft")
        assert rnd.learner.attention.weight == 1.0 and rnd.team_config().models["qwen3_big"].tiny is not None
    if "sft_marl" in exp.arms:
        assert exp.owner("sft_marl", "sft") == "sft"  # MARL trains on from the loss arm's SFT


@pytest.mark.parametrize("kind", ["weaver", "zoomer", "sage"])
def test_each_seed_kind_student_starts_from_the_base_with_the_loss_on_dev_and_held_out(kind):
    base = (Path(__file__).parents[2] / "assets" / "mini_base").resolve()
    dev, held = load_experiment(f"seed_kinds_{kind}_dev"), load_experiment(f"seed_kinds_{kind}")
    for exp in (dev, held):
        sft = _sft(exp, "sft")
        policy = sft.team_config().models["policy"]
        assert sft.learner.attention.weight == 1.0 and policy.tiny is None and Path(policy.path).resolve() == base
    # the dev file trains the stages the held-out file's seed 0 reuses, and evaluates them on the dev world only
    assert dev.out_dir == held.out_dir and dev.rows_dir == held.rows_dir
    assert "dev" in dev.eval.questions and "test" in held.eval.questions and dev.eval.folder != held.eval.folder

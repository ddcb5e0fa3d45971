"""`m1 plot`: PNG training curves from a run's metrics.jsonl (the figures a run's keys allow)."""
import json

import pytest

from m1.plots import PlotError, figures, plot_run, read_metrics


def _write(run, rows, torn=False):
    run.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(text + ('{"step": 9, "lo' if torn else ""))


def test_marl_run_gets_reward_team_kl_and_agent_figures(tmp_path):
    from PIL import Image

    rows = [{"step": s, "loss": 0.1 / s, "reward/mean": 0.1 * s, "reward/total": 0.2 * s, "reward/res": 0.1 * s,
             "reward/format": 0.9, "reward/col": 0.3, "reward/team_res": -0.5 + 0.2 * s,
             "alpha/loss": 0.1, "alpha/kl": 0.01 * s, "alpha/reward": 0.5, "alpha/samples": 8,
             "beta/loss": 0.2, "beta/kl": None, "beta/reward": 0.4, "beta/samples": 8} for s in (1, 2, 3)]
    _write(tmp_path / "run", rows, torn=True)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]  # the torn line is left out
    figs = figures(read_metrics(tmp_path / "run"))
    assert set(figs) == {"rewards", "team_result", "loss", "kl", "agent_rewards"}
    assert [k for k, _ in figs["kl"]] == ["alpha/kl"]  # beta logged no finite KL
    paths = plot_run(tmp_path / "run")
    assert sorted(p.name for p in paths) == sorted(f"{n}.png" for n in figs)
    for p in paths:
        with Image.open(p) as im:
            assert im.size == (700, 400) and len(set(im.convert("L").getdata())) > 10  # a drawn chart


def test_async_run_gets_staleness_throughput_and_wait_figures():
    rows = [{"step": s, "loss": 0.1, "async/staleness": min(s - 1, 1), "throughput/episodes_per_s": 2.0,
             "throughput/tokens_per_s": 90.0, "time/wall": 3.0, "time/rollout": 2.5, "time/update": 2.0,
             "time/wait_rollout": 0.4, "time/wait_weights": 0.1} for s in (1, 2, 3)]
    figs = figures(rows)
    assert {"staleness", "throughput", "wait_times"} <= set(figs)
    assert figures(rows)["staleness"] == [("async/staleness", "versions behind the learners")]
    assert [k for k, _ in figs["wait_times"]] == ["time/wall", "time/rollout", "time/update", "time/wait_rollout",
                                                 "time/wait_weights"]
    sync = [{k: v for k, v in r.items() if not k.startswith(("async/", "time/wait"))} for r in rows]
    assert "staleness" not in figures(sync) and [k for k, _ in figures(sync)["wait_times"]] == [
        "time/wall", "time/rollout", "time/update"]


def test_decisions_per_family_are_drawn_as_running_means(tmp_path):
    from m1.plots import _series

    rows = [{"step": s, "loss": 0.1, "plans/entropy": 0.5, "plans/entropy/order": 0.1 * s,
             "revisions/rate": 0.2, "revisions/rate/order": 1.0 if s % 2 else 0.0} for s in range(1, 5)]
    rows[1]["plans/entropy/timestamp"] = 0.3  # a family drawn on one step only
    figs = figures(rows)
    assert figs["plan_entropy"] == [("plans/entropy/order", "order"), ("plans/entropy/timestamp", "timestamp")]
    assert figs["revisions"] == [("revisions/rate/order", "order")]
    assert _series(rows, "revisions/rate/order", window=2) == ([1, 2, 3, 4], [1.0, 0.5, 0.5, 0.5])
    assert _series(rows, "plans/entropy/timestamp", window=10) == ([2], [0.3])
    _write(tmp_path / "decisions", rows)
    assert {"plan_entropy.png", "revisions.png"} <= {p.name for p in plot_run(tmp_path / "decisions")}


def test_sft_run_and_errors(tmp_path):
    _write(tmp_path / "sft", [{"step": s, "loss": 2.0 / s, "alpha/loss": 2.0 / s, "alpha/nll": 2.0 / s,
                               "alpha/samples": 4} for s in (1, 2)])
    assert set(figures(read_metrics(tmp_path / "sft"))) == {"loss", "sft_nll"}
    with pytest.raises(PlotError, match="no metrics file"):
        read_metrics(tmp_path / "nothing")
    _write(tmp_path / "empty", [])
    with pytest.raises(PlotError, match="no steps logged"):
        read_metrics(tmp_path / "empty")


def test_m1_plot_command(tmp_path):
    from typer.testing import CliRunner

    from m1.cli import app

    _write(tmp_path / "run", [{"step": 1, "loss": 1.0, "alpha/loss": 1.0, "alpha/samples": 2},
                              {"step": 2, "loss": 0.5, "alpha/loss": 0.5, "alpha/samples": 2}])
    res = CliRunner().invoke(app, ["plot", str(tmp_path / "run")])
    assert res.exit_code == 0 and res.output.split() == [str(tmp_path / "run" / "plots" / "loss.png")]
    res = CliRunner().invoke(app, ["plot", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "no metrics file" in res.output

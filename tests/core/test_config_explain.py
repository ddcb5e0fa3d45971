"""Every config setting carries its help (`Field(description=...)`), and `m1 config explain` shows it with the value
and the default of a real config file."""
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from m1.cli import app
from m1.config_files import ConfigError
from m1.explain import KINDS, _loaders, _model_classes, explain

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _walk(model, seen):
    """(model, field name, field) of `model` and of every block it nests, each model once."""
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        yield model, name, field
        for nested in _model_classes(field.annotation):
            yield from _walk(nested, seen)


def test_every_setting_of_every_config_has_help():
    seen, missing, count = set(), [], 0
    for kind in KINDS:
        for model, name, field in _walk(_loaders()[kind][0], seen):
            count += 1
            if not (field.description or "").strip():
                missing.append(f"{model.__name__}.{name}")
    assert not missing, f"settings without Field(description=...): {missing}"
    assert count > 150  # the walk reached the nested blocks (models, learner, grpo, ...)


def test_deprecated_settings_name_their_removal():
    seen = set()
    for kind in KINDS:
        for model, name, field in _walk(_loaders()[kind][0], seen):
            text = (field.description or "") + (model.__doc__ or "")
            if "deprecat" in text.lower():
                assert "removed in M1 0." in text or "goes in M1 0." in text, f"{model.__name__}.{name}"
    with pytest.warns(FutureWarning, match=r"removed in M1 0\.2\.0"):
        from m1.marl.config import LogConfig
        LogConfig.model_validate({"tensorboard": False})


def test_explain_prints_value_default_and_help():
    res = CliRunner().invoke(app, ["config", "explain", str(CONFIGS / "marl" / "mini.yaml"), "grpo.beta"])
    assert res.exit_code == 0, res.output
    from m1.marl.config import GRPOSettings
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["KEY", "VALUE", "DEFAULT", "HELP"] or lines[0].split() == ["KEY", "VALUE", "DEFAULT"]
    assert lines[1].split()[:3] == ["grpo.beta", "0.0", "1e-05"]  # the file sets beta 0; the default is 1e-5
    help_text = GRPOSettings.model_fields["beta"].description
    assert " ".join(help_text.split()) in " ".join(res.stdout.split())


def test_a_block_lists_its_settings_with_defaults_of_its_parent():
    """SFT's learner block defaults to a full fine-tune at lr 1e-6: its children show those defaults."""
    kind, rows = explain(str(CONFIGS / "sft" / "mini.yaml"), "learner")
    assert kind == "sft" and rows[0].key == "learner"
    by_key = {r.key: r for r in rows}
    assert by_key["learner.lr"].default == 1e-6 and by_key["learner.finetune"].default == "full"
    assert "learner.lora.r" in by_key and all(r.key.startswith("learner") for r in rows)
    _, rows = explain(str(CONFIGS / "team" / "mini.yaml"), "agents.0")
    assert [r.key for r in rows][:2] == ["agents.0.name", "agents.0.model"]


def test_unknown_key_names_close_matches():
    res = CliRunner().invoke(app, ["config", "explain", str(CONFIGS / "marl" / "mini.yaml"), "grpo.bta"])
    assert res.exit_code == 2
    assert "no setting 'grpo.bta'" in res.output and "close matches: grpo.beta" in res.output
    with pytest.raises(ConfigError, match="learner.max_prompt_tokens"):
        explain(str(CONFIGS / "marl" / "mini.yaml"), "max_prompt_token")


def test_json_rows_parse():
    res = CliRunner().invoke(app, ["config", "explain", str(CONFIGS / "pretrain" / "mini_base.yaml"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["kind"] == "pretrain"
    rows = {r["key"]: r for r in data["rows"]}
    assert rows["lr"]["value"] == 1e-3 and rows["student.hidden_size"] == {
        "key": "student.hidden_size", "value": 128, "default": 64, "required": False,
        "help": "Width of the hidden states."}
    assert rows["out_dir"]["required"] and all(r["help"] for r in data["rows"])


def test_kind_from_folder_contents_or_flag(tmp_path):
    pretrain = yaml.safe_load((CONFIGS / "pretrain" / "mini_base.yaml").read_text())
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(pretrain))
    assert explain(str(tmp_path / "base.yaml"), "steps")[0] == "pretrain"  # only a pretrain config has `student`
    (tmp_path / "run.yaml").write_text("team: mini\n")  # a MARL or an SFT run
    res = CliRunner().invoke(app, ["config", "explain", str(tmp_path / "run.yaml")])
    assert res.exit_code == 2 and "it could be marl or sft" in res.output
    assert "--kind, one of team, marl, sft, pretrain" in res.output
    res = CliRunner().invoke(app, ["config", "explain", str(tmp_path / "run.yaml"), "steps", "--kind", "marl"])
    assert res.exit_code == 0 and res.stdout.splitlines()[1].split()[:3] == ["steps", "200", "200"]
    res = CliRunner().invoke(app, ["config", "explain", "mini"])  # the name is in several configs/ folders
    assert res.exit_code == 2 and "--kind {team,marl,sft}" in res.output
    res = CliRunner().invoke(app, ["config", "explain", "mini", "--kind", "bogus"])
    assert res.exit_code == 2 and "choose one of team, marl, sft, pretrain" in res.output


def test_overrides_apply_as_in_the_command():
    _, rows = explain("mini", "grpo.beta", "marl", ["grpo.beta=0.5"])
    assert rows[0].value == 0.5 and rows[0].default == 1e-5

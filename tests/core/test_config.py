import pytest

from m1.config import TeamConfig, load_team
from m1.config_files import CONFIG_DIR, ConfigError


def test_shipped_configs_load():
    tiny = load_team("tiny")
    assert [a.name for a in tiny.agents] == ["qwen3_big", "qwen3_small", "qwen2_big", "qwen2_small"]
    paper = load_team("videochat_m1")
    assert paper.models["qwen3_8b"].path == "Qwen/Qwen3-8B"
    assert paper.models["browser"].path == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert paper.models["clip"].clip_name == "ViT-B-16"
    assert paper.summarizer == "qwen3_8b"


def test_dotted_overrides_change_values():
    cfg = load_team("tiny", ["limits.max_turns=2", "agents.1.temperature=0.7", "topology.mode=random",
                             "tools.enabled=[Global Sampling, Rough Browser]"])
    assert cfg.limits.max_turns == 2 and cfg.agents[1].temperature == 0.7
    assert cfg.topology.mode == "random" and cfg.tools.enabled == ["Global Sampling", "Rough Browser"]


def test_greedy_copy_drops_every_temperature_and_keeps_the_rest():
    cfg = load_team("tiny", ["sampling.temperature=1.0", "agents.1.temperature=0.7"])
    greedy = cfg.greedy()
    assert greedy.sampling.temperature == 0.0 and [a.temperature for a in greedy.agents] == [None] * len(cfg.agents)
    assert [a.name for a in greedy.agents] == [a.name for a in cfg.agents] and greedy.models == cfg.models
    assert cfg.sampling.temperature == 1.0 and cfg.agents[1].temperature == 0.7  # the original is untouched


@pytest.mark.parametrize("override, words", [
    (["limits.max_turnz=2"], ["unknown key", "limits.max_turnz", "tiny.yaml"]),
    (["limits.max_turns=many"], ["limits.max_turns", "tiny.yaml"]),
    (["agents.0.model=nope"], ["agents.0.model", "nope"]),
    (["tools.browser=q3_big"], ["tools.browser", "chat model"]),
    (["tools.enabled=[Magic Tool]"], ["Magic Tool"]),
    (["aggregation.summarizer=ghost"], ["ghost"]),
    (["agents.9.model=x"], ["agents.9"]),
    (["novalue"], ["key.path=value"]),
])
def test_bad_config_named_before_models_load(override, words):
    with pytest.raises(ConfigError) as err:
        load_team("tiny", override)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_unknown_key_in_file_names_file_and_key(tmp_path):
    p = tmp_path / "team.yaml"
    p.write_text("name: x\nmodels: {m: {interface: chat, path: a/b, colour: red}}\nagents: [{name: a, model: m}]\n")
    with pytest.raises(ConfigError) as err:
        load_team(p)
    assert str(p) in str(err.value) and "models.m.colour" in str(err.value)


def test_missing_config_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_team(tmp_path / "none.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_team(p)


def test_model_needs_a_source():
    with pytest.raises(Exception, match="path"):
        TeamConfig.model_validate({"name": "x", "models": {"m": {"interface": "chat"}},
                                   "agents": [{"name": "a", "model": "m"}]})


def test_enabled_tools_need_both_groups():
    with pytest.raises(ConfigError, match="select tool and one browse tool"):
        load_team("tiny", ["tools.enabled=[Global Sampling, Image Retrieval]"])


def test_model_path_relative_to_the_yaml(tmp_path, monkeypatch):
    """`./x` model paths follow the YAML file; hub ids and plain relative paths are kept as written."""
    import yaml

    data = yaml.safe_load((CONFIG_DIR / "team" / "tiny.yaml").read_text())
    chat = next(k for k, m in data["models"].items() if m["interface"] == "chat")
    other = next(k for k, m in data["models"].items() if m["interface"] == "chat" and k != chat)
    for key, path in ((chat, "./weights/agent"), (other, "Qwen/Qwen3-8B")):
        data["models"][key].pop("tiny", None)
        data["models"][key]["path"] = path
    data["models"][other]["adapter"] = "../runs/marl/agents/b/adapter"
    folder = tmp_path / "cfgs"
    folder.mkdir()
    (folder / "team.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # somewhere else than the YAML's folder
    cfg = load_team(folder / "team.yaml")
    assert cfg.models[chat].path == str(folder / "weights" / "agent")
    assert cfg.models[other].path == "Qwen/Qwen3-8B"
    assert cfg.models[other].adapter == str(tmp_path / "runs" / "marl" / "agents" / "b" / "adapter")
    assert cfg.models[chat].adapter is None and "adapter" not in cfg.recorded()["models"][chat]


@pytest.mark.parametrize("spec", [{"interface": "vision", "path": "Qwen/Qwen2.5-VL-7B-Instruct"},
                                  {"interface": "chat", "backend": "openai", "path": "gpt-4o"}])
def test_adapter_only_on_local_chat_backends(spec):
    with pytest.raises(Exception, match="`adapter` applies to chat models of backend hf or vllm"):
        TeamConfig.model_validate({"name": "x", "models": {"m": {**spec, "adapter": "runs/a"}},
                                   "agents": [{"name": "a", "model": "m"}]})


def test_remote_code_and_flash_attention_settings_reach_the_loader():
    """trust_remote_code passes to from_pretrained (the paper's InternVL3.5 entry sets it, as does Eagle2.5's with
    backend eagle); flash_attention_2 needs bf16/fp16 weights; on a GPU the weights load straight onto it."""
    from m1.config import ModelSpec, load_team
    from m1.config_files import ConfigError
    from m1.models.hf import _model_kwargs

    team = load_team("videochat_m1")
    assert team.models["space"].trust_remote_code and not team.models["grounding"].trust_remote_code
    assert not team.models["qwen3_8b"].trust_remote_code
    assert "trust_remote_code" not in team.models["qwen3_8b"].recorded()  # off: left out of signatures
    kw = _model_kwargs(team.models["space"], "cuda:0", local_only=True)
    assert kw["trust_remote_code"] is True and kw["device_map"] == {"": "cuda:0"}
    assert "device_map" not in _model_kwargs(team.models["space"], "cpu", local_only=True)
    with pytest.raises(ValueError, match="flash_attention_2 runs only on bfloat16/float16"):
        ModelSpec(interface="chat", path="x", attn_implementation="flash_attention_2")
    ModelSpec(interface="chat", path="x", attn_implementation="flash_attention_2", dtype="bfloat16")
    with pytest.raises(ConfigError, match="flash_attention_2"):
        load_team("videochat_m1", ["models.qwen3_4b.attn_implementation=flash_attention_2",
                                   "models.qwen3_4b.dtype=float32"])


@pytest.mark.slow
def test_a_wheel_install_finds_the_configs_and_the_demo_team(tmp_path):
    """`pip install .` (not editable): configs/ and the trained mini team travel in the wheel as package data."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "whl"), str(repo)],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "whl").glob("m1-*.whl"))
    subprocess.run(pip + ["install", "-q", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], check=True,
                   capture_output=True)
    probe = ("import m1.config as c, m1.config_files as f, os; t = c.load_team('mini_trained'); "
             "print(f.CONFIG_DIR); print(os.path.isfile(os.path.join(t.models['qwen3_big'].path, 'config.json')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}).stdout.split()
    assert out == [str(tmp_path / "site" / "m1" / "configs"), "True"]


def test_bad_bytes_folders_and_override_typos_are_named(tmp_path):
    p = tmp_path / "team.yaml"
    p.write_bytes(b"name: x\n# caf\xe9\nmodels: {}\n")
    with pytest.raises(ConfigError) as err:
        load_team(p)
    assert str(err.value) == f"{p}:2: not UTF-8 text (byte 0xe9); save the file as UTF-8"
    with pytest.raises(ConfigError, match=f"{tmp_path}: is a folder; give a YAML config file"):
        load_team(tmp_path)
    with pytest.raises(ConfigError) as err:  # the typo is the override's, not the shipped file's
        load_team("tiny", ["sampling.seed=3", "limits.max_turnz=2"])
    assert str(err.value) == (f"override 'limits.max_turnz=2': unknown key 'limits.max_turnz'; the override applies "
                              f"to {CONFIG_DIR / 'team' / 'tiny.yaml'}")
    with pytest.raises(ConfigError) as err:
        load_team("tiny", ["limits.max_turns=many"])
    assert str(err.value).startswith("override 'limits.max_turns=many': limits.max_turns: Input should be a valid")
    p.write_text("name: x\nmodels: {m: {interface: chat, path: a/b, colour: red}}\nagents: [{name: a, model: m}]\n")
    with pytest.raises(ConfigError) as err:  # a key of the file stays the file's, whatever else is overridden
        load_team(p, ["name=y"])
    assert str(err.value) == f"{p}: unknown key 'models.m.colour'"


def test_a_renamed_field_reads_its_earlier_name_and_records_it():
    """`models.*.interface` and `judge.method` were both `kind`: files and checkpoints written before read as before,
    both names at once are refused, and identities record the earlier name, so stored records stay current."""
    from m1.config import ModelSpec
    from m1.marl.config import JudgeConfig

    old = ModelSpec.model_validate({"kind": "vision", "backend": "synth"})
    assert old == ModelSpec(interface="vision", backend="synth") and old.interface == "vision"
    with pytest.raises(ValueError, match="`kind` is the earlier name of `interface`: give `interface` only"):
        ModelSpec.model_validate({"kind": "chat", "interface": "chat", "backend": "synth"})
    assert old.recorded()["kind"] == "vision" and "interface" not in old.recorded()
    assert old.model_dump()["interface"] == "vision"  # what the code and `m1 config explain` read
    judge = JudgeConfig.model_validate({"kind": "llm", "model": {"kind": "chat", "backend": "synth"}})
    assert judge.method == "llm" and judge.model.interface == "chat"
    assert judge.recorded()["kind"] == "llm" and judge.recorded()["model"]["kind"] == "chat"
    with pytest.raises(ConfigError, match="override 'models.qwen3_big.kind=vision'.*give `interface` only"):
        load_team("mini", ["models.qwen3_big.kind=vision"])  # the file says `interface`: one name per field

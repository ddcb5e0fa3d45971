"""The model check before anything loads (m1/models/preflight.py): `m1 train --plan`, `m1 sft --plan`, `m1 infer` and
the start of `m1 train` / `m1 sft` build every model's class from its config on the meta device and load its
tokenizer/processor, and a model that cannot be built stops the command with one `error:` line naming it, before any
weights load or a training run takes its output folder."""
import json
import shutil

import pytest
import yaml

from m1.config import ModelSpec, TinySpec, load_team
from m1.models.preflight import AGENT, BROWSE, CLIP, VLM_POLICY, check_model, check_models, require, team_models, \
    PreflightError


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Model folders with a config and tokenizer/processor but no weights file: a chat model, a Qwen2.5-VL, a LLaVA
    (natively supported, but its processor has no video processor) and a chat model of an unknown model_type."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaConfig, LlavaProcessor

    from m1.models.tiny import ensure_tiny

    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, arch in (("chat", "qwen2"), ("vl", "qwen2_5_vl")):
        built = ensure_tiny(TinySpec(arch=arch, hidden_size=32, layers=1, heads=2, kv_heads=1), root / "cache")
        out[name] = root / name
        shutil.copytree(built, out[name], ignore=shutil.ignore_patterns("*.safetensors"))
    out["unknown"] = root / "unknown"
    shutil.copytree(out["chat"], out["unknown"])
    cfg = json.loads((out["unknown"] / "config.json").read_text())
    cfg.update(model_type="not_a_model", architectures=["NotAModelForCausalLM"])
    (out["unknown"] / "config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(out["vl"])
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    out["llava"] = root / "llava"
    LlavaConfig(text_config={"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
                             "vocab_size": len(tok)},
                vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "intermediate_size": 64, "image_size": 28, "patch_size": 14},
                image_token_index=tok.convert_tokens_to_ids("<image>")).save_pretrained(out["llava"])
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                   chat_template=tok.chat_template).save_pretrained(out["llava"])
    for folder in out.values():
        assert not list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))
    return out


def _team(tmp_path, agent: str, browser: str, name="team.yaml"):
    """A one-agent team YAML whose agent and browse tool load from the given paths."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump({
        "name": "t",
        "models": {"agent": {"interface": "chat", "backend": "hf", "path": str(agent), "device": "cpu"},
                   "browser": {"interface": "vision", "backend": "hf", "path": str(browser), "device": "cpu"}},
        "agents": [{"name": "a1", "model": "agent"}],
        "tools": {"browser": "browser", "enabled": ["Global Sampling", "Rough Browser", "Grounding Tool"]}}))
    return path


def _cli(*args):
    from typer.testing import CliRunner

    from m1.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output  # stdout and stderr as the terminal shows them


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load (a ModelHub build or a from_pretrained of a model class) fails the test."""
    import transformers

    from m1.models.hub import ModelHub

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(ModelHub, "_build", refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


def test_folders_with_config_but_no_weights_pass_and_the_plan_is_printed(folders, tmp_path, no_loading):
    team = load_team(_team(tmp_path, folders["chat"], folders["vl"]))
    checks = require(check_models(team_models(team)))
    assert [(c.key, c.status, c.roles) for c in checks] == [("agent", "ok", (AGENT,)), ("browser", "ok", (BROWSE,))]
    assert "Qwen2ForCausalLM" in checks[0].why and "Qwen2_5_VLProcessor" in checks[1].why
    code, out = _cli("train", "--config", "mini", "--plan", "--gpus", "1", "--gpu-mem", "80",
                     "--set", f"team={_team(tmp_path, folders['chat'], folders['vl'])}", "--set", "team_overrides=[]")
    assert code == 0, out
    assert "fits: yes" in out and "models checked (class built from the config" in out and "agent, browser" in out


@pytest.mark.parametrize("case", ["unknown", "llava", "missing"])
def test_each_command_refuses_a_model_that_cannot_be_built_in_one_line(case, folders, tmp_path, video_factory,
                                                                       no_loading):
    agent, browser = folders["chat"], folders["vl"]
    if case == "unknown":
        agent, key, why = folders["unknown"], "agent", "model_type 'not_a_model', which transformers"
    elif case == "llava":
        browser, key, why = folders["llava"], "browser", "LlavaProcessor has no video_processor"
    else:
        agent, key, why = tmp_path / "no_such_model", "agent", "no_such_model is not a folder"
    team = _team(tmp_path, agent, browser)
    video_factory("v.mp4", seconds=2)
    runs = {"train --plan": ("train", "--config", "mini", "--plan", "--gpus", "1", "--gpu-mem", "80",
                             "--set", f"team={team}", "--set", "team_overrides=[]"),
            "sft --plan": ("sft", "--config", "mini", "--plan", "--gpus", "1", "--gpu-mem", "80",
                           "--set", f"team={team}", "--set", "data.teacher=null"),
            "infer": ("infer", tmp_path, "-q", "What happens?", "--team", team, "--out", tmp_path / "r.jsonl"),
            "train": ("train", "--config", "mini", "--set", f"team={team}", "--set", "team_overrides=[]",
                      "--set", f"out_dir={tmp_path / 'run'}"),
            "sft": ("sft", "--config", "mini", "--set", f"team={team}", "--set", "data.teacher=null",
                    "--set", f"out_dir={tmp_path / 'run'}")}
    for name, args in runs.items():
        code, out = _cli(*args)
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and len(out.strip().splitlines()) == 1, (name, out)
        assert f"model {key!r}" in errors[0] and why in errors[0], (name, out)
    assert not (tmp_path / "r.jsonl").exists() and not (tmp_path / "run").exists()


def test_eagle_through_automodel_for_image_text_to_text_is_refused_without_its_files(empty_hf_cache):
    """The paper's grounding entry (Eagle2.5 via HFVisionModel) is refused by --plan, not when the driver loads it:
    its public config is known, so the plan refuses it offline, naming backend eagle."""
    code, out = _cli("train", "--config", "videochat_m1_full", "--plan", "--gpus", "24", "--gpu-mem", "80",
                     "--set", "team_overrides=[models.grounding.path=nvidia/Eagle2.5-8B,"
                                              "models.grounding.trust_remote_code=true]")
    assert code == 2, out
    assert out.startswith("error: model 'grounding' (nvidia/Eagle2.5-8B, browse tool): AutoModelForImageTextToText "
                          "cannot build it: model_type 'eagle_2_5_vl'") and "backend: eagle" in out
    assert len(out.strip().splitlines()) == 1
    sets = ["models.grounding.backend=eagle", "models.grounding.path=nvidia/Eagle2.5-8B",
            "models.grounding.trust_remote_code=true"]
    code, out = _cli("train", "--config", "videochat_m1_full", "--plan", "--gpus", "24", "--gpu-mem", "80",
                     "--set", f"team_overrides=[{','.join(sets)}]")
    assert code == 0 and "driver  grounding" in out and "fits: yes" in out, out  # backend eagle: a GPU of its own
    eagle = load_team("videochat_m1", sets)
    checks = {c.key: c for c in check_models(team_models(eagle))}
    assert checks["grounding"].status == "class" and "AutoModel builds model_type 'eagle_2_5_vl'" in \
        checks["grounding"].why
    assert {c.status for c in checks.values()} == {"class", "skipped"}  # every model checked by class, CLIP skipped


def test_shipped_team_grounds_with_a_native_vlm_and_the_plan_names_what_it_checked(empty_hf_cache):
    code, out = _cli("train", "--config", "videochat_m1_full", "--plan", "--gpus", "24", "--gpu-mem", "80")
    assert code == 0, out
    assert "driver  grounding" in out
    assert "models checked by class only (their hub files are not in the cache): qwen3_8b, qwen3_4b, qwen25_7b, " \
           "qwen25_3b, browser, space, grounding" in out
    team = load_team("videochat_m1")
    assert team.models["grounding"].path == "Qwen/Qwen2.5-VL-7B-Instruct" and team.models["grounding"].backend == "hf"


def test_roles_decide_what_a_processor_must_have(folders, empty_hf_cache):
    """A seed kind's VLM policy needs an image processor; backend eagle serves the browse tools only; an unknown
    hub id is reported as not checked (nothing is downloaded), a refused one raises PreflightError."""
    assert check_model("p", ModelSpec(interface="vision", path=str(folders["vl"])), {VLM_POLICY, BROWSE}).status == "ok"
    eagle = ModelSpec(interface="vision", backend="eagle", path="nvidia/Eagle2.5-8B", trust_remote_code=True)
    refused = check_model("p", eagle, {VLM_POLICY})
    assert refused.status == "refused" and "backend eagle serves the browse tools only" in refused.why
    with pytest.raises(PreflightError, match=r"^model 'p' \(nvidia/Eagle2.5-8B, vlm policy\): backend eagle"):
        require([refused])
    unknown = check_model("x", ModelSpec(interface="chat", path="someone/some-model"), {AGENT})
    assert unknown.status == "unchecked" and "not in the Hugging Face cache" in unknown.why
    bad_tiny = check_model("t", ModelSpec(interface="vision", tiny={"arch": "qwen2"}), {BROWSE})
    assert bad_tiny.status == "refused" and "tiny arch 'qwen2' is not a vision model" in bad_tiny.why


def test_a_cached_hub_id_is_checked_from_its_files_and_missing_tokenizer_files_are_named(folders, empty_hf_cache,
                                                                                          tmp_path):
    """A hub id whose files are in the HF cache is checked like a folder (offline, nothing downloaded); without its
    tokenizer files it is checked by class only (the run fetches them), while a folder without them is refused
    (transformers 5 would build a one-token tokenizer from it, without an error)."""
    import huggingface_hub.constants

    repo = tmp_path / "hf_cache" / "models--someone--tiny-chat"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(folders["chat"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert huggingface_hub.constants.HF_HUB_CACHE == str(tmp_path / "hf_cache")
    spec = ModelSpec(interface="chat", path="someone/tiny-chat")
    ok = check_model("x", spec, {AGENT})
    assert ok.status == "ok" and "Qwen2ForCausalLM from its config; tokenizer with a chat template" in ok.why
    for f in snapshot.glob("tokenizer*"):
        f.unlink()
    partial = check_model("x", spec, {AGENT})
    assert partial.status == "class" and "no tokenizer files" in partial.why and "the run fetches them" in partial.why
    bare = tmp_path / "bare"
    shutil.copytree(folders["chat"], bare, ignore=shutil.ignore_patterns("tokenizer*"))
    refused = check_model("x", ModelSpec(interface="chat", path=str(bare)), {AGENT})
    assert refused.status == "refused" and "its tokenizer has 1 token(s)" in refused.why
    wrong = check_model("c", ModelSpec(interface="clip", backend="hf", path=str(bare)), {CLIP})
    assert (wrong.status, wrong.why) == ("refused", "backend 'hf' has no clip models")

"""Rollout engines over HTTP (m1/models/vllm_client.py, launched by m1/models/vllm_server.py) against the CPU stand-in server (tests/engine_standin.py).

The stand-in serves a tiny random Qwen3 model behind vLLM's endpoints and JSON shapes; the learner loads the same
folder, so every log-prob the engine returns can be checked against `Actor.compute_logprobs`.
"""
from __future__ import annotations

import math
import socket
import sys
import time
from pathlib import Path

import pytest

from m1.config import ModelSpec
from m1.marl.config import GRPOSettings, LearnerConfig
from m1.models.base import ChatRequest, SamplingParams, mix_seed, request_seeds
from m1.models.vllm_client import EngineChat, EngineError
from m1.models.vllm_server import EngineServer, vllm_command

STANDIN = str(Path(__file__).parents[1] / "engine_standin.py")
SPEC = ModelSpec.model_validate({"interface": "chat", "device": "cpu", "tiny": {
    "arch": "qwen3", "hidden_size": 32, "layers": 1, "heads": 2, "kv_heads": 1, "seed": 1}})
MAX_PROMPT, MAX_COMPLETION = 64, 8
CHATS = [
    ChatRequest([{"role": "system", "content": "You are an agent in a team that answers questions about a video."},
                 {"role": "user", "content": "Question: What colour is the shape that appears first in the video?"}]),
    ChatRequest([{"role": "user", "content": "Options: (A) red (B) green"}]),
    ChatRequest([{"role": "user", "content": "##tool call: continue()"}]),
]
LONG = ChatRequest([{"role": "user", "content": "Options: (A) red (B) green (C) blue (D) yellow " * 6}])  # > MAX_PROMPT


def _standin(folder: str, log: Path, **kw) -> EngineServer:
    from m1.models.vllm_server import free_port

    port = free_port()
    argv = [sys.executable, STANDIN, "--model", folder, "--port", str(port), "--served-model-name", "base"]
    return EngineServer(argv, log, port=port, **kw)


@pytest.fixture(scope="module")
def folder(m1_cache):
    from m1.models.tiny import ensure_tiny

    return str(ensure_tiny(SPEC.tiny))


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    import shutil

    own = tmp_path_factory.mktemp("engine")  # full-weight syncs overwrite the served folder: a copy, never the cache
    shutil.copytree(folder, own / "model")
    srv = _standin(str(own / "model"), own / "engine.log", dev_mode=True)
    srv.start(timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def learner(folder):
    from m1.marl.actor.learner import AgentLearner

    cfg = LearnerConfig(finetune="lora", max_prompt_tokens=MAX_PROMPT, max_completion_tokens=MAX_COMPLETION)
    return AgentLearner.build("alpha", "qa", SPEC, cfg, GRPOSettings(beta=0.0))


def healthy(chat: EngineChat) -> bool:
    """Whether the engine's GET /health answers 200 (False on any failure)."""
    try:
        status, _ = chat._call("GET", "/health", timeout=10.0)
    except EngineError:
        return False
    return status == 200


def _chat(server, learner, **kw) -> EngineChat:
    kw = {"max_prompt_tokens": MAX_PROMPT, "max_completion_tokens": MAX_COMPLETION, "timeout": 30.0, **kw}
    return EngineChat("qa", server.url, learner.actor.tokenizer, agent="alpha", served_model="base", **kw)


def learner_logprobs(learner, prompt, completion, temperature=1.0, adapter=True):
    """The learner's log-probs of `completion` after `prompt` (adapter off: the base model)."""
    import contextlib

    import torch

    learner.actor.policy.eval()
    ctx = contextlib.nullcontext() if adapter else learner.actor.policy.disable_adapter()
    with torch.no_grad(), ctx:
        lp, mask = learner.actor.compute_logprobs([(list(prompt), list(completion))], temperature,
                                                  model=learner.actor.policy)
    assert mask[0].sum().item() == len(completion)
    return lp[0, :len(completion)].tolist()


def test_vllm_command_and_server_env(monkeypatch):
    monkeypatch.delenv("M1_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("M1_VLLM_ARGS", raising=False)
    argv = vllm_command("/models/qwen3", 8100, lora_rank=8, gpu_memory_utilization=0.5, max_model_len=4096,
                        served_model_name="qwen3", extra=["--enforce-eager"])
    assert argv[:3] == ["vllm", "serve", "/models/qwen3"]
    flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--") and not argv[i + 1].startswith("--")}
    assert flags["--port"] == "8100" and flags["--host"] == "0.0.0.0" and flags["--dtype"] == "bfloat16"
    assert flags["--max-lora-rank"] == "8" and flags["--gpu-memory-utilization"] == "0.5"
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--max-model-len"] == "4096"
    assert "--enable-lora" in argv and argv[-1] == "--enforce-eager"
    assert "--enable-lora" not in vllm_command("/m", 1)
    srv = EngineServer(argv, "/tmp/x.log", port=8100, dev_mode=True)
    assert srv.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and srv.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert srv.url == "http://127.0.0.1:8100" and not srv.alive()
    # vLLM in an environment of its own: its python runs the server module; M1_VLLM_ARGS comes last (it wins)
    monkeypatch.setenv("M1_VLLM_PYTHON", "/opt/vllm/bin/python")
    monkeypatch.setenv("M1_VLLM_ARGS", "--dtype float32 --gpu-memory-utilization 0.3")
    argv = vllm_command("/models/qwen3", 8100, served_model_name="qwen3")
    assert argv[:5] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/qwen3"]
    assert argv[-4:] == ["--dtype", "float32", "--gpu-memory-utilization", "0.3"]


def test_server_whose_command_exits_quotes_its_log(tmp_path):
    from m1.models.vllm_server import free_port

    log = tmp_path / "dead.log"
    srv = EngineServer([sys.executable, "-c", "import sys; print('no such model: /nowhere'); sys.exit(3)"], log,
                       port=free_port())
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"(?s)exited with code 3 before answering /health.*no such model: /nowhere"):
        srv.start(timeout=60)
    assert time.monotonic() - start < 30 and not srv.alive()


def test_hung_engine_times_out_with_the_agent_and_url(learner):
    with socket.socket() as listener:  # accepts connections (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        chat = EngineChat("qa", url, learner.actor.tokenizer, agent="alpha", served_model="base", timeout=1.0)
        start = time.monotonic()
        with pytest.raises(EngineError, match=rf"agent alpha: rollout engine {url} did not answer .* within 1 s"
                                              r".*resumes from the last checkpoint"):
            chat.generate(CHATS[:1], SamplingParams(max_new_tokens=4))
        assert time.monotonic() - start < 5


@pytest.mark.slow
def test_generate_matches_the_learner(server, learner):
    chat = _chat(server, learner)
    assert healthy(chat) and chat.models() == ["base"] and chat.remote
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    # a prompt over MAX_PROMPT is refused by both, never cut from the front (the team trims to its budget first)
    with pytest.raises(EngineError, match=rf"a prompt of \d+ tokens is over learner.max_prompt_tokens={MAX_PROMPT}"):
        chat.generate([CHATS[0], LONG], params)
    with pytest.raises(ValueError, match=rf"over learner.max_prompt_tokens={MAX_PROMPT}"):
        learner.sampler.generate([CHATS[0], LONG], params)
    outs = chat.generate(CHATS, params)
    # the prompts the learner itself would sample from (HFChatModel rendering, whole)
    expected = [c.prompt_ids for c in learner.sampler.generate(CHATS, params)]
    assert [o.prompt_ids for o in outs] == expected and all("truncated" not in o.meta for o in outs)
    eos = set(learner.sampler.chat.eos_ids)
    for o in outs:
        assert 1 <= len(o.completion_ids) <= MAX_COMPLETION and len(o.logprobs) == len(o.completion_ids)
        assert all(math.isfinite(x) and x <= 0 for x in o.logprobs)
        assert o.finish_reason in ("stop", "length")
        assert (o.completion_ids[-1] in eos) == (o.finish_reason == "stop")
        assert o.finish_reason == "stop" or len(o.completion_ids) == MAX_COMPLETION
        assert o.meta["engine"] == server.url and o.meta["weight_version"] == 0 and o.meta["served_model"] == "base"
        assert o.meta["max_new_tokens"] == MAX_COMPLETION
        assert o.text == learner.actor.tokenizer.decode(o.completion_ids, skip_special_tokens=True)
        # sampler and learner agree on the log-probs of what was sampled (temperature 1)
        assert learner_logprobs(learner, o.prompt_ids, o.completion_ids) == pytest.approx(o.logprobs, abs=1e-4)
        assert chat.score(o.prompt_ids, o.completion_ids) == pytest.approx(o.logprobs, abs=1e-4)
    # the same seed gives the same tokens; request i samples with the seed request_seeds gives it
    again = chat.generate(CHATS, params)
    assert [o.completion_ids for o in again] == [o.completion_ids for o in outs]
    alone = ChatRequest(CHATS[1].messages, seed=request_seeds(CHATS, params)[1])
    shifted = chat.generate([alone], SamplingParams(max_new_tokens=12, temperature=1.0, seed=8))[0]
    assert shifted.completion_ids == outs[1].completion_ids
    same_prompt = chat.generate([CHATS[0]] * 3, params)  # GRPO's K rollouts: one prompt, three seeds
    assert len({tuple(o.completion_ids) for o in same_prompt}) > 1
    # at another temperature the returned log-probs are log_softmax(logits / T), the learner's quantity
    warm = chat.generate(CHATS[:2], SamplingParams(max_new_tokens=6, temperature=0.7, seed=1))
    for o in warm:
        assert learner_logprobs(learner, o.prompt_ids, o.completion_ids, 0.7) == pytest.approx(o.logprobs, abs=1e-4)
    greedy = chat.generate(CHATS[:1], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    own = learner.sampler.generate(CHATS[:1], SamplingParams(max_new_tokens=6))[0]
    assert greedy.completion_ids == own.completion_ids


@pytest.mark.slow
def test_runtime_lora_sync(server, learner, tmp_path):
    import torch

    chat = _chat(server, learner)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in learner.actor.policy.named_parameters():
            if "lora_B" in name:  # B starts at zero: give the adapter a visible effect
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    learner.actor.policy.save_pretrained(tmp_path / "alpha-v1")
    assert chat.load_adapter("alpha-v1", tmp_path / "alpha-v1") >= 0
    assert sorted(chat.models()) == ["alpha-v1", "base"]
    with pytest.raises(EngineError, match=r"agent alpha: rollout engine .* already been loaded"):
        chat.load_adapter("alpha-v1", tmp_path / "alpha-v1")
    chat.serve("alpha-v1", 1)
    prompt = chat.prompt_ids(CHATS[0])[0]
    completion = learner.actor.tokenizer("##Answer: B ##Reason: the square is red",
                                         add_special_tokens=False)["input_ids"]
    tuned = learner_logprobs(learner, prompt, completion)
    base = learner_logprobs(learner, prompt, completion, adapter=False)
    assert chat.score(prompt, completion) == pytest.approx(tuned, abs=1e-4)
    assert chat.score(prompt, completion, model="base") == pytest.approx(base, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(tuned, base)) > 1e-2
    out = chat.generate(CHATS[:2], SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    for o in out:
        assert o.meta["served_model"] == "alpha-v1" and o.meta["weight_version"] == 1
        assert learner_logprobs(learner, o.prompt_ids, o.completion_ids) == pytest.approx(o.logprobs, abs=1e-4)
    chat.serve("base", 1)
    chat.unload_adapter("alpha-v1")
    assert chat.models() == ["base"]
    with pytest.raises(EngineError, match=rf"agent alpha: rollout engine {server.url}: POST /v1/unload_lora_adapter "
                                          r"failed with HTTP 404: The lora adapter 'alpha-v1' cannot be found"):
        chat.unload_adapter("alpha-v1")
    with pytest.raises(EngineError, match=r"HTTP 404: The model `alpha-v1` does not exist"):
        chat.score(prompt, completion, model="alpha-v1")


def _perturbed(folder, out, seed, scale=0.2):
    """A copy of the model at `folder` with seeded Gaussian noise on every weight, saved to `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(out)
    return model


@pytest.mark.slow
def test_full_weight_reload(server, learner, folder, tmp_path):
    """The new weight files replace the engine's own (update_config answers 500, as on vLLM 0.32) and it reloads."""
    import torch

    from m1.marl.algo.reductions import token_logprobs

    chat = _chat(server, learner)
    assert chat.engine_folder() == Path(server.argv[server.argv.index("--model") + 1])
    model = _perturbed(folder, tmp_path / "step-2", seed=1)
    prompt = chat.prompt_ids(CHATS[2])[0]
    completion = learner.actor.tokenizer("##tool call: add tool <Fine Browser>", add_special_tokens=False)["input_ids"]
    before = chat.score(prompt, completion)
    probe = chat.probe()
    ids = torch.tensor([probe[0] + probe[1]])
    with torch.no_grad():
        expect = token_logprobs(model(input_ids=ids).logits[:, len(probe[0]) - 1:-1], ids[:, len(probe[0]):])[0]
    seconds = chat.reload_weights(tmp_path / "step-2", version=2, expect=expect.tolist(), tolerance=1e-4)
    assert seconds >= 0 and chat.weight_version == 2 and chat.served_model == "base"
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1:-1]
    want = token_logprobs(logits, ids[:, len(prompt):])[0].tolist()
    after = chat.score(prompt, completion)
    assert after == pytest.approx(want, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-2
    assert chat.generate(CHATS[:1], SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))[0].meta[
        "weight_version"] == 2
    # the same files again: nothing moves, and that is no error; no temporary files are left behind
    chat.reload_weights(tmp_path / "step-2", version=3)
    assert not [p for p in chat.engine_folder().iterdir() if "m1-tmp" in p.name]
    # why the client never points the engine at another folder: on vLLM 0.32 that is an HTTP 500
    with pytest.raises(EngineError, match=r"HTTP 500: Field '_hf_config_revision' not found in ModelConfig"):
        chat._post("/collective_rpc", {"method": "update_config", "args": [{"model_config": {"model": "/x"}}]})


@pytest.mark.slow
def test_stale_full_weight_reload_is_a_clear_error(folder, learner, tmp_path):
    """An engine whose reload_weights succeeds without loading the new weights (vLLM 0.32 after a failed
    update_config) is caught by the probe: with the learner's log-probs, and without them."""
    import shutil

    shutil.copytree(folder, tmp_path / "model")
    port = __import__("m1.models.vllm_server", fromlist=["free_port"]).free_port()
    argv = [sys.executable, STANDIN, "--model", str(tmp_path / "model"), "--port", str(port),
            "--served-model-name", "base", "--stale-reload"]
    with EngineServer(argv, tmp_path / "stale.log", port=port, dev_mode=True) as srv:
        chat = _chat(srv, learner)
        _perturbed(folder, tmp_path / "step-1", seed=2)
        with pytest.raises(EngineError, match=r"agent alpha: rollout engine .*: the weight files in .* changed for "
                                              r"version 1 but .* exactly those before .* stale weights"):
            chat.reload_weights(tmp_path / "step-1", version=1)
        assert chat.weight_version == 0
        _perturbed(folder, tmp_path / "step-2", seed=3)
        with pytest.raises(EngineError, match=r"after reloading weights version 2 .* differ from the learner's by "
                                              r".*not serving the synced weights"):
            chat.reload_weights(tmp_path / "step-2", version=2, expect=[0.0] * len(chat.probe()[1]))


@pytest.mark.slow
def test_killed_engine_raises_naming_agent_and_url(folder, learner, tmp_path):
    with _standin(folder, tmp_path / "victim.log") as srv:
        chat = _chat(srv, learner, timeout=5.0)
        assert len(chat.generate(CHATS[:2], SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))) == 2
        srv.proc.kill()
        srv.proc.wait(10)
        start = time.monotonic()
        with pytest.raises(EngineError, match=rf"agent alpha: rollout engine {srv.url} is not answering .*"
                                              r"died or hung.*resumes from the last checkpoint"):
            chat.generate(CHATS, SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))
        assert time.monotonic() - start < 5.0
        assert not healthy(chat) and not srv.alive()


@pytest.mark.slow
def test_engine_host_owns_a_server_and_reports_the_node_url(folder, learner, tmp_path):
    pytest.importorskip("ray")
    import ray

    from m1.models.vllm_server import EngineHost

    host = EngineHost("alpha", tmp_path)  # what a `ray.remote(num_gpus=N)(EngineHost)` actor runs
    argv = [sys.executable, STANDIN, "--model", folder, "--host", "{host}", "--port", "{port}"]
    try:
        url = host.start(folder, argv=argv, timeout=120)
        assert url.startswith(f"http://{ray.util.get_node_ip_address()}:") and host.alive()
        assert (tmp_path / "engine-alpha.log").is_file()
        chat = EngineChat("qa", url, learner.actor.tokenizer, agent="alpha", served_model=folder, timeout=10.0)
        assert healthy(chat) and chat.models() == [folder]
    finally:
        host.stop()
    assert not host.alive()


def test_older_response_shape_token_ids_from_logprob_tokens(folder):
    """vLLM before `return_token_ids`: ids only as "token_id:N" strings in logprobs.tokens (and no prompt ids)."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    chat = EngineChat("qa", "http://engine:8100", tok, agent="alpha", served_model="base")
    sent = []

    def post(path, payload, timeout=None):
        sent.append(payload)
        return json.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": {
            "tokens": ["token_id:11", "token_id:12"], "token_logprobs": [-0.5, -1.5]}}]}).encode()

    chat._post = post
    out = chat.generate(CHATS[:2], SamplingParams(max_new_tokens=2, temperature=1.0, seed=5))
    assert [o.completion_ids for o in out] == [[11, 12], [11, 12]] and out[0].logprobs == [-0.5, -1.5]
    assert sorted(p["seed"] for p in sent) == sorted([mix_seed(5, 0), mix_seed(5, 1)])
    assert all(p["prompt"] for p in sent)
    assert all(p["return_token_ids"] and p["return_tokens_as_token_ids"] and p["logprobs"] == 0 for p in sent)
    assert all(p["top_k"] == -1 and p["repetition_penalty"] == 1.0 and p["model"] == "base" for p in sent)

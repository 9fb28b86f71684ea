# The README's two commands: `make demo` and `make test`. Both install what they need, idempotently.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint deps system-deps bench clean

demo: deps
	@bash .ci/demo.sh

test: deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -p no:cacheprovider --durations=30 $(PYTEST_ARGS)

lint: deps
	$(VENV)/bin/ruff check .

# Every benchmark in bench/, at SIZE=quick (default; the whole run stays under ~10 minutes) or SIZE=full.
SIZE ?= quick
bench: deps
	@set -e; t0=$$(date +%s); for b in bench/*.py; do t=$$(date +%s); echo "== $$b (SIZE=$(SIZE))"; \
		BENCH_SIZE=$(SIZE) $(VPY) $$b $(BENCH_ARGS); \
		echo "== $$b: $$(( $$(date +%s) - t )) s, load $$(cut -d' ' -f1 /proc/loadavg)"; done; \
		echo "== make bench SIZE=$(SIZE): $$(( $$(date +%s) - t0 )) s"

deps: system-deps $(STAMP)
	@$(VPY) -m snapshotter.protoc  # containerd API stubs into snapshotter/api (git-ignored), when stale

system-deps:
	@bash .ci/install-deps.sh

$(STAMP): pyproject.toml tests/support/pyproject.toml constraints.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test,bench]' -e tests/support
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info

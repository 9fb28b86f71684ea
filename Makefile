# The README's two commands: `make demo` and `make test`. Both install what they need, idempotently.
# `make check` is the fast loop beside them: no root, no apt, no services (docs/testing.md).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Bytecode and pytest's rewritten test modules are written to __pycache__ (git-ignored) even where the
# environment says not to: collection then takes 5 s instead of 13 s per pytest process after the first run.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test check lint deps system-deps bench bench-ab clean

demo: deps
	@bash .ci/demo.sh

# `make test` runs every test: the tiers that need root, services or time in two parts at once (whole
# files each, balanced by tests/shard_seconds.json's recorded seconds: tests/conftest.py --shard), and
# beside them the fast tier, which is mostly Python on one core; the other reports follow the first's.
# Each part starts its own services (a Ceph, registries, containerds: free ports, own directories).
MARKED = $(VENV)/bin/pytest -p no:cacheprovider -m "$(NEEDS)" $(PYTEST_ARGS) --shard
test: deps
	$(VENV)/bin/ruff check .
	@fast=$$(mktemp); second=$$(mktemp); trap 'rm -f $$fast $$second' EXIT; \
	$(VENV)/bin/pytest -p no:cacheprovider -q -m "not ($(NEEDS))" $(PYTEST_ARGS) >$$fast 2>&1 & f=$$!; \
	$(MARKED) 2/2 --durations=15 >$$second 2>&1 & s=$$!; \
	$(MARKED) 1/2 --durations=15; a=$$?; wait $$s; b=$$?; wait $$f; c=$$?; \
	echo "== make test, the second part of the marked tiers (run beside the above):"; cat $$second; \
	echo "== make test, the fast tier (run beside the above):"; cat $$fast; \
	for rc in $$a $$b $$c; do case $$rc in 0|5) ;; *) exit $$rc;; esac; done; [ $$a$$b$$c != 555 ]

# What a test needs, as marks (pyproject.toml; tests/conftest.py classifies and skips). `make check` runs the
# tests that need none of them, as any user, in two halves at once (whole files each: tests/conftest.py --shard;
# the second half's report follows the first's); `make test` runs everything.
NEEDS := root or ceph or vm or containerd or registry or slow
CHECK = $(VENV)/bin/pytest -p no:cacheprovider -q -m "not ($(NEEDS))" $(PYTEST_ARGS) --shard
check: $(STAMP)
	@$(VPY) -m snapshotter.protoc  # (the containerd API stubs, when stale)
	$(VENV)/bin/ruff check .
	@log=$$(mktemp); trap 'rm -f $$log' EXIT; \
	$(CHECK) 2/2 >$$log 2>&1 & second=$$!; \
	$(CHECK) 1/2; a=$$?; wait $$second; b=$$?; echo "== make check, second half:"; cat $$log; \
	for rc in $$a $$b; do case $$rc in 0|5) ;; *) exit $$rc;; esac; done; [ $$a$$b != 55 ]

lint: deps
	$(VENV)/bin/ruff check .

# Every benchmark in bench/, at SIZE=quick (default; the whole run stays under ~10 minutes) or SIZE=full.
SIZE ?= quick
# A failing bench does not stop the others; the run then ends with the list of failures and exits 1.
bench: deps
	@t0=$$(date +%s); failed=""; times=""; for b in $(filter-out bench/ab.py,$(wildcard bench/*.py)); do t=$$(date +%s); echo "== $$b (SIZE=$(SIZE))"; \
		if BENCH_SIZE=$(SIZE) $(VPY) $$b $(BENCH_ARGS); then s=ok; else s="FAILED (exit $$?)"; failed="$$failed $$b"; fi; \
		line="$$b: $$s, $$(( $$(date +%s) - t )) s, load $$(cut -d' ' -f1 /proc/loadavg)"; echo "== $$line"; \
		times="$$times\n   $$line"; done; \
		printf '%b\n' "== make bench SIZE=$(SIZE): $$(( $$(date +%s) - t0 )) s, load $$(cut -d' ' -f1-3 /proc/loadavg)$$times"; \
		if [ -n "$$failed" ]; then echo "== make bench: FAILED:$$failed (their output is above)" >&2; exit 1; fi

# The standing A/B (bench/ab.py): this checkout against BASE (a commit), the read, compose and fetch-CPU
# benches interleaved round by round in the same minutes; each figure's ratio this/base with its spread.
ROUNDS ?= 5
BENCHES ?= read,compose,fetch_cpu
bench-ab: deps
	@test -n "$(BASE)" || { echo "usage: make bench-ab BASE=<commit> [ROUNDS=5] [SIZE=quick|full] [BENCHES=read,compose,fetch_cpu]" >&2; exit 2; }
	$(VPY) bench/ab.py --base $(BASE) --rounds $(ROUNDS) --size $(SIZE) --benches $(BENCHES) $(AB_ARGS)

deps: system-deps $(STAMP)
	@$(VPY) -m snapshotter.protoc  # containerd API stubs into snapshotter/api (git-ignored), when stale

system-deps:
	@bash .ci/install-deps.sh

$(STAMP): pyproject.toml setup.py tests/support/pyproject.toml constraints.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test,bench]' -e tests/support
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info

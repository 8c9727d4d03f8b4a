# Developer entry points. `make test` is what CI runs (.ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= -q --disable-pip-version-check
PY_PATHS := $(wildcard operator dev trainer_image tests hack benchmarks)
# Processes for the unit, trainer, tooling and integration tiers (pytest-xdist): one per core,
# at most four (each imports torch, about 1 GB; an integration worker runs a control plane of
# its own).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; echo $$n)
# Integration workers, each with a control plane of its own: one more than the cores, at most
# four (the tier waits on its clusters: 55 % of two cores busy with two workers, 5.8 min; 80 %
# with three, 4.9 min).
INTEGRATION_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); n=$$((n + 1)); [ "$$n" -gt 4 ] && n=4; echo $$n)
# Local e2e targets run at once (pytest-xdist), each a control plane, an operator and pod
# runners of its own: a scenario mostly waits (for a trainer, an operator poll, a timeout), so
# two keep two cores busy (the tier used 24-48 % of them on one). At most two, one per core.
E2E_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 2 ] && n=2; echo $$n)
E2E_XDIST := -n $(E2E_WORKERS) --dist loadgroup

.PHONY: setup test lint unit trainer tooling integration e2e crds docs demo plan-examples

setup: $(VENV)/.installed

# The product with its trainer and dev extras, plus the local tooling (dev/), which is
# a distribution of its own so that `pip install kubetune` never contains it.
$(VENV)/.installed: pyproject.toml dev/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	$(PY) -m pip install $(PIP_FLAGS) -e ".[dev,trainer]" -e ./dev
	touch $@

lint: setup
	$(VENV)/bin/ruff check $(PY_PATHS)
	$(VENV)/bin/ruff format --check $(PY_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The tiers, selected by marker (tests/conftest.py). A bare `pytest` runs unit, trainer and
# the tooling tests that need no control plane; integration, e2e and the tooling tests marked
# `controlplane` need the local control plane, built from Go modules on first use.
unit: setup
	$(VENV)/bin/pytest -m unit

trainer: setup
	$(VENV)/bin/pytest -m trainer

tooling: setup
	$(VENV)/bin/pytest -m tooling

integration: setup
	$(VENV)/bin/pytest -m integration --durations=12

e2e: setup
	$(VENV)/bin/pytest -m e2e $(E2E_XDIST)

# Every tier, each control-plane tier in a pytest run of its own: the e2e tier starts its own
# control plane and operator, which must not share the machine with the integration tier's.
# The tooling tests go with the run that has what they need: those without the control plane
# with unit and trainer, those marked `controlplane` with the integration tier, on its
# clusters. The integration run's workers each start a cluster of their own and take whole
# files (--dist loadfile): a file's tests share its fixtures, and its waits overlap another
# file's work (12.6 minutes on one process, 8.5 to 9 on two, 4.9 on three, on two cores).
# The kind step goes first among the e2e runs: the scenarios marked kubelet that pass there,
# under a real kubelet, are left out of the local target's run (about 7 minutes); where kind
# is skipped (no cached images, too little disk) the local target runs every scenario. The
# local target's scenarios run on E2E_WORKERS targets at once (--dist loadgroup keeps the
# ones that share the baseline run, and the two-node ones, on one worker each).
test: lint
	$(VENV)/bin/pytest -m "unit or trainer or (tooling and not controlplane)" \
	  -n $(TEST_WORKERS) --durations=15
	$(VENV)/bin/pytest -m "integration or (tooling and controlplane)" \
	  -n $(INTEGRATION_WORKERS) --dist loadfile --durations=12
	@passed=$$(mktemp); rm -f "$$passed"; \
	VENV=$(VENV) KIND_PASSED_FILE="$$passed" hack/kind-e2e.sh --if-cached -m "e2e and kubelet" \
	  --durations=12 || exit 1; \
	if [ -s "$$passed" ]; then \
	  rm -f "$$passed"; \
	  echo "== the kubelet scenarios passed on kind; the local target runs the others"; \
	  $(VENV)/bin/pytest -m "e2e and not kubelet" $(E2E_XDIST) --durations=12; \
	else \
	  $(VENV)/bin/pytest -m e2e $(E2E_XDIST) --durations=12; \
	fi

crds: setup
	$(VENV)/bin/kubetune crds --out crds/
	PYTHONPATH=tests $(PY) tests/unit/test_chart.py  # the chart's copies of crds/

# The chart README's values table, from the `# --` comments in charts/kubetune/values.yaml
# (tests/unit/test_values_table.py fails when it is stale or a value is undocumented), and
# docs/configuration.md's table of the operator's environment variables, from its own table
# of them (tests/unit/test_settings_table.py fails when it is stale).
docs: setup
	$(PY) hack/values_table.py --write charts/kubetune/README.md
	$(PY) hack/settings_table.py --write docs/configuration.md

demo: setup
	$(VENV)/bin/kubetune demo

plan-examples: setup
	@for job in examples/*.yaml; do \
	  case $$job in */gpupools.yaml) continue;; esac; \
	  echo "== kubetune plan $$job"; $(VENV)/bin/kubetune plan $$job || exit 1; echo; \
	done

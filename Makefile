# Developer entry points. `make test` is what CI runs (.ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_FLAGS ?= -q --disable-pip-version-check
PY_PATHS := $(wildcard operator trainer_image tests hack benchmarks)

.PHONY: setup test lint unit crds demo plan-examples

setup: $(VENV)/.installed

# The product with its trainer and dev extras, plus the local tooling (operator/dev), which is
# a distribution of its own so that `pip install kubetune` never contains it.
$(VENV)/.installed: pyproject.toml operator/dev/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	$(PY) -m pip install $(PIP_FLAGS) -e ".[dev,trainer]" -e ./operator/dev
	touch $@

lint: setup
	$(VENV)/bin/ruff check $(PY_PATHS)
	$(VENV)/bin/ruff format --check $(PY_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

unit: setup
	$(VENV)/bin/pytest -m unit

# The e2e tier starts its own control plane and operator: a second pytest run, so that it does
# not share the machine with the integration tier's cluster.
test: lint
	$(VENV)/bin/pytest -m "not e2e"
	$(VENV)/bin/pytest -m e2e
	VENV=$(VENV) hack/kind-e2e.sh --if-cached

crds: setup
	$(VENV)/bin/kubetune crds --out crds/

demo: setup
	$(VENV)/bin/kubetune demo

plan-examples: setup
	@for job in examples/*.yaml; do \
	  case $$job in */gpupools.yaml) continue;; esac; \
	  echo "== kubetune plan $$job"; $(VENV)/bin/kubetune plan $$job || exit 1; echo; \
	done

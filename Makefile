# The two commands a newcomer needs: `make serve` and `make test`.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup serve test
setup:
	scripts/setup.sh

serve: setup
	$(VENV)/bin/spark-edge serve $(SERVE_ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

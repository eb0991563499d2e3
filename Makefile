# The two commands a newcomer needs: `make serve` and `make test`.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup serve test images image-avx512 image-amx image-avx2 image-arm
setup:
	scripts/setup.sh

serve: setup
	$(VENV)/bin/spark-edge serve $(SERVE_ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Container images (a running docker daemon; see the README's "Container images").
# MODEL=/path/to/model.gguf bakes another model; BASE_IMAGE=debian:bookworm-slim uses a registry base.
image-avx512 image-amx image-avx2 image-arm: image-%: setup
	PYTHON=$(VENV)/bin/python docker/build-image.sh $*

images: image-avx512 image-amx image-avx2 image-arm

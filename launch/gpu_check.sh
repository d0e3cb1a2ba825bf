#!/usr/bin/env bash
# The GPU tier and the GPU bench in one go, on a machine with a CUDA GPU, from a fresh checkout:
#
#   bash launch/gpu_check.sh [all|tier|bench]   the tier (pytest -m gpu) and/or `python -m framework.bench gpu`
#   bash launch/gpu_check.sh wheels             on a machine with pip access: the wheels a GPU machine without
#                                               registry access needs, into .whl/ (carry that folder along)
#
# Packages: with .whl/ present, its wheels are unpacked into .gpu-site/ over the machine's own PyTorch (a CUDA
# image's torch, Lightning and scientific stack are used as they are; what the project needs beyond them is
# carried); otherwise a virtual environment .venv-gpu gets `pip install -e ".[dev,xformers]"`.
# Results go to $GPU_RESULTS (default gpu_results/): env.txt, gpu_tier.log, gpu_tier.xml, bench_gpu.log,
# bench_gpu.json, bench_gpu.md, bench_finetune.json, bench_overlap_{nvlink,infiniband,latte,latte_2x8,wan,wan_2x8}.json with traces; the README's GPU table (its gpu-bench block) is rewritten from bench_gpu.json.
# Exit status: non-zero if the tier or the bench failed (each still runs).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
RESULTS=${GPU_RESULTS:-gpu_results}
PY=${PYTHON:-python3}
# The GPU machine's Python (its wheels' tag): the CUDA image this project is checked on runs 3.12.
GPU_PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}
# What such an image lacks, at the versions CI tests (transformers, tokenizers and huggingface-hub too: the image's
# newer majors are outside the project's ranges; mosaicml-streaming's imports need the compression packages).
CARRIED=(diffusers==0.39.0 hydra-core==1.3.2 omegaconf==2.3.1 mosaicml-streaming==0.13.0 brotli==1.2.1
         catalogue==2.0.10 python-snappy==0.7.3 cramjam==2.14.0 zstd==1.5.6.1 transformers==4.57.6
         tokenizers==0.22.2 huggingface-hub==0.36.2 xformers==0.0.35)

if [ "$PART" = wheels ]; then
    set -e
    rm -rf .whl && mkdir -p .whl  # one Python version's wheels only: two would stop the install
    platforms=()
    for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" \
        --implementation cp "${platforms[@]}" -d .whl "${CARRIED[@]}"
    # hydra-core's parser runtime is published as a source archive only: build its (pure Python) wheel here.
    python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
    du -sh .whl
    echo "carry .whl to the GPU machine (it is git-ignored) and run: bash launch/gpu_check.sh"
    exit 0
fi

mkdir -p "$RESULTS"
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpu-site .whl/*.whl || exit 1
    export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif ! "$PY" -c "import diffusers, hydra, streaming, framework" 2>/dev/null; then
    python3 -m venv .venv-gpu && . .venv-gpu/bin/activate && PY=python \
        && pip install -q -e ".[dev,xformers]" || exit 1
fi
export PYTHONUNBUFFERED=1
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c "import torch, lightning, diffusers, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'| lightning', lightning.__version__, '| diffusers', diffusers.__version__, '| transformers', transformers.__version__)"
} | tee "$RESULTS/env.txt"

status=0
if [ "$PART" = all ] || [ "$PART" = tier ]; then
    "$PY" -m pytest -m gpu -q -rA -o "addopts=" -p no:cacheprovider tests/test_gpu.py --junitxml="$RESULTS/gpu_tier.xml" 2>&1 \
        | tee "$RESULTS/gpu_tier.log" || status=1
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
    # Short timings by default: the whole bench fits one 10-minute call (BENCH_ARGS="" for the bench's own defaults).
    # shellcheck disable=SC2086
    "$PY" -m framework.bench gpu ${BENCH_ARGS-warmup=3 steps=10 max_batch=256} out="$RESULTS/bench_gpu.json" \
        markdown="$RESULTS/bench_gpu.md" readme=README.md 2>&1 \
        | tee "$RESULTS/bench_gpu.log" || status=1
    # fine-tuning memory and speed: full vs LoRA vs LoRA on a bf16 base, each beside its predicted peak (docs/finetune.md)
    "$PY" -m framework.bench finetune model=pixart_xl_2_512 batch_size=8 warmup=2 steps=5 \
        out="$RESULTS/bench_finetune.json" 2>&1 | tee "$RESULTS/bench_finetune.log" || status=1
    # sequence parallelism's exposed communication at 16k tokens over 8 ranks, with this GPU's computation
    for link in nvlink infiniband; do
        "$PY" -m framework.bench overlap preset=pixart_xl_2_256 latent_size=256 ranks=8 "head_groups=[1,2]" link=$link \
            trace_dir="$RESULTS/overlap_$link" out="$RESULTS/bench_overlap_$link.json" 2>&1 \
            | tee "$RESULTS/bench_overlap_$link.log" || status=1
    done
    # the video families at their sizes (docs/sequence-parallelism.md): Latte's switches (DSP, intra-, inter-layer) and
    # Wan's Ulysses, on 8 ranks of a node and on 2 nodes x 8 (ring attention across)
    for run in "latte 8 preset=latte_1_512 num_layers=4 head_groups=[1,4] inter_layer=[false,true]" \
               "latte_2x8 16 preset=latte_1_512 num_layers=4 head_groups=[1,4] inter_layer=[false,true] ranks_per_node=8" \
               "wan 8 preset=wan21_t2v_1_3b num_frames=20 num_layers=2 head_groups=[1,2]" \
               "wan_2x8 16 preset=wan21_t2v_1_3b num_frames=20 num_layers=2 head_groups=[1] ranks_per_node=8"; do
        # shellcheck disable=SC2086
        set -f; set -- $run; set +f  # split on spaces, no globbing of [1,4]
        name=$1 ranks=$2
        shift 2
        "$PY" -m framework.bench overlap latent_size=null ranks="$ranks" "$@" trace_dir="$RESULTS/overlap_$name" \
            out="$RESULTS/bench_overlap_$name.json" 2>&1 | tee "$RESULTS/bench_overlap_$name.log" || status=1
    done
    # decoupled video generation: each role's peak at Wan 1.3B's 81 frames of 480x832 (all 30 blocks on a GPU)
    "$PY" -m framework.bench roles out="$RESULTS/bench_roles.json" 2>&1 | tee "$RESULTS/bench_roles.log" || status=1
fi
exit $status

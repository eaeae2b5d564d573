#!/usr/bin/env bash
# One prepared GPU check (<= 8 minutes on one GPU): installs seqpar, runs the CUDA-only code
# paths (NCCL init, bf16 autocast, CUDA RNG, max_memory_allocated) through a GPT-1.3B-class
# model at recompute none / selective / full.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e . 2>/dev/null || python3 -m pip install -q --no-deps -e .
export PYTHONUNBUFFERED=1
timeout 420 python3 scripts/gpu_check.py "$@"
# NCCL + CUDA through the real launcher, 1 process, a few steps
timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node=1 -m seqpar.train configs/tiny-cpu.yaml \
  parallel.tp=1 train.steps=10 train.log_interval=5 train.eval_interval=0 checkpoint.dir=/tmp/seqpar-gpu-ckpt \
  out_dir=/tmp/seqpar-gpu-run

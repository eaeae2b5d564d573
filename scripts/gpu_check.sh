#!/usr/bin/env bash
# The asserting GPU validation of seqpar (scripts/gpu_validate.py), under 8 minutes on one H200
# (it prints the planned seconds per check first, the measured ones as it goes):
#   1. correctness of the GPT (L=4, h=1024, a=16, s=1024) against a plain-PyTorch reference built
#      from its dense state dict: fp32 with TF32 off and bf16, math and sdpa attention
#   2. recompute none / selective / full bit-identical with dropout 0.1 in bf16
#   3. activation memory per layer (torch.cuda.memory_allocated and the ledger) against Table 2
#   4. step time, MFU and peak memory of a 1.3B-class GPT at recompute none / selective / full, and
#      with compiled blocks (train.compile) against eager
#   5. torchrun -m seqpar.train tiny-cpu through NCCL for 10 steps with dropout and eval, then a
#      resume to 12 steps (fresh temp dirs, checkpoint.resume=never for the first run)
#   6. with several GPUs: check 1 again at t = the largest power of two <= the GPU count (max 16)
#   7. sdpa with attention dropout under selective recompute: bit-identical grads, kernel names
#   8. resume at step 10 equal bit for bit to the uninterrupted run; a CUDA checkpoint resumed on CPU
#   9. bf16-autocast vs fp32; 10. host syncs per non-logging step (sync debug mode) <= 1
#  11. the Trainer's memory lines; 12. async checkpoint save() < 25% of a synchronous one
#  13. two ranks on the one GPU over gloo: t=2 SP, dp=2 DDP / FSDP2, pp=2, cp=2, tp_overlap, compiled
#      t=2 SP and FSDP2 vs t=1; SP dropout
#      streams per TP rank under recompute; pp=2 step time with chunk timing off <= on
# Prints a Markdown table; exits non-zero if any check fails. Offline: nothing is installed, this
# checkout is put on PYTHONPATH. Extra arguments go to gpu_validate.py (e.g. --device cpu, --tp 2).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

args=("$@")
if [[ " $* " != *" --tp "* && " $* " != *" --device cpu "* ]]; then
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  tp=1
  while (( tp * 2 <= gpus && tp * 2 <= 16 )); do tp=$(( tp * 2 )); done
  if (( tp > 1 )); then args+=(--tp "$tp"); fi
fi
timeout 480 python3 scripts/gpu_validate.py ${args[@]+"${args[@]}"}

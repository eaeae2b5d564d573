#!/usr/bin/env bash
# The GPU checks of seqpar (tests/gpu, listed in docs/gpu.md) at full size: `pytest -m gpu tests/gpu`,
# under 8 minutes on one H200. Prints a table of check, measured value, threshold and PASS/FAIL at
# the end and each test's seconds; exits non-zero if any check fails. Offline: nothing is
# installed (torch and pytest must be), this checkout is put on PYTHONPATH.
#   bash scripts/gpu_check.sh                            # every check
#   bash scripts/gpu_check.sh --checks correctness,rng   # some (pytest -k "test_correctness or test_rng")
#   bash scripts/gpu_check.sh --device cpu               # the CPU smoke: the same tests at tiny shapes
#   bash scripts/gpu_check.sh --tp 4                     # the multi-GPU correctness check at t=4
# Other arguments go to pytest, e.g. --gpu-table rows.md (also write the table; .json: JSON) or -x.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

select=(-m gpu)
args=()
while (( $# )); do
  case "$1" in
    "--device")
      case "${2:-}" in
        cpu) select=(-m "not gpu" --gpu-table -) ;;
        cuda) ;;
        *) echo "gpu_check.sh: --device takes cpu or cuda, got '${2:-}'" >&2; exit 2 ;;
      esac
      shift 2 ;;
    "--checks") checks="${2:?--checks takes a comma-separated list, e.g. correctness,rng}"; checks="${checks// /}"
      args+=(-k "test_${checks//,/ or test_}"); shift 2 ;;
    "--tp") args+=(--gpu-tp "${2:?--tp takes a number of GPUs}"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [[ "${select[*]}" == "-m gpu" ]] && ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check.sh: no CUDA device visible; use --device cpu for the smoke run" >&2
  exit 2
fi
# SIGINT at the time limit: pytest stops and still prints the rows measured so far
timeout -s INT -k 60 480 python3 -m pytest tests/gpu -v --durations=0 "${select[@]}" ${args[@]+"${args[@]}"}

#!/usr/bin/env bash
# The GPU validation in one command (docs/validation.md): the measured profile, the
# host/contention diagnostics, `pytest -m gpu`, then the grid's replays until the time
# is up (each finished run is appended to replay.csv at once; every step's output goes to
# run.log).  SKIP_PROFILE=1 and SKIP_TESTS=1 skip the first two steps (a second call that
# resumes the replays); PROFILE_BASE names the hardware preset whose unmeasured terms the
# profile keeps (default h100-pcie5), PROFILE_NAME the profile (default: OUT's folder name,
# the name to copy OUT/profile.yaml to as conf/hardware/measured/<name>.yaml).  Run from
# the repository root on a machine with a CUDA GPU and torch:
#   bash replay/gpu_validation.sh OUT_DIR [SECONDS] [--models a,b] [more replay flags]
# e.g. every policy in timed rounds at one budget, the host's drift spread over all of them
# (docs/validation-runs.md, "How to replay for a 5% target"):
#   bash replay/gpu_validation.sh OUT_DIR 540 --models olmoe-1b-7b --modes batch1 \
#     --budgets 3.2 --no-crossover --host-timers --repeats 5
# With --event-logs, the runs' event logs (OUT_DIR/events/) are added to OUT_DIR/events.tar
# at the end (compare them with `fmoesim-validate-grid events`).
# A device the replay cannot use stops it at once (exit status 2). A failed step does not
# stop the steps after it (each writes what it can), but the script then exits 1, naming
# the steps that failed.
# PYTHON names the interpreter (default: .venv/bin/python where `make` made one, else
# python3).
set -uo pipefail
usage="usage: gpu_validation.sh OUT_DIR [SECONDS] [replay flags]"
out=${1:?$usage}
shift
budget_s=540
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then  # SECONDS given (flags start with -)
  # 1 to 9,999,999 written in decimal (bash would read a leading 0 as octal)
  if ! [[ $1 =~ ^[1-9][0-9]{0,6}$ ]]; then
    echo "gpu_validation.sh: error: SECONDS $1: must be a positive whole number ($usage)" >&2
    exit 2
  fi
  budget_s=$1
  shift
fi
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
device=${FMOESIM_DEVICE:-cuda}
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
"$PYTHON" -c "import sys; from fmoesim.errors import run_or_exit; from replay.backend import \
check_device; run_or_exit('gpu_validation.sh', check_device, sys.argv[1])" "$device" || exit 2
mkdir -p "$out"
failed=()
start=$SECONDS
if [ -z "${SKIP_PROFILE:-}" ]; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv || true
    "$PYTHON" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
    nproc; free -g; } > "$out/machine.txt" 2>&1
  "$PYTHON" -m replay.profile --device "$device" --base "${PROFILE_BASE:-h100-pcie5}" \
    --model "${PROFILE_MODELS:-mixtral-8x7b,qwen3-30b-a3b,olmoe-1b-7b}" \
    --out "$out/profile.yaml" --force --name "${PROFILE_NAME:-$(basename "$out")}" \
    --diagnostics "$out/diagnostics.csv" 2>&1 | tee -a "$out/run.log" \
    || failed+=(profile)
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  # the modules holding GPU tests (the others need the dev extra's hypothesis to load)
  gpu_tests=$(grep -l "pytest.mark.gpu" tests/test_*.py)
  # shellcheck disable=SC2086  # one word per file
  "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu $gpu_tests \
    > "$out/pytest-gpu.log" 2>&1 || failed+=(pytest)
  tail -n 3 "$out/pytest-gpu.log" | tee -a "$out/run.log"
fi
left=$(( budget_s - (SECONDS - start) ))
if [ "$left" -gt 0 ]; then
  echo "profile and tests took $((SECONDS - start)) s; replays get $left s" | tee -a "$out/run.log"
  "$PYTHON" -m replay.campaign replay --device "$device" --out "$out" --deadline-s "$left" "$@" \
    2>&1 | tee -a "$out/run.log" || failed+=(replays)
else  # not a failure: a second call with SKIP_PROFILE=1 SKIP_TESTS=1 replays
  echo "profile and tests took $((SECONDS - start)) s of $budget_s: no time left for replays" \
    | tee -a "$out/run.log"
fi
if [ -d "$out/events" ]; then  # --event-logs: one file back, not one per run
  # appended: a second call that resumes the replays adds its runs' logs
  tar -rf "$out/events.tar" -C "$out" events && rm -rf "$out/events"
  echo "event logs: $out/events.tar ($(du -h "$out/events.tar" | cut -f1))" | tee -a "$out/run.log"
fi
echo "total $((SECONDS - start)) s" | tee -a "$out/run.log"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]} (run.log and pytest-gpu.log say why)" | tee -a "$out/run.log" >&2
  exit 1
fi

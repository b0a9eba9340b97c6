#!/usr/bin/env bash
# Create or refresh .venv without ever pulling CUDA torch onto a CPU machine.
#  * If the system python already has torch (a GPU host), the venv inherits it (--system-site-packages)
#    and pip leaves it alone, because our torch requirement is unpinned.
#  * Otherwise we install the CPU wheel first: TORCH_SPEC (default torch==2.13.0), optionally from
#    TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu on a machine without a local wheel).
set -euo pipefail
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: reusing the system torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing ${TORCH_SPEC:-torch==2.13.0} (CPU build)"
  .venv/bin/pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/pip install -q -e ".[serve,load,dev]"
touch .venv/.installed

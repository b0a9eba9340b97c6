#!/usr/bin/env bash
# Create or refresh .venv without ever pulling CUDA torch onto a CPU machine.
#  * If the system python already has torch (a GPU host), the venv inherits it (--system-site-packages)
#    and the installer leaves it alone, because our torch requirement is unpinned.
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
# uv resolves and installs the rest in seconds where pip takes minutes; pip is the fallback wherever uv
# cannot be installed or cannot do it. torch is pinned to the one the venv has: uv reads neither pip's
# configuration nor this machine's local wheels, and must never swap the CPU build for a CUDA one.
.venv/bin/python -W ignore -c "import torch; print('torch==' + torch.__version__)" > .venv/torch-pin.txt
if ! { .venv/bin/pip install -q uv 2>/dev/null &&
  .venv/bin/uv pip install --python .venv/bin/python -q --constraint .venv/torch-pin.txt -e ".[serve,load,dev]"; }
then
  .venv/bin/pip install -q -e ".[serve,load,dev]"
fi
touch .venv/.installed

#!/usr/bin/env bash
# Build Horovod 0.28.1 (CPU, PyTorch, MPI + Gloo) into a venv as a benchmark peer.
# Not part of hpctrain's install: Horovod's last release predates PyTorch 2.1 and needs the
# tricks below. About 2.5 minutes on 2 cores.
#   benchmarks/build_horovod.sh [VENV]      (default: .venv)
set -euo pipefail
VENV=${1:-.venv}
PY="$VENV/bin/python"
if "$PY" -c "import horovod.torch" 2>/dev/null; then
  echo "horovod already importable in $VENV"; exit 0
fi
"$PY" -m pip install -q cmake
wrap=$(mktemp -d)/cxx17
# Horovod forces C++14 and strips -std= from CXXFLAGS; PyTorch's headers need C++17.
# A trailing -std wins; -g0 keeps the wheel small.
printf '#!/bin/sh\nexec g++ "$@" -std=c++17 -g0\n' > "$wrap"; chmod +x "$wrap"
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
export CXX="$wrap" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j2
"$PY" -m pip install --no-build-isolation --no-cache-dir horovod==0.28.1
"$PY" -c "import horovod.torch as hvd; print('horovod', hvd.__version__ if hasattr(hvd,'__version__') else '0.28.1', 'built')"

#!/usr/bin/env bash
# Makes (once) the Python venv the GPU-kernel tools run in and prints its python: the clang of
# PyPI's ziglang (the .cu kernels' ahead-of-time build), Triton (its interpreter runs the Triton
# kernels on the CPU in the tests; its compiler builds them for gfx950 / sm_90) and numpy.
# Versions are pinned here, in one place.
#
#   scripts/gpu-tools.sh          KIMI_GPU_TOOLS=DIR: where the venv lives (default target/gpu-tools)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tools=${KIMI_GPU_TOOLS:-$root/target/gpu-tools}
pins=("ziglang==0.17.1" "triton==3.9.0" "numpy==2.4.6")

have() {
    "$tools/bin/python" - "${pins[@]}" 2>/dev/null <<'PY'
import importlib.metadata as md, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    if md.version(name) != version:
        sys.exit(1)
PY
}
if ! have; then
    [ -x "$tools/bin/python" ] || python3 -m venv "$tools" >&2
    "$tools/bin/pip" install -q "${pins[@]}" >&2
fi
echo "$tools/bin/python"

#!/usr/bin/env bash
# Makes (once) the Python venv the GPU-kernel tools run in and prints its python: the clang of
# PyPI's ziglang (the .cu kernels' ahead-of-time build), Triton (its interpreter runs the Triton
# kernels on the CPU in the tests; its compiler builds them for gfx950 / sm_90) and numpy.
# Versions are pinned here, in one place.
#
#   scripts/gpu-tools.sh          KIMI_GPU_TOOLS=DIR: where the venv lives (default target/gpu-tools)
#
# Exits 75 (EX_TEMPFAIL) when the tools cannot be installed for the machine's reasons, PyPI out of
# reach or a full disk, and the tests skip on it, saying why; any other failed install (a bad pin)
# exits 1. A failed install leaves no half-made venv behind. pip keeps no cache: the wheels
# (Triton's is ~300 MB) are installed once.
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
install() {
    { [ -x "$tools/bin/python" ] || python3 -m venv "$tools"; } &&
        "$tools/bin/pip" install -q --no-cache-dir "${pins[@]}"
}
if ! have; then
    log=$(mktemp)
    if ! install > "$log" 2>&1; then
        cat "$log" >&2
        rm -rf "$tools"
        why=1
        if grep -q -e "No space left on device" -e "Errno 28" "$log"; then
            why=75
        elif ! python3 -c 'import socket; socket.create_connection(("pypi.org", 443), 5)' 2>/dev/null; then
            why=75
        fi
        rm -f "$log"
        echo "gpu-tools: could not install ${pins[*]} into $tools (exit $why: 75 is the machine's fault)" >&2
        exit $why
    fi
    rm -f "$log"
fi
echo "$tools/bin/python"

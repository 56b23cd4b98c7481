#!/usr/bin/env bash
# The GPU device check, in two halves (the lent GPU machine has no internet, so everything is
# built here and carried there):
#
#   scripts/device-check.sh prepare   # here: the release binary (stripped, ~30 MB) into
#                                     # target/device-check/, every kernel into target/gpu-kernels/
#   scripts/device-check.sh           # there (one H200): the run below, under 8 minutes
#
# With the session tools: `run` with carry ["target/device-check", "target/gpu-kernels"] and the
# command `scripts/device-check.sh`. What the run does:
#   1. the device and driver (nvidia-smi);
#   2. `kimi-host kernels check --backend cuda`: loads every sm_90 kernel of the manifest (kpl's
#      PTX through the driver's JIT, Triton's cubins), runs RMSNorm, SiLU-GLU, the BF16 gather, the
#      KDA decode step, the matrix-core product (mma.sync's lane tables), the top-k select and the
#      Triton BF16 / MXFP4 products against the CPU backend, then a random K3.1 model (MXFP4
#      experts) through the staged GPU backend against the CPU backend (prefill and decode logits,
#      greedy tokens), then GEMV (BF16, MXFP4) and KDA-decode bandwidth as a fraction of HBM.
#      and, when `prepare` found ../shared/golden, the three text goldens through the same backend
#      within their tolerances. Non-zero exit on any mismatch. (The goldens are copied into the
#      ignored target/device-check/golden only, to be carried; the project never holds them.)
# On an MI355X the same run is `kimi-host kernels check --backend hip` (never tried).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

if [ "${1:-}" = "prepare" ]; then
    cargo build --release -p kimi-host-cli --bin kimi-host
    mkdir -p target/device-check
    strip -o target/device-check/kimi-host target/release/kimi-host
    golden=${KIMI_GOLDEN_DIR:-$root/../shared/golden}
    rm -rf target/device-check/golden
    if [ -d "$golden" ]; then
        mkdir -p target/device-check/golden
        for m in k3-tiny k3-tiny-mxfp4 k31-tiny-indexer; do cp -r "$golden/$m" target/device-check/golden/; done
    fi
    scripts/build-gpu-kernels.sh target/gpu-kernels
    du -sh target/device-check target/gpu-kernels
    echo "carry: target/device-check target/gpu-kernels; run: scripts/device-check.sh"
    exit 0
fi

bin=target/device-check/kimi-host
[ -x "$bin" ] || { echo "no $bin: run 'scripts/device-check.sh prepare' first and carry target/device-check" >&2; exit 2; }
[ -f target/gpu-kernels/manifest.json ] || { echo "no target/gpu-kernels: carry it" >&2; exit 2; }
echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv || true
echo "== kernels (sm_90) against the CPU backend, then bandwidth"
goldens=()
[ -d target/device-check/golden ] && goldens=(--golden target/device-check/golden)
timeout 420 "$bin" kernels check --backend cuda --kernels target/gpu-kernels "${goldens[@]}"

#!/usr/bin/env bash
# Builds every GPU kernel ahead of time, with no GPU and no ROCm or CUDA:
#   kernels/ops/*.cu: gfx950 (MI355X) and gfx942 (compile-only) code objects, and sm_90 (H200)
#   PTX, through the clang 22 of PyPI's ziglang (pinned), header-free (kernels/include/kpl/);
#   kernels/triton: gfx950 code objects and sm_90 cubins through Triton's compiler (pinned).
# Writes OUT/<arch>/<op>.{co,s,ptx} and OUT/manifest.json: per kernel and arch the parameter
# struct's size (read from the compiled code), registers, LDS and spills; `kimi-host kernels
# report` prints it.
#
#   scripts/build-gpu-kernels.sh [OUT]        (default: target/gpu-kernels)
#   KIMI_GPU_TOOLS=DIR  where the Python venv lives (scripts/gpu-tools.sh; default: target/gpu-tools)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/target/gpu-kernels}
python=$("$root/scripts/gpu-tools.sh")
tools=$(dirname "$(dirname "$python")")
ziglang_version=$("$python" -c "import importlib.metadata as m; print(m.version('ziglang'))")
zig=("$python" -m ziglang)

mkdir -p "$out"
out=$(cd "$out" && pwd)
# clang finds lld through -B and calls it `ld.lld -flavor gnu ...`; zig's ld.lld takes no flavor.
wrap="$out/.lld"
mkdir -p "$wrap"
cat > "$wrap/ld.lld" <<WRAP
#!/bin/sh
[ "\$1" = "-flavor" ] && shift 2
exec "$tools/bin/python" -m ziglang ld.lld "\$@"
WRAP
chmod +x "$wrap/ld.lld"
cp "$wrap/ld.lld" "$wrap/lld"

common=(-O3 -std=c++20 -I "$root/kernels/include")
amd=(-x hip --cuda-device-only -nogpulib -nogpuinc)
nv=(-x cuda --cuda-gpu-arch=sm_90 --cuda-device-only -nocudainc -nocudalib -Xclang -target-feature -Xclang +ptx80)

for arch in gfx950 gfx942 sm_90; do mkdir -p "$out/$arch"; done
for src in "$root"/kernels/ops/*.cu; do
    op=$(basename "$src" .cu)
    for arch in gfx950 gfx942; do
        "${zig[@]}" clang "${amd[@]}" --offload-arch=$arch "${common[@]}" -S "$src" -o "$out/$arch/$op.s"
        "${zig[@]}" clang "${amd[@]}" --offload-arch=$arch --no-gpu-bundle-output "${common[@]}" \
            -c "$src" -o "$out/$arch/$op.co" -B "$wrap"
    done
    "${zig[@]}" clang "${nv[@]}" "${common[@]}" -S "$src" -o "$out/sm_90/$op.ptx"
done

# The Triton kernels (kernels/triton): gfx950 code objects and sm_90 cubins, into OUT/triton.json.
"$python" "$root/kernels/triton/aot.py" "$out"

compiler=$("${zig[@]}" clang --version | head -n 1)
"$tools/bin/python" - "$out" "$compiler (ziglang $ziglang_version)" <<'PY'
import json, os, re, sys

out, compiler = sys.argv[1], sys.argv[2]
kernels = []

def amd(arch, op):
    text = open(os.path.join(out, arch, op + ".s")).read()
    # The code object's metadata: one block per kernel under amdhsa.kernels.
    meta = text[text.index("amdhsa.kernels:"):]
    for block in re.split(r"\n  - ", meta)[1:]:
        name = re.search(r"\.name:\s+(\S+)", block)
        if not name or name.group(1).endswith(".kd"):
            continue
        def num(key):
            m = re.search(r"\." + key + r":\s+(\d+)", block)
            return int(m.group(1)) if m else None
        # The explicit argument (the by-value parameter struct) comes first; hidden ones follow.
        first = re.search(r"\.args:\s*\n\s*- (?:.*\n\s*)*?\.size:\s+(\d+)", block)
        kernels.append({
            "name": name.group(1), "arch": arch, "file": f"{arch}/{op}.co",
            "params_size": int(first.group(1)) if first else 0,
            "vgpr": num("vgpr_count"), "agpr": num("agpr_count"), "sgpr": num("sgpr_count"),
            "ptx_regs": None, "lds": num("group_segment_fixed_size"),
            "spills": num("vgpr_spill_count") or 0, "sgpr_spills": num("sgpr_spill_count") or 0,
            "source": "kpl",
        })

def nv(op):
    text = open(os.path.join(out, "sm_90", op + ".ptx")).read()
    for m in re.finditer(r"\.entry (\w+)\(\s*\.param \.align \d+ \.b8 \w+\[(\d+)\]\s*\)[^\n]*\n\{(.*?)\n\}", text, re.S):
        body = m.group(3)
        regs = sum(int(n) for n in re.findall(r"\.reg \.\w+\s+%\w+<(\d+)>;", body))
        # Function-local __shared__ arrays are module globals named after their kernel.
        shared = sum(int(n) for sym, n in re.findall(r"\.shared \.align \d+ \.b8 (\w+)\[(\d+)\]", text)
                     if m.group(1) in sym)
        kernels.append({
            "name": m.group(1), "arch": "sm_90", "file": f"sm_90/{op}.ptx", "params_size": int(m.group(2)),
            "vgpr": None, "agpr": None, "sgpr": None, "ptx_regs": regs, "lds": shared, "spills": None,
            "source": "kpl",
        })

ops = sorted(f[:-3] for f in os.listdir(os.path.join(out, "gfx950")) if f.endswith(".co"))
for op in ops:
    amd("gfx950", op)
    amd("gfx942", op)
    nv(op)
triton = json.load(open(os.path.join(out, "triton.json")))
kernels.extend(triton["kernels"])
compiler = f"{compiler}; {triton['compiler']}"
json.dump({"compiler": compiler, "kernels": kernels}, open(os.path.join(out, "manifest.json"), "w"), indent=1)
print(f"{len(kernels)} kernel builds in {out}/manifest.json")
PY

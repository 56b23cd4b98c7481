"""Builds every Triton kernel ahead of time, with no GPU: gfx950 (MI355X, wave 64) code objects
and sm_90 (H200) cubins, through Triton's own compiler. Writes OUT/<arch>/<kernel>.{hsaco,cubin}
(with the AMD assembly / PTX beside them) and OUT/triton.json, the kernels' manifest entries
(`scripts/build-gpu-kernels.sh` merges them into OUT/manifest.json).

    python kernels/triton/aot.py OUT
"""

import json
import os
import re
import sys

# Pinned: Triton 3.9 warns that its default flips in 3.10, which would change codegen silently.
os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kimi_triton import attention, gemm, indexer, kda, mla  # noqa: E402

I32 = "i32"
# (kernel, signature, constexprs). Tiles: 16 token rows (decode and small batches), 64 outputs,
# 128 of K (four MXFP4 scale groups) a step.
TILE = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}
KERNELS = [
    (gemm.matmul_bf16,
     {"x_ptr": "*fp32", "w_ptr": "*bf16", "y_ptr": "*fp32", "M": I32, "N": I32, "K": I32, "stride_xm": I32,
      "stride_ym": I32},
     {**TILE, "INTERPRETED": False}),
    (gemm.matmul_mxfp4,
     {"x_ptr": "*fp32", "wq_ptr": "*u8", "ws_ptr": "*u8", "y_ptr": "*fp32", "M": I32, "N": I32, "K": I32,
      "stride_xm": I32, "stride_ym": I32},
     TILE),
    (gemm.matmul_fp8,
     {"xq_ptr": "*u8", "xs_ptr": "*fp32", "wq_ptr": "*u8", "ws_ptr": "*fp32", "y_ptr": "*fp32", "M": I32,
      "N": I32, "K": I32, "stride_ym": I32},
     {**TILE, "INTERPRETED": False}),
    (gemm.moe_mxfp4,
     {"x_ptr": "*fp32", "rows_ptr": "*i32", "offsets_ptr": "*i32", "wq_ptr": "*u8", "ws_ptr": "*u8",
      "y_ptr": "*fp32", "N": I32, "K": I32, "stride_xm": I32, "stride_ym": I32},
     TILE),
]
# The release MLA: latent rank 512, RoPE 64; 16 heads and 16 positions a block (32 spill on
# gfx950: the f32 tiles need 402 VGPRs + 146 AGPRs at 16).
KERNELS += [
    (mla.mla_decode,
     {"q_ptr": "*fp32", "cache_ptr": "*fp32", "table_ptr": "*i32", "seq_ptr": "*i32", "pos_ptr": "*i32",
      "ctx_ptr": "*fp32", "lse_ptr": "*fp32", "T": I32, "H": I32, "RANK": I32, "ROPE": I32, "PAGE_TOKENS": I32,
      "MAX_PAGES": I32, "SPLIT_TOKENS": I32, "scale": "fp32"},
     {"BLOCK_H": 16, "BLOCK_S": 16, "R_PAD": 512, "P_PAD": 64}),
    (mla.attention_merge,
     {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*fp32", "lse_out_ptr": "*fp32", "ROWS": I32,
      "WIDTH": I32, "SPLITS": I32},
     {"BLOCK_W": 512}),
]
# The release indexer: 64 heads of dimension 128; 16 positions a block (a block lies in one page of
# the engine's 16-token pages).
KERNELS += [
    (indexer.indexer_scores,
     {"q_ptr": "*fp32", "w_ptr": "*fp32", "key_ptr": "*fp32", "table_ptr": "*i32", "seq_ptr": "*i32",
      "pos_ptr": "*i32", "out_ptr": "*fp32", "HI": I32, "D": I32, "PAGE_TOKENS": I32, "MAX_PAGES": I32,
      "S_MAX": I32, "scale": "fp32"},
     {"BLOCK_H": 64, "BLOCK_S": 16, "D_PAD": 128}),
]
# The release KDA heads: K = V = 128; chunks of 16, 32 keys and 32 values a block.
KERNELS += [
    (kda.kda_chunk_prefill,
     {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "g_ptr": "*fp32", "beta_ptr": "*fp32",
      "state_ptr": "*fp32", "out_ptr": "*fp32", "cu_ptr": "*i32", "H": I32, "K": I32, "V": I32},
     {"C": 16, "BLOCK_K": 32, "BLOCK_V": 32}),
]
# The vision tower's attention: heads up to 128 wide; 64 query and 32 key rows a block.
KERNELS += [
    (attention.attention_varlen,
     {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "out_ptr": "*fp32", "starts_ptr": "*i32",
      "lens_ptr": "*i32", "H": I32, "D": I32, "scale": "fp32"},
     {"BLOCK_M": 64, "BLOCK_N": 32, "D_PAD": 128}),
]
TARGETS = [("gfx950", GPUTarget("hip", "gfx950", 64)), ("sm_90", GPUTarget("cuda", 90, 32))]


def amd_counts(asm):
    def num(key):
        m = re.search(r"\." + key + r":\s+(\d+)", asm)
        return int(m.group(1)) if m else None
    # VGPR spills go to scratch memory; SGPR spills to lanes of spare VGPRs (no memory traffic).
    return {"vgpr": num("vgpr_count"), "agpr": num("agpr_count"), "sgpr": num("sgpr_count"),
            "spills": num("vgpr_spill_count") or 0, "sgpr_spills": num("sgpr_spill_count") or 0}


def main():
    out = sys.argv[1]
    # Triton's compile cache stays inside the build's output, not in ~/.triton (one place to
    # delete); it is read when the first kernel compiles.
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.path.abspath(out), ".triton-cache"))
    entries = []
    for fn, signature, constexprs in KERNELS:
        sig = dict(signature, **{k: "constexpr" for k in constexprs})
        for arch, target in TARGETS:
            os.makedirs(os.path.join(out, arch), exist_ok=True)
            k = triton.compile(ASTSource(fn, sig, constexprs), target=target)
            name = fn.__name__
            entry = {"name": f"triton_{name}", "arch": arch, "params_size": 0, "vgpr": None, "agpr": None,
                     "sgpr": None, "ptx_regs": None, "lds": k.metadata.shared, "spills": None,
                     "source": "triton", "signature": ",".join(signature.values()),
                     "num_warps": k.metadata.num_warps}
            if arch == "sm_90":
                entry["file"] = f"sm_90/triton_{name}.cubin"
                open(os.path.join(out, entry["file"]), "wb").write(k.asm["cubin"])
                ptx = k.asm["ptx"]
                open(os.path.join(out, f"sm_90/triton_{name}.ptx"), "w").write(ptx)
                entry["ptx_regs"] = sum(int(n) for n in re.findall(r"\.reg \.\w+\s+%\w+<(\d+)>;", ptx))
            else:
                entry["file"] = f"{arch}/triton_{name}.hsaco"
                open(os.path.join(out, entry["file"]), "wb").write(k.asm["hsaco"])
                asm = k.asm["amdgcn"]
                open(os.path.join(out, f"{arch}/triton_{name}.s"), "w").write(asm)
                entry.update(amd_counts(asm))
            entries.append(entry)
    compiler = f"triton {triton.__version__}"
    json.dump({"compiler": compiler, "kernels": entries}, open(os.path.join(out, "triton.json"), "w"), indent=1)
    print(f"{len(entries)} Triton kernel builds ({compiler})")


if __name__ == "__main__":
    main()

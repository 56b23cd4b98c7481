"""Runs the Triton kernels on the CPU (Triton's interpreter, numpy only) over cases written by the
Rust test `kernels/kpl-host/tests/triton.rs`, whose expected outputs come from the Rust CPU
backend, and compares. Every buffer a kernel sees ends at a guard page, so a read or write past
it kills the process. Prints one line per case; exits non-zero on any mismatch.

    TRITON_INTERPRET=1 python kernels/triton/check.py CASES_DIR
"""

import json
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import triton  # noqa: E402

from kimi_triton import attention, gemm, indexer, kda, mla  # noqa: E402
from kimi_triton.guard import guarded  # noqa: E402

DTYPES = {"f32": np.float32, "u8": np.uint8, "u16": np.uint16, "i32": np.int32}


def load(case_dir, spec):
    a = np.fromfile(os.path.join(case_dir, spec["file"]), dtype=DTYPES[spec["dtype"]])
    return a.reshape(spec["shape"])


def launch(kernel, p, t, outs):
    """Launches `kernel` with the case's sizes `p`, its guarded inputs `t` and outputs `outs`."""
    bm, bn, bk = p.get("block_m"), p.get("block_n"), p.get("block_k")
    cdiv = triton.cdiv
    if kernel == "matmul_bf16":
        m, n, k = p["m"], p["n"], p["k"]
        gemm.matmul_bf16[(cdiv(m, bm), cdiv(n, bn))](t["x"], t["w"], outs["y"], m, n, k, k, n,
                                                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=True)
    elif kernel == "matmul_mxfp4":
        m, n, k = p["m"], p["n"], p["k"]
        gemm.matmul_mxfp4[(cdiv(m, bm), cdiv(n, bn))](t["x"], t["wq"], t["ws"], outs["y"], m, n, k, k, n,
                                                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    elif kernel == "matmul_fp8":
        m, n, k = p["m"], p["n"], p["k"]
        gemm.matmul_fp8[(cdiv(m, bm), cdiv(n, bn))](t["xq"], t["xs"], t["wq"], t["ws"], outs["y"], m, n, k, n,
                                                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERPRETED=True)
    elif kernel == "moe_mxfp4":
        e, n, k = p["experts"], p["n"], p["k"]
        biggest = int(np.diff(t["offsets"].array).max(initial=0))
        grid = (e, max(1, cdiv(biggest, bm)), cdiv(n, bn))
        gemm.moe_mxfp4[grid](t["x"], t["rows"], t["offsets"], t["wq"], t["ws"], outs["y"], n, k, k, n,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    elif kernel == "mla_decode":
        tokens, heads, rank, splits = p["tokens"], p["heads"], p["rank"], p["splits"]
        blocks = dict(BLOCK_H=p["block_h"], BLOCK_S=p["block_s"], R_PAD=p["r_pad"], P_PAD=p["p_pad"])
        grid = (tokens, cdiv(heads, p["block_h"]), splits)
        args = (t["seq"], t["pos"])
        sizes = (tokens, heads, rank, p["rope"], p["page_tokens"], p["max_pages"], p["split_tokens"], p["scale"])
        if splits == 1:
            mla.mla_decode[grid](t["q"], t["cache"], t["table"], *args, outs["ctx"], outs["lse"], *sizes, **blocks)
        else:
            # Each split's partial, then the exact merge (as context-parallel ranks would).
            part = guarded(np.full((splits, tokens, heads, rank), np.nan, np.float32))
            part_lse = guarded(np.full((splits, tokens, heads), np.nan, np.float32))
            mla.mla_decode[grid](t["q"], t["cache"], t["table"], *args, part, part_lse, *sizes, **blocks)
            rows = tokens * heads
            mla.attention_merge[(rows, cdiv(rank, 32))](part, part_lse, outs["ctx"], outs["lse"], rows, rank,
                                                        splits, BLOCK_W=32)
    elif kernel == "indexer_scores":
        tokens, s_max = p["tokens"], p["s_max"]
        indexer.indexer_scores[(tokens, cdiv(s_max, p["block_s"]))](
            t["q"], t["w"], t["keys"], t["table"], t["seq"], t["pos"], outs["scores"], p["heads"], p["dim"],
            p["page_tokens"], p["max_pages"], s_max, p["scale"], BLOCK_H=p["block_h"], BLOCK_S=p["block_s"],
            D_PAD=p["d_pad"])
    elif kernel == "kda_chunk_prefill":
        seqs, heads, dk, dv = p["sequences"], p["heads"], p["k"], p["v"]
        # The state is read and advanced in place: the output `state` starts as the initial one.
        np.copyto(outs["state"].array, t["state0"].array)
        kda.kda_chunk_prefill[(seqs, heads, cdiv(dv, p["block_v"]))](
            t["q"], t["k"], t["v"], t["g"], t["beta"], outs["state"], outs["out"], t["cu"], heads, dk, dv,
            C=p["chunk"], BLOCK_K=p["block_k"], BLOCK_V=p["block_v"])
    elif kernel == "attention_varlen":
        heads, dim = p["heads"], p["dim"]
        outs["out"].array[...] = 0.0  # rows in no span stay zero
        longest = int(t["lens"].array.max(initial=0))
        grid = (max(1, cdiv(longest, p["block_m"])), heads, len(t["lens"].array))
        attention.attention_varlen[grid](t["q"], t["k"], t["v"], outs["out"], t["starts"], t["lens"], heads, dim,
                                         p["scale"], BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], D_PAD=p["d_pad"])
    else:
        raise ValueError(f"unknown kernel {kernel}")


def check(case_dir):
    case = json.load(open(os.path.join(case_dir, "case.json")))
    # BF16 inputs are stored as their 16-bit patterns and handed over as `bfloat16`.
    t = {name: guarded(load(case_dir, spec), "bfloat16" if spec.get("bf16") else None)
         for name, spec in case["inputs"].items()}
    wants = {name: (load(case_dir, o["want"]), load(case_dir, o["bound"])) for name, o in case["outputs"].items()}
    # Outputs start as NaN: an element the kernel never writes shows up.
    outs = {name: guarded(np.full(w.shape, np.nan, dtype=np.float32)) for name, (w, _) in wants.items()}
    t0 = time.perf_counter()
    launch(case["kernel"], case["params"], t, outs)
    took = time.perf_counter() - t0
    ok = True
    notes = []
    for name, (want, bound) in wants.items():
        got = outs[name].array
        same = np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
        finite = np.isfinite(want)
        err = np.abs(got[finite].astype(np.float64) - want[finite])
        over = err > bound[finite]
        ok &= same and not over.any()
        notes.append(f"{name}: max |Δ| {float(err.max(initial=0.0)):.3g}"
                     f"{'' if same else ' (NaN / ∞ positions differ)'}"
                     f"{f' ({int(over.sum())} over the bound)' if over.any() else ''}")
    print(f"{'ok  ' if ok else 'FAIL'} {case['name']}: {', '.join(notes)} [{took:.2f} s]", flush=True)
    return ok


def main():
    root = sys.argv[1]
    cases = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "case.json")))
    failed = [c for c in cases if not check(os.path.join(root, c))]
    print(f"{len(cases) - len(failed)} of {len(cases)} Triton cases match the CPU backend")
    sys.exit(1 if failed or not cases else 0)


if __name__ == "__main__":
    main()

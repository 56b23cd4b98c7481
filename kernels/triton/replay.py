"""Replays one Triton launch, recorded by `kimi-kpl-host`'s host device, in Triton's interpreter:
the launch as the Rust side made it — kernel, grid, arguments in order (device pointers as
buffers and offsets, scalars) — so the Rust launchers' argument lists, strides and grids are
checked on the CPU exactly as a GPU would receive them. Each buffer is read from its file, handed
to the kernel as a guarded array of its signature's type (a read or write past it faults), and
written back after the launch.

    python kernels/triton/replay.py LAUNCH_DIR     # LAUNCH_DIR/launch.json + the buffers' files
    python kernels/triton/replay.py --signatures   # every AOT-built kernel's signature, as JSON
    python kernels/triton/replay.py --serve        # one launch directory a line on stdin; answers
                                                   # `ok` or `error <message>` a line (one process
                                                   # for many launches: Triton is imported once)
"""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import aot  # noqa: E402  (the kernels, their signatures and constexprs, in one place)
from kimi_triton.guard import guarded  # noqa: E402

# A pointer argument's element type → how its buffer is viewed (BF16 as its 16-bit patterns,
# handed over as `bfloat16`).
POINTEE = {"*fp32": (np.float32, None), "*bf16": (np.uint16, "bfloat16"), "*u8": (np.uint8, None),
           "*i32": (np.int32, None), "*u32": (np.uint32, None), "*i64": (np.int64, None)}


def kernels():
    return {f"triton_{fn.__name__}": (fn, sig, constexprs) for fn, sig, constexprs in aot.KERNELS}


def signatures():
    # The AOT builds take Triton's default of 4 warps (aot.py passes no num_warps).
    return {name: {"signature": ",".join(sig.values()), "num_warps": 4} for name, (_, sig, _) in kernels().items()}


def replay(launch_dir):
    launch = json.load(open(os.path.join(launch_dir, "launch.json")))
    fn, sig, constexprs = kernels()[launch["kernel"]]
    types = list(sig.values())
    args = launch["args"][:len(types)]  # the two scratch pointers Triton's launchers append go
    if len(args) != len(types):
        raise ValueError(f"{launch['kernel']}: {len(launch['args'])} arguments for {len(types)} parameters")
    buffers = launch["buffers"]
    raw = {i: np.fromfile(os.path.join(launch_dir, b["file"]), dtype=np.uint8) for i, b in enumerate(buffers)}
    views = {}
    call = []
    for ty, a in zip(types, args):
        if ty.startswith("*"):
            dtype, name = POINTEE[ty]
            i = a["buf"]
            # The Rust launchers pass whole buffers; a view into one would not write back here.
            if a["offset"] != 0:
                raise ValueError(f"a pointer {a['offset']} bytes into buffer {i}: the replay passes whole buffers")
            if i in views and views[i][0] != ty:
                raise ValueError(f"buffer {i} passed as {views[i][0]} and {ty}")
            if i not in views:
                size = np.dtype(dtype).itemsize
                views[i] = (ty, guarded(raw[i][:raw[i].nbytes // size * size].view(dtype), name))
            call.append(views[i][1])
        elif ty == "i32":
            call.append(int(a["i32"]))
        else:
            call.append(float(a["f32"]))
    # The interpreter multiplies BF16 tiles as raw patterns; kernels that take `INTERPRETED`
    # widen them to f32 first (exact).
    kw = dict(constexprs)
    if "INTERPRETED" in kw:
        kw["INTERPRETED"] = True
    fn[tuple(launch["grid"])](*call, **kw)
    for i, (_, t) in views.items():
        out = np.frombuffer(t.array.tobytes(), dtype=np.uint8)
        merged = raw[i].copy()
        merged[:out.size] = out
        merged.tofile(os.path.join(launch_dir, buffers[i]["file"]))


def serve():
    for line in sys.stdin:
        try:
            replay(line.strip())
            answer = "ok"
        except Exception as e:  # the launch fails, not the server
            answer = "error " + repr(e).replace("\n", " ")
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()


def main():
    if sys.argv[1:] == ["--signatures"]:
        print(json.dumps(signatures()))
    elif sys.argv[1:] == ["--serve"]:
        serve()
    else:
        replay(sys.argv[1])


if __name__ == "__main__":
    main()

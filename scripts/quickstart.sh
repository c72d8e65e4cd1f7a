#!/usr/bin/env bash
# The main job on a fresh machine, on the embedded CPU default:
#   set up → trtpipe build (quantize → CPU engine → Triton repo) → trtpipe serve (real Triton)
#   → trtpipe bench (ISL 100 / OSL 200 at concurrency 1, 4, 16) → stop the server.
# Each step's wall time is printed at the end. RECIPE=... overrides the recipe; TRTPIPE_EXTRAS=cpu,deploy also
# installs what `trtpipe deploy k8s` needs (Helm's engine and the Kubernetes schemas, ~350 MB), default: cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${RECIPE:-recipes/smollm2_135m_cpu_fp8.yaml}
declare -A T
step() { local name=$1; shift; local t0=$SECONDS; "$@"; T[$name]=$((SECONDS - t0)); }

step setup env TRTPIPE_EXTRAS="${TRTPIPE_EXTRAS:-cpu}" bash scripts/setup.sh
TRTPIPE=.venv/bin/trtpipe
step build "$TRTPIPE" build "$RECIPE"
step serve "$TRTPIPE" serve --detach
trap '"$TRTPIPE" serve --stop || true' EXIT
step bench "$TRTPIPE" bench --isl 100 --osl 200 --concurrency 1,4,16
"$TRTPIPE" serve --stop
trap - EXIT
echo
echo "quickstart timings (s): setup ${T[setup]}, build ${T[build]}, serve start ${T[serve]}, bench ${T[bench]}"

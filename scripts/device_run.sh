#!/usr/bin/env bash
# On the GPU machine, in the repository root, in one command: install mlx[cuda] from the parts packed by
# scripts/device_kit.sh, build a random mid-size Gemma 4 pair (scripts/make_gemma4_pair.py), run
# `mtpflow bench --preset device` (and mlx-vlm's and mtpflow's bf16 greedy equality on the same pair),
# and copy bench.json, equality.json and the logs to $OUT.
#   bash scripts/device_run.sh
# Environment: KIT (default .device-kit), SKIP_INSTALL=1 (mlx already importable: a dry run on any
# machine), HIDDEN / LAYERS / VOCAB / WINDOW (default 768 / 12 / 16384 / 512), DTYPE (bfloat16),
# BENCH_S / EQUALITY_S (time limits, default 200 / 150 s), BENCH_ARGS (extra `mtpflow bench` flags).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
KIT=${KIT:-.device-kit}
PY=${PYTHON:-python3}
if [ -z "${SKIP_INSTALL:-}" ]; then
  mkdir -p /root/stash && cp "$KIT"/part.* /root/stash/ 2>/dev/null
  # shellcheck disable=SC1091
  source "$KIT/install.sh" "$KIT" || { echo "install failed"; exit 1; }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PAIR=$(mktemp -d)/pair
t0=$(date +%s)
$PY scripts/make_gemma4_pair.py "$PAIR" --hidden "${HIDDEN:-768}" --layers "${LAYERS:-12}" --vocab "${VOCAB:-16384}" \
    --window "${WINDOW:-512}" --dtype "${DTYPE:-bfloat16}" 2>&1 | tee "$OUT/pair.log" || exit 1
$PY -c "import mlx.core as mx, json; print(json.dumps({'device': str(mx.default_device()), 'mlx': mx.__version__}))" \
    | tee "$OUT/device.json"
# shellcheck disable=SC2086
timeout "${BENCH_S:-200}" $PY -m mtpflow.bench --preset device --target "$PAIR/target" --draft-model "$PAIR/drafter" \
    --out "$OUT/bench" --no-progress ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench: rc $? after $(( $(date +%s) - t0 )) s"; tail -n 30 "$OUT/bench.log"
[ -f "$OUT/bench/bench.json" ] && mv "$OUT/bench/bench.json" "$OUT/bench.json" && rmdir "$OUT/bench" 2>/dev/null
timeout "${EQUALITY_S:-150}" $PY scripts/lowp_equality.py --model "$PAIR/target" --draft-model "$PAIR/drafter" \
    --dtype "${DTYPE:-bfloat16}" --prompts 8 --max-tokens 48 --block-sizes 3,5 --batch 4 --out "$OUT/equality.json" \
    > "$OUT/equality.log" 2>&1
echo "equality: rc $? after $(( $(date +%s) - t0 )) s"
$PY - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("bench.json", "equality.json"):
    p = out / name
    print(name, "missing" if not p.is_file() else "ok")
if (out / "equality.json").is_file():
    d = json.loads((out / "equality.json").read_text())
    for who in ("mtpflow", "mlx_vlm"):
        runs = d.get(who, {}).get("runs", [])
        print(who, [(r["block_size"], r["batch"], f"{r['equal']}/{r['of']}") for r in runs], d.get(who, {}).get("failed", ""))
PY

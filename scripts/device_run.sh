#!/usr/bin/env bash
# On the GPU machine, in the repository root, in one command: install mlx[cuda] from the parts packed by
# scripts/device_kit.sh, build a random mid-size Gemma 4 pair whose copy drafter the target accepts
# (scripts/make_gemma4_pair.py --accepting), and run, most decisive first:
#   1. scripts/verify_round_cost.py: a drafting round's verify against the same forward at a fixed and at a
#      growing context, with MLX's cuDNN attention on and off (round.json, round_nocudnn.json);
#   2. scripts/lowp_equality.py at block sizes 1 and 3, batches 1 and 4, with mtpflow's attention paths as now
#      (mlx-lm's masks and prefill chunks; mlx-vlm counted too), as before, and as now without cuDNN attention
#      (equality.json, equality_before.json, equality_nocudnn.json);
#   3. `mtpflow bench --preset device` (bench.json).
# Everything lands in $OUT with its log; each step has a time limit, the whole run stays under ~8 minutes.
#   bash scripts/device_run.sh
# Environment: KIT (default .device-kit), SKIP_INSTALL=1 (mlx already importable: a dry run on any
# machine), HIDDEN / LAYERS / VOCAB / WINDOW (default 768 / 12 / 16384 / 512), DTYPE (bfloat16),
# PROMPTS / MAX_TOKENS (equality: 4 / 32), ROUND_S / EQUALITY_S / BENCH_S (time limits, default 45 / 70 / 170 s: at most ~8 min with the install),
# BENCH_ARGS (extra `mtpflow bench` flags).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
KIT=${KIT:-.device-kit}
PY=${PYTHON:-python3}
t0=$(date +%s)
if [ -z "${SKIP_INSTALL:-}" ]; then
  mkdir -p /root/stash && cp "$KIT"/part.* /root/stash/ 2>/dev/null
  # shellcheck disable=SC1091
  source "$KIT/install.sh" "$KIT" || { echo "install failed"; exit 1; }
fi
echo "install: $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PAIR=$(mktemp -d)/pair
DT=${DTYPE:-bfloat16}
$PY scripts/make_gemma4_pair.py "$PAIR" --hidden "${HIDDEN:-768}" --layers "${LAYERS:-12}" --vocab "${VOCAB:-16384}" \
    --window "${WINDOW:-512}" --dtype "$DT" --accepting 2>&1 | tee "$OUT/pair.log" || exit 1
$PY -c "import mlx.core as mx, json; print(json.dumps({'device': str(mx.default_device()), 'mlx': mx.__version__}))" \
    | tee "$OUT/device.json"
step() { echo "$1: rc $2 after $(( $(date +%s) - t0 )) s"; }

RC=(--model "$PAIR/target" --draft-model "$PAIR/drafter" --dtype "$DT" --block 2 --context 128 --repeats 20)
timeout "${ROUND_S:-45}" $PY scripts/verify_round_cost.py "${RC[@]}" --json "$OUT/round.json" > "$OUT/round.log" 2>&1
step round $?
MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${ROUND_S:-45}" $PY scripts/verify_round_cost.py "${RC[@]}" \
    --json "$OUT/round_nocudnn.json" > "$OUT/round_nocudnn.log" 2>&1
step round_nocudnn $?

EQ=(--model "$PAIR/target" --draft-model "$PAIR/drafter" --dtype "$DT" --prompts "${PROMPTS:-4}"
    --max-tokens "${MAX_TOKENS:-32}" --block-sizes 1,3 --batch 4)
timeout "${EQUALITY_S:-70}" $PY scripts/lowp_equality.py "${EQ[@]}" --paths now --out "$OUT/equality.json" \
    > "$OUT/equality.log" 2>&1
step equality $?
timeout "${EQUALITY_S:-70}" $PY scripts/lowp_equality.py "${EQ[@]}" --paths before --no-mlx-vlm \
    --out "$OUT/equality_before.json" > "$OUT/equality_before.log" 2>&1
step equality_before $?
# without cuDNN attention a verify of < 4 tokens with the "causal" mask runs the one-query steps' vector kernel
MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${EQUALITY_S:-70}" $PY scripts/lowp_equality.py "${EQ[@]}" --paths now --no-mlx-vlm \
    --out "$OUT/equality_nocudnn.json" > "$OUT/equality_nocudnn.log" 2>&1
step equality_nocudnn $?

# shellcheck disable=SC2086
timeout "${BENCH_S:-170}" $PY -m mtpflow.bench --preset device --target "$PAIR/target" --draft-model "$PAIR/drafter" \
    --out "$OUT/bench" --no-progress ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
step bench $?
tail -n 30 "$OUT/bench.log"
[ -f "$OUT/bench/bench.json" ] && mv "$OUT/bench/bench.json" "$OUT/bench.json" && rmdir "$OUT/bench" 2>/dev/null
$PY - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("round.json", "round_nocudnn.json", "equality.json", "equality_before.json", "equality_nocudnn.json", "bench.json"):
    p = out / name
    print(name, "missing" if not p.is_file() else "ok")
for name in ("round.json", "round_nocudnn.json"):
    if (out / name).is_file():
        d = json.loads((out / name).read_text())
        print(name, {k: d.get(k) for k in ("round_verify_ms", "null_round_verify_ms", "same_context_ms",
                                          "growing_context_ms", "round_draft_ms", "accepted_per_round")})
for name in ("equality.json", "equality_before.json", "equality_nocudnn.json"):
    if (out / name).is_file():
        d = json.loads((out / name).read_text())
        for who in ("mtpflow", "mlx_vlm"):
            if who in d:
                runs = d[who].get("runs", [])
                print(name, who, [(r["block_size"], r["batch"], f"{r['equal']}/{r['of']}") for r in runs],
                      d[who].get("failed", d[who].get("unavailable", "")))
PY
echo "total: $(( $(date +%s) - t0 )) s"

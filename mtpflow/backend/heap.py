"""Keep freed memory in the process for reuse, as MLX's GPU allocators do, on a Linux CPU.

Why
---
On Metal and CUDA, MLX keeps freed buffers in a cache and hands them out again.  On a CPU its
allocator is ``std::malloc`` / ``std::free``, and glibc serves a large block (over 128 KB to 32
MB, by its sliding threshold) with a fresh ``mmap`` and returns it with ``munmap`` when freed.  A
training step frees and allocates the same vocabulary-sized temporaries every step (a
``[rows, vocab]`` float32 array is 200 MB at 1024 rows and 49152 tokens), so every step the kernel
maps them again and faults in and zeroes every page on first write: on a 2-core Intel Xeon,
SmolLM2's MTP kind from the feature cache took ~6 M page faults in one short run and spent about
a tenth of its CPU time in the kernel.  Each thread that allocates also gets an arena of its own
(MLX's CPU stream, the training lanes' workers), whose heaps glibc shrinks as they empty.

What :func:`retain_freed_memory` sets (``mallopt``, glibc only)
-----------------------------------------------------------------
* ``M_ARENA_MAX = 1``: every thread allocates from the main heap.  It must come before any other
  thread first allocates (an arena, once a thread has one, stays its own), so ``mtpflow train``
  calls it first thing, before MLX is imported.
* ``M_MMAP_MAX = 0``: no block is ``mmap``-ed on its own; freed blocks go back to the heap.
* ``M_TRIM_THRESHOLD = trim_bytes`` (default 1 GiB): free memory at the top of the heap is
  returned to the system only past that much.

The process's resident memory then stays at its high-water mark, as an MLX GPU process's cache
does.  ``MTPFLOW_HEAP=system`` leaves glibc's defaults.  Measured in
[docs/training.md](../../docs/training.md#throughput-against-the-limit).

Importing this module has no side effects.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

ENV_HEAP = "MTPFLOW_HEAP"
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_STATE: dict = {"status": "not set"}


def retain_freed_memory(trim_bytes: int = 1 << 30) -> dict:
    """Set glibc's heap to keep freed memory for reuse (see the module's text); returns
    :func:`status`.  Does nothing off Linux and glibc, or with ``MTPFLOW_HEAP=system``;
    only the first call in a process acts."""
    global _STATE
    if _STATE.get("status") != "not set":  # once per process: later, MLX's threads have arenas of their own
        return dict(_STATE)
    env = os.environ.get(ENV_HEAP, "").strip().lower()
    if env in ("system", "off", "0", "none", "default"):
        _STATE = {"status": "system", "reason": f"{ENV_HEAP}={env}"}
    elif sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        _STATE = {"status": "system", "reason": "not Linux with glibc"}
    else:
        libc = ctypes.CDLL(None)
        mallopt = getattr(libc, "mallopt", None)
        if mallopt is None:  # pragma: no cover (glibc always has it)
            _STATE = {"status": "system", "reason": "no mallopt"}
        else:
            trim = max(0, min(int(trim_bytes), 2**31 - 1))
            ok = [mallopt(M_ARENA_MAX, 1), mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, trim)]
            _STATE = ({"status": "kept", "arena_max": 1, "mmap_max": 0, "trim_threshold": trim}
                      if all(r == 1 for r in ok) else {"status": "system", "reason": f"mallopt returned {ok}"})
    return dict(_STATE)


def status() -> dict:
    """What :func:`retain_freed_memory` did in this process: ``{"status": "kept", ...}``,
    ``{"status": "system", "reason": ...}`` or ``{"status": "not set"}``."""
    return dict(_STATE)

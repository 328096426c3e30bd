"""mtpflow.backend.heap: glibc's heap set to keep freed memory (what ``mtpflow train`` does first)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

glibc = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")


def _run(code: str, **env) -> str:
    e = {k: v for k, v in os.environ.items() if k != "MTPFLOW_HEAP"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                          check=True, timeout=120).stdout


_FAULTS = """
    import resource, sys
    from mtpflow.backend import heap
    print(heap.retain_freed_memory()["status"])
    import mlx.core as mx
    x = mx.random.normal((256, 1 << 16))  # 64 MB temporaries, freed and allocated again
    mx.eval(x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(6):
        mx.eval(mx.exp(x - 1.0) * 2.0)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@glibc
@pytest.mark.skipif(_thp_always(), reason="transparent huge pages always on: a block faults in 2 MB at a time")
def test_kept_heap_reuses_freed_blocks_instead_of_faulting_in_new_pages():
    """Six rounds of 64 MB temporaries: with glibc's defaults each block is mapped afresh and its
    16 k pages fault again every round; with the heap kept, the rounds after the first reuse the
    same pages (the count is the process's minor page faults, which no other process moves)."""
    kept = _run(_FAULTS).split()
    system = _run(_FAULTS, MTPFLOW_HEAP="system").split()
    assert kept[0] == "kept" and system[0] == "system"
    import resource

    pages = 6 * (64 << 20) // resource.getpagesize()  # at least one 64 MB block mapped afresh a round
    assert int(system[1]) > 0.8 * pages
    assert int(kept[1]) < int(system[1]) // 4


def test_status_says_what_was_done(monkeypatch):
    from mtpflow.backend import heap

    monkeypatch.setattr(heap, "_STATE", {"status": "not set"})
    monkeypatch.setenv("MTPFLOW_HEAP", "system")
    assert heap.retain_freed_memory() == {"status": "system", "reason": "MTPFLOW_HEAP=system"}
    assert heap.status()["status"] == "system"
    monkeypatch.delenv("MTPFLOW_HEAP")
    assert heap.retain_freed_memory()["status"] == "system"  # only the first call in a process acts


@glibc
def test_the_train_command_keeps_the_heap_and_says_so(tmp_path):
    import json

    from conftest import FIXTURES

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mtpflow.cli", "train", "--target", str(FIXTURES / "pair_e" / "target"),
           "--data", "selfgen:8:16", "--out", str(out), "--steps", "2", "--batch-size", "4", "--unroll", "2",
           "--drafter-config", json.dumps({"num_hidden_layers": 1, "intermediate_size": 64})]
    env = {k: v for k, v in os.environ.items() if k != "MTPFLOW_HEAP"}
    env["MTPFLOW_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    heap = json.loads((out / "train_summary.json").read_text())["train_speed"]["heap"]
    assert heap == {"status": "kept", "arena_max": 1, "mmap_max": 0, "trim_threshold": 1 << 30}

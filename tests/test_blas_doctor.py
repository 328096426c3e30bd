"""Tests for mtpflow.backend.blas (OpenBLAS preloading) and mtpflow.doctor.

The BLAS checks run in fresh subprocesses: whether MLX binds to OpenBLAS is
decided once per process, when ``libmlx.so`` is loaded, so only a new process
shows the real behaviour of the CLI start-up sequence.

Set ``MTPFLOW_REQUIRE_OPENBLAS=1`` (scripts/test.sh does, after installing
libopenblas0-pthread) to turn "OpenBLAS not installed" skips into failures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mtpflow.backend import blas as _blas

REPO = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")
linux_only = pytest.mark.skipif(not LINUX, reason="OpenBLAS preloading is Linux-only")


def _clean_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("LD_PRELOAD", _blas.ENV_BLAS, _blas.ENV_REEXEC_GUARD, _blas.ENV_CORETYPE, _blas.ENV_MKL_THREADING):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run(code: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc


def _json_from(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    # The report is the first JSON object starting at the beginning of a line
    # (log lines may precede it).
    out = proc.stdout
    decoder = json.JSONDecoder()
    for i, ch in enumerate(out):
        if ch == "{" and (i == 0 or out[i - 1] == "\n"):
            try:
                obj, _ = decoder.raw_decode(out, i)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    raise AssertionError(f"no JSON object in stdout:\n{out}\nstderr:\n{proc.stderr}")


@pytest.fixture(scope="module")
def openblas_path() -> str:
    if not LINUX:
        pytest.skip("Linux-only")
    path = _blas.find_blas_library()
    if path is None:
        msg = "OpenBLAS not installed (apt-get install libopenblas0-pthread)"
        if os.environ.get("MTPFLOW_REQUIRE_OPENBLAS") == "1":
            pytest.fail(msg + " but MTPFLOW_REQUIRE_OPENBLAS=1")
        pytest.skip(msg)
    return path


# What the CLI does at start-up: ensure_fast_blas() before anything imports mlx,
# then the doctor subcommand.
CLI_SEQUENCE = """
    import sys
    from mtpflow.backend.blas import ensure_fast_blas
    ensure_fast_blas()
    from mtpflow.doctor import main_doctor
    sys.exit(main_doctor(["--iters", "3"]))
"""


EXPECTED_KEYS = {"mtpflow", "mlx", "mlx_lm", "python", "platform", "device", "blas", "matmul_bench"}
EXPECTED_BLAS_KEYS = {
    "mapped_blas_libraries",
    "preload_path",
    "preload_status",
    "sgemm_provider",
    "in_effect",
    "openblas_in_effect",
}


def test_doctor_report_has_keys():
    from mtpflow.doctor import doctor_report

    report = doctor_report(bench=True, bench_iters=2)
    assert EXPECTED_KEYS <= report.keys()
    assert report["mtpflow"] and report["python"] and report["mlx"]
    assert {"default_device", "metal_available", "cuda_available"} <= report["device"].keys()
    assert report["profile"]["device"] == "cpu" and report["profile"]["auto_dtype"] == "float32"
    assert report["profile"]["fuse_ops"] is True and report["profile"]["bucket_shapes"] is False
    assert EXPECTED_BLAS_KEYS <= report["blas"].keys()
    bench = report["matmul_bench"]
    assert set(bench["median_ms"]) == {"1", "8"}
    assert all(v > 0 for v in bench["median_ms"].values())
    assert bench["ratio"] > 0
    json.dumps(report)  # serialisable


def test_imports_have_no_side_effects():
    proc = _run(
        """
        import sys, json
        import mtpflow.backend.blas, mtpflow.doctor
        maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
        print(json.dumps({"mlx": any(m == "mlx" or m.startswith("mlx.") for m in sys.modules),
                          "openblas": "openblas" in maps,
                          "state": mtpflow.backend.blas._STATE}))
        """
    )
    out = _json_from(proc)
    assert out == {"mlx": False, "openblas": False, "state": None}


@linux_only
def test_openblas_in_effect_with_cli_sequence(openblas_path):
    report = _json_from(_run(CLI_SEQUENCE, MTPFLOW_BLAS="openblas"))
    blas = report["blas"]
    assert blas["preload_status"] == "loaded", blas
    assert os.path.realpath(blas["preload_path"]) == os.path.realpath(openblas_path)
    assert blas["openblas_mapped"] is True
    # The binding check: libmlx's cblas_sgemm slot points into OpenBLAS.
    assert "openblas" in (blas["sgemm_provider"] or "").lower(), blas
    assert blas["in_effect"] is True and blas["openblas_in_effect"] is True
    assert blas["openblas_config"] and "OpenBLAS" in blas["openblas_config"]


@linux_only
def test_disabled_by_env():
    report = _json_from(_run(CLI_SEQUENCE, MTPFLOW_BLAS="none"))
    blas = report["blas"]
    assert blas["preload_status"] == "disabled"
    assert blas["openblas_mapped"] is False
    assert blas["sgemm_provider"] and "openblas" not in blas["sgemm_provider"].lower()
    assert blas["in_effect"] is False and blas["openblas_in_effect"] is False


@linux_only
def test_bad_explicit_path_is_reported():
    report = _json_from(_run(CLI_SEQUENCE, MTPFLOW_BLAS="/nonexistent/libopenblas.so.0"))
    blas = report["blas"]
    assert blas["preload_status"] == "error"
    assert blas["in_effect"] is False


@linux_only
def test_too_late_is_reported_not_pretended(openblas_path):
    out = _json_from(
        _run(
            """
            import json
            import mlx.core as mx
            from mtpflow.backend import blas as _blas
            r = _blas.ensure_fast_blas()
            mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))
            print(json.dumps({"ensure": r, "info": _blas.blas_info()}))
            """
        )
    )
    assert out["ensure"]["status"] == "mlx_already_imported"
    assert out["ensure"]["expected_in_effect"] is False
    assert out["info"]["in_effect"] is False
    assert "openblas" not in (out["info"]["sgemm_provider"] or "").lower()


@linux_only
def test_reexec_with_ld_preload_fallback(openblas_path):
    out = _json_from(
        _run(
            """
            import json
            import mlx.core as mx
            from mtpflow.backend import blas as _blas
            if _blas.ensure_fast_blas()["status"] == "mlx_already_imported":
                _blas.reexec_with_preload()  # does not return
            mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))
            print(json.dumps(_blas.blas_info()))
            """
        )
    )
    assert out["reexeced"] is True
    assert out["preload_status"] == "ld_preload"
    assert out["in_effect"] is True


@linux_only
def test_cli_doctor_subcommand(openblas_path):
    """The real console-script path: ``mtpflow doctor``."""
    if not (REPO / "mtpflow" / "cli.py").exists():
        pytest.skip("mtpflow/cli.py not written yet")
    report = _json_from(
        _run(
            """
            import sys
            sys.argv = ["mtpflow", "doctor"]
            from mtpflow.cli import main
            sys.exit(main())
            """
        )
    )
    assert report["blas"]["in_effect"] is True, report["blas"]


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse sse2 ssse3 {flags}

processor\t: 1
vendor_id\t: {vendor}
flags\t\t: fpu
"""


@pytest.mark.parametrize(
    "vendor, flags, expected",
    [
        ("GenuineIntel", "avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl avx512_bf16", "SkylakeX"),
        ("GenuineIntel", "avx avx2 fma avx512f", "Haswell"),  # AVX-512 foundation alone is not SkylakeX
        ("GenuineIntel", "avx avx2 fma", "Haswell"),
        ("GenuineIntel", "avx avx2", None),
        ("AuthenticAMD", "avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl", None),
    ],
)
def test_coretype_follows_the_first_processors_flags_on_intel(vendor, flags, expected):
    name, why = _blas.coretype_for(CPUINFO.format(vendor=vendor, flags=flags))
    assert name == expected, why
    assert why


def _core_report(**env: str) -> dict:
    return _json_from(
        _run(
            """
            import json
            from mtpflow.backend import blas as _blas
            r = _blas.ensure_fast_blas()
            import mlx.core as mx
            mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
            info = _blas.blas_info()
            print(json.dumps({"ensure": r, "core": info["openblas_core"], "coretype": info["coretype"],
                              "source": info["coretype_source"]}))
            """,
            **env,
        )
    )


@linux_only
def test_openblas_runs_the_kernels_the_cpu_supports(openblas_path):
    """On a CPU newer than OpenBLAS's table (Debian 12's 0.3.21 on an Emerald Rapids Xeon picks
    the SSE3 'Prescott' kernels, ~6x slower), the preload chooses the core type from the flags."""
    with open("/proc/cpuinfo") as fh:
        expected, _ = _blas.coretype_for(fh.read())
    out = _core_report(MTPFLOW_BLAS="openblas")
    assert out["ensure"]["status"] == "loaded", out
    if expected is None:
        assert out["coretype"] is None and out["core"], out
    else:
        assert out["coretype"] == expected and out["source"].startswith("set by mtpflow"), out
        assert out["core"].lower() == expected.lower(), out


@linux_only
@pytest.mark.skipif(_blas._multiarch() != "x86_64-linux-gnu", reason="Prescott is an x86-64 core type")
def test_an_openblas_coretype_of_the_users_wins(openblas_path):
    out = _core_report(OPENBLAS_CORETYPE="Prescott", MTPFLOW_BLAS="openblas")
    assert out["core"] == "Prescott" and out["coretype"] == "Prescott", out
    assert "environment" in out["source"], out


# -- MKL ----------------------------------------------------------------------------------


def _touch(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_bytes(b"")


def test_find_mkl_needs_mkl_and_a_tbb_runtime(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _touch(a, "libmkl_rt.so.2")
    assert _blas.find_mkl([str(a), str(b)]) is None  # no TBB: MKL's OpenMP layers oversubscribe
    _touch(b, "libtbb.so.12")
    assert _blas.find_mkl([str(a), str(b)]) == (str(a / "libmkl_rt.so.2"), str(b / "libtbb.so.12"))
    _touch(a, "libmkl_rt.so.3", "libtbb.so.12")  # the newest library, and the TBB next to it first
    assert _blas.find_mkl([str(a), str(b)]) == (str(a / "libmkl_rt.so.3"), str(a / "libtbb.so.12"))
    assert _blas.find_mkl([str(b)]) is None


@pytest.mark.parametrize(
    "env, intel, expect",
    [
        (None, True, "mkl"),
        (None, False, "openblas"),  # MKL's kernels are Intel's: other vendors keep OpenBLAS
        ("openblas", True, "openblas"),
        ("OpenBLAS", True, "openblas"),
        ("mkl", False, "mkl"),
        ("none", True, None),
    ],
)
def test_which_library_auto_and_named_choose(monkeypatch, env, intel, expect):
    libs = {"mkl": "/x/libmkl_rt.so.3", "openblas": "/y/libopenblas.so.0"}
    monkeypatch.setattr(_blas, "find_mkl", lambda dirs=None: (libs["mkl"], "/x/libtbb.so.12"))
    monkeypatch.setattr(_blas, "find_blas_library", lambda: libs["openblas"])
    monkeypatch.setattr(_blas, "_intel_cpu", lambda: intel)
    if env is None:
        monkeypatch.delenv(_blas.ENV_BLAS, raising=False)
    else:
        monkeypatch.setenv(_blas.ENV_BLAS, env)
    mode, path, why = _blas._resolve_requested()
    assert path == (libs[expect] if expect else None), (mode, path, why)
    assert mode == ("auto" if env is None else "disabled" if env == "none" else "explicit")


def test_mkl_asked_for_and_missing_says_what_to_install(monkeypatch):
    monkeypatch.setattr(_blas, "_STATE", None)
    monkeypatch.setattr(_blas, "find_mkl", lambda dirs=None: None)
    monkeypatch.setenv(_blas.ENV_BLAS, "mkl")
    if not LINUX:
        pytest.skip("Linux-only")
    r = _blas.ensure_fast_blas()
    assert r["status"] == "not_found" and "pip install mkl" in r["reason"], r


@pytest.fixture(scope="module")
def mkl_libs():
    found = _blas.find_mkl() if LINUX else None
    if found is None:
        pytest.skip("MKL with TBB not installed (pip install mkl)")
    return found


@linux_only
def test_mkl_in_effect_with_tbb_threads(mkl_libs):
    """With MKL installed (``scripts/install.sh`` installs it on Intel CPUs), MLX's products run
    in MKL through its TBB layer (set because unset), and the doctor says so."""
    report = _json_from(_run(CLI_SEQUENCE, MTPFLOW_BLAS="mkl"))
    blas = report["blas"]
    assert blas["preload_status"] == "loaded", blas
    assert os.path.realpath(blas["sgemm_provider"]) == os.path.realpath(mkl_libs[0]), blas
    assert blas["in_effect"] is True and blas["mkl_in_effect"] is True and blas["openblas_in_effect"] is False
    assert blas["mkl_threading"] == "TBB"
    maps = _json_from(_run(
        """
        import json
        from mtpflow.backend.blas import ensure_fast_blas
        r = ensure_fast_blas()
        import mlx.core as mx
        a = mx.random.normal((96, 80))
        b = mx.random.normal((80, 72))
        c = a @ b
        mx.eval(c)
        import numpy as np
        ref = np.asarray(a, dtype=np.float64) @ np.asarray(b, dtype=np.float64)
        err = float(np.abs(np.asarray(c) - ref).max())
        libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libtbb" in l or "libmkl" in l})
        print(json.dumps({"ensure": r, "libs": libs, "err": err}))
        """,
        MTPFLOW_BLAS="mkl", MKL_THREADING_LAYER="SEQUENTIAL",
    ))
    assert maps["ensure"]["mkl_threading"] == "SEQUENTIAL"  # the user's layer wins
    assert any("libmkl_sequential" in p for p in maps["libs"]), maps["libs"]
    assert maps["err"] < 1e-4  # and the products are right


@linux_only
def test_auto_prefers_mkl_on_intel_only(mkl_libs):
    report = _json_from(_run(CLI_SEQUENCE))
    blas = report["blas"]
    if _blas._intel_cpu():
        assert blas["mkl_in_effect"] is True and blas["mkl_threading"] == "TBB", blas
    else:
        assert blas["mkl_in_effect"] is False, blas

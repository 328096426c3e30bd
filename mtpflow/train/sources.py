"""What a training run reads: a data spec as token examples, or as cached target features
(``distill:`` and ``cache:`` parts, collected resumably by :mod:`mtpflow.train.features`)."""

from __future__ import annotations

from pathlib import Path

from . import data as data_mod
from .config import TrainConfig
from .parallel import Ranks
from .prompts import PromptError, encode_prompts, load_prompts
from .target import load_tokenizer


def training_data(target, data_spec, out: Path, cfg: TrainConfig, examples=None, ranks: Ranks | None = None,
                  taps=(), kv: bool = True):
    """``(examples, feats, distill_summary, cache_summary)`` of a data spec:
    ``distill:`` / ``cache:`` parts are collected (resumably) into
    ``out/features`` / ``out/features-cache`` and loaded (``feats``, and their
    tokens as ``examples``); other specs load as token examples.  With
    several ``ranks`` each collects its share of the shards, then all load
    the whole folder.  ``taps``: target layers whose states ``cache:``
    features keep too (the EAGLE-3 / DFlash kinds), read in this order;
    ``kv``: the kind reads the store-layer K/V (the assistant kind)."""
    feats = None
    distill = cache_summary = None
    parts = feature_parts(data_spec) if examples is None and isinstance(data_spec, str) else None
    if parts:
        from . import features as feat_mod

        feats = []
        tok = load_tokenizer(target)
        for source, spec in parts:
            if source == "distill":
                prompts = distill_prompts(spec, tok, max_prompt_len=max(4, cfg.max_len - cfg.distill_tokens))
                distill = feat_mod.collect(target, prompts, out / "features", max_new=cfg.distill_tokens,
                                           batch_size=cfg.distill_batch, max_time_s=cfg.distill_time_s,
                                           progress=cfg.progress, ranks=ranks)
                feats += feat_mod.load_features(out / "features", kv=kv)
            else:
                texts = data_mod.load_examples(spec, tok, max_len=cfg.max_len, target=target, seed=cfg.seed)
                folder = Path(cfg.cache_dir) if cfg.cache_dir else out / "features-cache"
                cache_summary = feat_mod.collect_text(target, texts, folder, batch_size=cfg.cache_batch,
                                                      max_time_s=cfg.cache_time_s, progress=cfg.progress, ranks=ranks,
                                                      taps=tuple(taps) + tuple(cfg.cache_taps), kv=kv)
                feats += feat_mod.load_features(folder, taps=tuple(taps), kv=kv)
        if not feats:
            raise data_mod.DataError(f"data spec {data_spec!r}: no features collected yet (a time limit of 0?); "
                                     "rerun with a longer --distill-time / --cache-time")
        examples = [data_mod.Example(f.tokens, f.loss) for f in feats]
    elif examples is None:
        tok = load_tokenizer(target)
        examples = data_mod.load_examples(data_spec, tok, max_len=cfg.max_len, target=target, seed=cfg.seed)
    return examples, feats, distill, cache_summary


def feature_parts(spec: str) -> list[tuple[str, str]] | None:
    """``[(source, spec)]`` of a data spec whose parts are cached-feature data
    (``distill:SPEC``, ``cache:SPEC``); ``None`` for on-the-fly data."""
    parts = [q.strip() for q in spec.split(",") if q.strip()]
    kinds = [q.partition(":")[0] for q in parts]
    feat = [k in ("distill", "cache") for k in kinds]
    if not any(feat):
        return None
    if not all(feat):
        raise data_mod.DataError(f"data spec {spec!r} mixes cached-feature parts (distill:, cache:) with other data; "
                                 "write the other parts as cache:SPEC so their features are cached too")
    if len(set(kinds)) != len(kinds):
        raise data_mod.DataError(f"data spec {spec!r}: at most one distill: and one cache: part (each has one "
                                 "features folder); join their data in one file instead")
    return [(k, q.partition(":")[2]) for k, q in zip(kinds, parts)]


def distill_prompts(spec: str, tokenizer, max_prompt_len: int = 192, min_prompt_len: int = 4) -> list[list[int]]:
    """Token ids of the prompts a ``distill:SPEC`` data spec names, each the
    first user turn of a conversation rendered with the chat template and the
    generation prompt (plain text without a template).

    ``SPEC``: ``sharegpt[:N]``, or a prompt file / set that
    :func:`mtpflow.train.prompts.load_prompts` reads (``FILE.jsonl``, ``FILE.txt``),
    with an optional ``:N``.  Prompts longer than ``max_prompt_len`` tokens are
    skipped (counted towards ``N`` only when kept)."""
    from .data import DataError, sharegpt_first_turns, split_limit

    if tokenizer is None:
        raise DataError("distill data needs the target's tokenizer (tokenizer.json in the target folder)")

    def enc(text: str):  # as mtpflow eval encodes a prompt (chat template when there is one)
        return encode_prompts(tokenizer, [text], chat=True)[0]

    name, limit = split_limit(spec)
    if name == "sharegpt":
        texts = sharegpt_first_turns()
    else:
        try:
            texts = iter(load_prompts(name))
        except PromptError as exc:
            raise DataError(f"distill:{spec}: {exc}") from None
    out, seen = [], set()
    for text in texts:
        if not isinstance(text, str) or text in seen or len(text) > 8 * max_prompt_len:
            continue  # (a token is rarely shorter than 1/8 character: skip hopeless texts before encoding)
        seen.add(text)
        ids = enc(text)
        if min_prompt_len <= len(ids) <= max_prompt_len:
            out.append(ids)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise DataError(f"distill:{spec} gave no prompt of {min_prompt_len}-{max_prompt_len} tokens")
    return out


"""Structured output on the speculative path: grammar masks at every verified position.

A request asks for structured output with ``SamplingParams.grammar``: a
grammar string of `llguidance <https://github.com/guidance-ai/llguidance>`_
(the ``structured`` extra: ``pip install "mtpflow[structured]"``), made by
:func:`grammar` from a JSON schema, a regular expression or a Lark grammar.
llguidance is used because it computes a token mask from a tokenizer's
bytes for any of the three, is maintained (vLLM and SGLang use it), has
wheels for every platform MLX runs on, needs no torch, and -- what speculative
decoding needs -- can consume drafted tokens and **roll them back**.

Per round, for every constrained row (:class:`GrammarMasks`):

* its matcher first consumes the row's newly emitted tokens (they are final);
* the mask of verified position 0 is the grammar's next-token mask; each
  draft is then tried in turn and the next position's mask computed after
  it; a draft the grammar refuses ends the walk (the target cannot produce
  it under the mask, so acceptance stops there anyway); the drafts are rolled
  back afterwards;
* the masks are applied to the target logits before any other processing,
  so the accepted drafts and the recovered / bonus token are exactly the
  target's constrained output, as target-only decoding with the same mask
  would give.

Computing masks after drafts needs the drafts on the host: a round with a
constrained row synchronises once more (after drafting).  Trees are off for
such rounds (a grammar walks one path).
"""

from __future__ import annotations

from typing import Any


def _require():
    from ._extras import require

    require("structured", "llguidance")


def grammar(kind: str, spec: Any) -> str:
    """An llguidance grammar string: ``kind`` ``"json_schema"`` (a dict or a
    JSON string), ``"json"`` (any JSON object), ``"regex"`` or ``"lark"``.
    Raises ``ValueError`` naming the problem when the spec is invalid."""
    _require()
    from llguidance import LLMatcher

    if kind == "json":
        kind, spec = "json_schema", {"type": "object"}
    if kind == "json_schema":
        try:
            g = LLMatcher.grammar_from_json_schema(spec)
        except ValueError as exc:
            raise ValueError(f"invalid JSON schema: {exc}") from None
    elif kind == "regex":
        g = LLMatcher.grammar_from_regex(str(spec))
    elif kind == "lark":
        g = LLMatcher.grammar_from_lark(str(spec))
    else:
        raise ValueError(f"unknown grammar kind {kind!r}; use json_schema, json, regex or lark")
    err = LLMatcher.validate_grammar(g)
    if err and not err.startswith("WARNING"):
        raise ValueError(f"invalid {kind} grammar: {err}")
    return g


class GrammarMasks:
    """Per-row llguidance matchers and the masks of a round's verified positions."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=()):
        _require()
        import llguidance.hf as llhf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(eos_ids) or None
        self.lltok = llhf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._matchers: dict[int, list] = {}  # id(request) -> [matcher, tokens consumed, request]

    def _matcher(self, row):
        from llguidance import LLMatcher

        key = id(row.request)
        entry = self._matchers.get(key)
        if entry is None or entry[2] is not row.request:
            m = LLMatcher(self.lltok, row.request.sampling.grammar, log_level=0)
            if m.is_error():
                raise ValueError(f"request {row.request.id}: invalid grammar: {m.get_error()}")
            entry = [m, 0, row.request]
            self._matchers[key] = entry
        m, done, _ = entry
        new = row.generated[done:]
        if new:
            m.consume_tokens(list(new))
            entry[1] = len(row.generated)
        return m

    def forget(self, rows) -> None:
        """Drop the matchers of requests no longer in ``rows``."""
        live = {id(r.request) for r in rows}
        for k in [k for k in self._matchers if k not in live]:
            del self._matchers[k]

    def masks(self, rows, drafts_host, L: int):
        """``[B, L, V]`` bool (True = allowed) for the rows' verified positions,
        ``drafts_host``: per row the drafted ids (a host list, ``L - 1`` each)."""
        import mlx.core as mx
        import numpy as np
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        B, V = len(rows), self.vocab_size
        bits = allocate_token_bitmask(B * L, V)  # all allowed (-1) unless filled
        for b, row in enumerate(rows):
            if row.request.sampling.grammar is None:
                continue
            m = self._matcher(row)
            consumed = 0
            for pos in range(L):
                fill_next_token_bitmask(m, bits, b * L + pos)
                if pos == L - 1:
                    break
                tok = int(drafts_host[b][pos])
                if m.try_consume_tokens([tok]) != 1:
                    break  # a refused draft: acceptance stops here; later masks do not matter
                consumed += 1
            if consumed:
                m.rollback(consumed)
        unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little").reshape(B * L, -1)[:, :V]
        return mx.array(unpacked.reshape(B, L, V).astype(bool))

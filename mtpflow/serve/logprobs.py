"""Log-probabilities of emitted tokens for ``mtpflow serve`` (``logprobs`` / ``top_logprobs``).

What is reported is the **target's processed distribution** at each emitted
position -- the distribution the token was chosen from: the target's logits
after the configured logits processors, logit bias and the repetition, frequency and presence penalties,
then (sampled requests) temperature, top-k, top-p and min-p, as a
log-softmax (tokens a filter removed have probability 0 and are never
listed).  A greedy request (temperature 0) reports the same distribution at
temperature 1 without the filters (its one-hot choice would say nothing).

With speculation the logits of an emitted position are the verify forward's
logits at that position (for a draft tree: at the accepted node's parent) --
the target's own logits for that context -- so the numbers equal those of
``speculative: false`` up to float rounding of the batched forward, and a
recovered or bonus token gets the target's probability, not the residual
distribution it was drawn from.

:class:`LogprobRecorder` is a plugin of the server's session: hook wrappers
around ``mtpflow_prefill`` (the first token) and ``mtpflow_accept`` (the
verified block) build the log-probabilities lazily, next to the round's own
graph (``mx.async_eval``, so the round's one synchronisation computes them),
and ``mtpflow_emit`` turns those of the emitted tokens into host numbers.
It does nothing in a round where no row asked for log-probabilities.
"""

from __future__ import annotations

import math

import attrs

from mtpflow import hookimpl

#: OpenAI's limits: completions ``logprobs`` <= 5, chat ``top_logprobs`` <= 20
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20


def _reporting_params(sp):
    """The sampling parameters whose processed distribution is reported for a request."""
    if sp.greedy:
        return attrs.evolve(sp, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    return sp


def processed_logprobs(session, rows, logits, drafts=None, prefill: bool = False):
    """``[B, L, V]`` (``[B, V]``) log-probabilities of the rows' processed target distribution."""
    import mlx.core as mx

    from ..sampling import ProcessParams, process_logits

    sampler = session.sampler
    pre = getattr(sampler, "_pre", None)  # the sampler's configured logits processors
    if pre is not None:
        logits = pre(logits, rows, drafts) if drafts is not None else pre(logits, rows)
    sampling_of = getattr(sampler, "sampling_of", None) or (lambda r: r.request.sampling)
    V = int(logits.shape[-1])
    params = ProcessParams.from_rows([_reporting_params(sampling_of(r)) for r in rows], V)
    context = starts = None
    if params.reads_context:
        ctx = [list(r.request.prompt) + ([] if prefill else list(r.generated)) for r in rows]
        T = max(len(c) for c in ctx)
        context = mx.array([c + [-1] * (T - len(c)) for c in ctx], dtype=mx.int32)
        from ..state import completion_start

        starts = mx.array([completion_start(r.request) for r in rows], dtype=mx.int32)
    return process_logits(logits, params, context, appended=drafts, completion_start=starts)


def _gather(lp, tokens, top: int):
    """Lazy (chosen [B, L], top ids [B, L, n], top values [B, L, n]) of ``lp`` [B, L, V]."""
    import mlx.core as mx

    chosen = mx.take_along_axis(lp, tokens.astype(mx.int32)[..., None], axis=-1)[..., 0]
    if top <= 0:
        return chosen, None, None
    ids = mx.argpartition(-lp, kth=top - 1, axis=-1)[..., :top]
    return chosen, ids, mx.take_along_axis(lp, ids, axis=-1)


def _entries(chosen: list, ids, vals, n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    out = []
    for j in range(n):
        top = []
        if ids is not None:
            top = sorted(((i, v) for i, v in zip(ids[j], vals[j]) if math.isfinite(v)), key=lambda t: -t[1])
        out.append((float(chosen[j]), top))
    return out


class LogprobRecorder:
    """Session plugin recording the log-probabilities of emitted tokens per request id.

    ``wanted[request_id] = n`` asks for each emitted token's log-probability
    and its ``n`` most likely alternatives; entries accumulate in
    ``out[request_id]`` as ``(logprob, [(token_id, logprob), ...])``, one per
    emitted token, in order.
    """

    def __init__(self):
        self.wanted: dict[str, int] = {}
        self.out: dict[str, list] = {}
        self._pending = None

    def discard(self, request_id: str) -> None:
        self.wanted.pop(request_id, None)
        self.out.pop(request_id, None)

    def take(self, request_id: str, n: int) -> list:
        """The first ``n`` entries recorded for ``request_id`` (removed); missing ones are ``None``."""
        got = self.out.get(request_id, [])
        head, self.out[request_id] = got[:n], got[n:]
        return head + [None] * (n - len(head))

    def lookahead_safe(self, state) -> bool:
        """The null path may build the next round early only while no row asks
        for log-probabilities (each accept call replaces the pending ones)."""
        return not self.wanted or self._top(state.rows) is None

    def _top(self, rows) -> int | None:
        tops = [self.wanted[r.request.id] for r in rows if r.request.id in self.wanted]
        return max(tops) if tops else None

    @hookimpl(wrapper=True)
    def mtpflow_prefill(self, session, requests):
        state = yield
        top = self._top(state.rows) if self.wanted else None
        if top is None:
            return state
        import mlx.core as mx

        # the first token's logits, [B, V] as the sampler's first() sees them
        lp = processed_logprobs(session, state.rows, session.target.logits(state.hidden), prefill=True)[:, None, :]
        chosen, ids, vals = _gather(lp, state.last_tokens[:, None], top)
        mx.eval(*[a for a in (chosen, ids, vals) if a is not None])
        chosen = chosen.tolist()
        ids = ids.tolist() if ids is not None else None
        vals = vals.tolist() if vals is not None else None
        for b, row in enumerate(state.rows):
            rid = row.request.id
            if rid in self.wanted and row.generated:
                n = self.wanted[rid]
                e = _entries(chosen[b], None if ids is None else [x[:n] for x in ids[b]],
                             None if vals is None else [x[:n] for x in vals[b]], 1)
                self.out.setdefault(rid, []).extend(e)
        return state

    @hookimpl(wrapper=True)
    def mtpflow_accept(self, session, state, draft, verify):
        acc = yield
        self._pending = None
        top = self._top(state.rows) if self.wanted else None
        if top is None:
            return acc
        import mlx.core as mx

        logits = verify.logits
        if getattr(acc, "path", None) is not None:
            # a tree: emitted token j is predicted at the accepted node of depth j (the root for j = 0)
            B, N = logits.shape[0], logits.shape[1]
            at = mx.concatenate([mx.zeros((B, 1), dtype=mx.int32), mx.clip(acc.path.astype(mx.int32), 0, N - 1)],
                                axis=1)
            logits = mx.take_along_axis(logits, at[:, :, None], axis=1)
            drafts = None  # trees run only where processing does not read the drafts
        else:
            drafts = draft.tokens.astype(mx.int32) if draft.n_draft > 0 else None
        lp = processed_logprobs(session, state.rows, logits, drafts=drafts)
        arrays = _gather(lp, acc.tokens, top)
        mx.async_eval(*[a for a in arrays if a is not None])  # computed by the round's own sync
        self._pending = ([r.request.id for r in state.rows], arrays)
        return acc

    @hookimpl
    def mtpflow_emit(self, session, record, emitted):
        pending, self._pending = self._pending, None
        if pending is None:
            return
        rids, (chosen, ids, vals) = pending
        chosen = chosen.tolist()
        ids = ids.tolist() if ids is not None else None
        vals = vals.tolist() if vals is not None else None
        for b, rid in enumerate(rids):
            if rid not in self.wanted or not emitted.get(rid):
                continue
            n = self.wanted[rid]
            e = _entries(chosen[b], None if ids is None else [x[:n] for x in ids[b]],
                         None if vals is None else [x[:n] for x in vals[b]], len(emitted[rid]))
            self.out.setdefault(rid, []).extend(e)


# --------------------------------------------------------------------------------------
# OpenAI shapes
# --------------------------------------------------------------------------------------
class TokenText:
    """A token's text as it reads inside a text (cached per id).

    A token is decoded after an anchor token and the anchor's text is cut
    off: SentencePiece-style decoders drop a token's leading space at the
    start of a decode, which would glue the tokens of ``"a b"`` into
    ``"ab"``.  (A token that is part of a multi-byte character shows as
    U+FFFD; ``bytes`` are those of that text.)
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.anchor: list[int] = []
        self.anchor_text = ""
        if tokenizer is not None:
            try:
                ids = list(tokenizer.encode("a", add_special_tokens=False))[-1:]
                text = tokenizer.decode(ids)
                if text:
                    self.anchor, self.anchor_text = ids, text
            except Exception:  # no anchor: plain decoding
                pass

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            if self.tokenizer is None:
                s = str(tid)
            else:
                s = self.tokenizer.decode(self.anchor + [tid])
                s = s[len(self.anchor_text):] if s.startswith(self.anchor_text) else self.tokenizer.decode([tid])
            self.cache[tid] = s
        return s


def _lp(x: float) -> float:
    return max(x, -9999.0)  # OpenAI's floor for "effectively impossible"


def chat_content(tokens: list[int], entries: list, text: TokenText) -> list[dict]:
    """``choices[i].logprobs.content`` of the chat API."""
    out = []
    for t, e in zip(tokens, entries):
        s = text(t)
        lp, top = e if e is not None else (-9999.0, [])
        out.append({
            "token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": text(i), "logprob": _lp(v), "bytes": list(text(i).encode("utf-8"))}
                             for i, v in top],
        })
    return out


def completion_logprobs(tokens: list[int], entries: list, offsets: list[int], text: TokenText,
                        want_top: bool) -> dict:
    """``choices[i].logprobs`` of the legacy completions API."""
    return {
        "tokens": [text(t) for t in tokens],
        "token_logprobs": [_lp(e[0]) if e is not None else None for e in entries],
        "top_logprobs": [{text(i): _lp(v) for i, v in e[1]} if e is not None else None for e in entries]
        if want_top else None,
        "text_offset": list(offsets),
    }


__all__ = ["LogprobRecorder", "MAX_COMPLETION_LOGPROBS", "MAX_TOP_LOGPROBS", "TokenText",
           "chat_content", "completion_logprobs", "processed_logprobs"]

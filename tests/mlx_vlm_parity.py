"""What the native-MTP parity tests against mlx-vlm 0.7.10 share: a fixture
folder (a tiny checkpoint plus mlx-vlm's ``reference.json``, written by a
generator under ``tests/fixtures/tools/`` in its own virtualenv), sessions on
it, greedy decoding with no early stop (mlx-vlm's loop has no EOS there) and
the round-by-round comparison."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
from conftest import RoundLog, quiet_log

from mtpflow.config import load_config
from mtpflow.engine import generate_stream, load_session, make_request
from mtpflow.plugins import make_plugin_manager


class Reference:
    def __init__(self, fixture: Path):
        self.path = fixture
        self.ref = json.loads((fixture / "reference.json").read_text())
        self.max_tokens = self.ref["max_tokens"]

    def session(self, block: int, context: str, log=None, **overrides):
        ov = {"model": {"model": str(self.path), "draft_kind": "mtp"}, "draft": {"block_size": block, "policy": "fixed"},
              "plugins": {"native_mtp": {"context": context}}, **overrides}
        pm = make_plugin_manager([log] if log is not None else [])
        return load_session(load_config(overrides=ov), plugins=pm, log=quiet_log())

    def runs(self, block: int) -> list[dict]:
        return [r for r in self.ref["runs"] if r["block_size"] == block]

    def decode(self, s, prompts) -> list[list[int]]:
        """Greedy decode ``prompts`` together, ``max_tokens`` each, never stopping early."""
        reqs = [attrs.evolve(make_request(s, p, max_tokens=self.max_tokens, request_id=str(i)), stop_ids=frozenset())
                for i, p in enumerate(prompts)]
        out = {r.id: [] for r in reqs}
        for ev in generate_stream(s, reqs):
            out[ev.request_id].extend(ev.tokens)
        return [out[r.id] for r in reqs]

    def rounds_match(self, block: int) -> list[tuple]:
        """Decode each of mlx-vlm's runs at ``block`` with ``context = "drafted"``:
        the same tokens, and per round the same drafts and accepted count (the
        last rounds excepted: mlx-vlm counts the last round's bonus in the token
        budget, mtpflow does not).  Returns the matched ``(drafted, accepted,
        drafts)`` rounds of all runs."""
        log = RoundLog()
        s = self.session(block, "drafted", log)
        assert s.draft_kind == "native_mtp"
        drafted, matched = [], []
        propose = s.drafter.propose

        def recording(*args, **kwargs):
            d = propose(*args, **kwargs)
            if d.n_draft:
                drafted.append(d.tokens[0].tolist())
            return d

        s.drafter.propose = recording
        for run in self.runs(block):
            log.records.clear()
            drafted.clear()
            (toks,) = self.decode(s, [run["prompt"]])
            assert toks == run["tokens"]
            ours = [(r.drafted, r.accepted[0], t) for r, t in zip([r for r in log.records if r.drafted], drafted)]
            theirs = list(zip(run["draft_lens"], run["accept_lens"], run["drafts"]))
            n = 0
            while n < min(len(ours), len(theirs)) and ours[n][0] == theirs[n][0]:
                n += 1
            assert n >= len(theirs) - (block - 1)
            assert ours[:n] == theirs[:n]
            matched += ours[:n]
        return matched

    def tau_of_theirs(self, block: int) -> float:
        acc = [a for r in self.runs(block) for a in r["accept_lens"]]
        return 1 + sum(acc) / len(acc)

    def head_logits(self, s):
        """``(ours, mlx-vlm's)`` MTP-head logits over the fixture's head input."""
        import mlx.core as mx
        import numpy as np

        d, h = s.drafter, self.ref["head"]
        tokens = mx.array(h["tokens"], dtype=mx.int32)
        L = tokens.shape[1]
        out = d._run(0, tokens, mx.array(h["hidden"]), mx.arange(L, dtype=mx.int32)[None], caches=d.family.make_caches())
        return np.array(s.target.logits(out)), np.array(h["logits"])

"""Fault injection for testing the server's row isolation (a plugin; never loaded by default).

A request whose prompt (token ids) starts with :data:`FAULT_PREFILL` makes
the prefill it joins raise; one starting with :data:`FAULT_ROUND` makes
every round it is in raise (after the verify forward, as a broken sampler or
plugin would); :data:`SLOW` rows make each round 50 ms longer.  The ids need
a vocabulary of at least 2048 tokens (the test fixtures have exactly that).

Load it into a server with ``mtpflow serve --set 'plugins.load=["mtpflow.serve.faults"]'``
(``python -m mtpflow.loadtest --faults`` does), or register a
:class:`Faults` instance yourself (the tests do, to read what it saw).
"""

from __future__ import annotations

import time

from mtpflow import hookimpl

FAULT_PREFILL = [2047, 2046, 2047]
FAULT_ROUND = [2046, 2047, 2046]
SLOW = [2045, 2045, 2045]


class Faults:
    """The fault-injecting plugin; ``raised_with`` records ``(stage, rows in the batch)`` of every raise."""

    def __init__(self, slow_s: float = 0.05):
        self.slow_s = slow_s
        self.raised_with: list[tuple[str, int]] = []

    @staticmethod
    def marked(requests, mark) -> bool:
        return any(list(r.prompt[: len(mark)]) == mark for r in requests)

    @hookimpl(wrapper=True)
    def mtpflow_prefill(self, session, requests):
        if self.marked(requests, FAULT_PREFILL):
            self.raised_with.append(("prefill", len(requests)))
            raise RuntimeError("injected fault in the prefill")
        return (yield)

    @hookimpl(wrapper=True)
    def mtpflow_accept(self, session, state, draft, verify):
        acc = yield
        reqs = [r.request for r in state.rows]
        if self.marked(reqs, FAULT_ROUND):
            self.raised_with.append(("round", len(reqs)))
            raise RuntimeError("injected fault in the round")
        if self.marked(reqs, SLOW):
            time.sleep(self.slow_s)
        return acc


_default = Faults()


# module-level hooks, so that the module itself is the plugin (``plugins.load``)
@hookimpl(wrapper=True)
def mtpflow_prefill(session, requests):
    return (yield from Faults.mtpflow_prefill(_default, session, requests))


@hookimpl(wrapper=True)
def mtpflow_accept(session, state, draft, verify):
    return (yield from Faults.mtpflow_accept(_default, session, state, draft, verify))


__all__ = ["FAULT_PREFILL", "FAULT_ROUND", "Faults", "SLOW"]

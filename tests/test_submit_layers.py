"""A verify that starts each target layer as it is built (``[generation]
submit_layers``): on a CPU stream ``mx.async_eval`` returns only when the
last few ops are in flight, so this is how graph building overlaps compute.
The values must be exactly those of one graph evaluated at the end."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, make_session, prompt, reference

from mtpflow.config import ConfigError, load_config
from mtpflow.engine import generate_stream, make_request


class AsyncEvals:
    """Counts ``mx.async_eval`` calls and the arrays each was given."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = mx.async_eval

        def counted(*arrays):
            self.calls.append(arrays)
            return real(*arrays)

        monkeypatch.setattr(mx, "async_eval", counted)


def decode(session, ids, n):
    req = make_request(session, ids, max_tokens=n)
    return [t for ev in generate_stream(session, [req]) for t in ev.tokens]


@pytest.mark.parametrize("taps", [(), (1, 3, 5)])
def test_a_submitted_forward_equals_one_graph_and_starts_every_layer_but_the_last(monkeypatch, taps):
    target = make_session("e", with_drafter=False).target
    n = len(target.inner.layers)
    outs = {}
    for submit in (False, True):
        cache, _ = target.prefill([prompt("e", "long")])
        target.set_offsets(cache, mx.array([len(prompt("e", "long"))], dtype=mx.int32))
        seen = AsyncEvals(monkeypatch)
        hidden, got = target.forward_with_taps(mx.array([[7, 11]], dtype=mx.int32), cache, taps, submit=submit)
        # each submitted array is one layer's output, built and not yet evaluated by anyone else
        assert len(seen.calls) == (n - 1 if submit else 0)
        assert all(len(c) == 1 and c[0].shape == hidden.shape for c in seen.calls)
        mx.eval(hidden, *got.values(), *[c.keys for c in cache], *[c.values for c in cache])
        outs[submit] = (np.array(hidden), {k: np.array(v) for k, v in got.items()},
                        [np.array(a) for c in cache for a in (c.keys, c.values, c.positions)])
        monkeypatch.undo()
    (h0, t0, k0), (h1, t1, k1) = outs[False], outs[True]
    assert np.array_equal(h0, h1)
    assert t0.keys() == t1.keys() == set(taps) and all(np.array_equal(t0[k], t1[k]) for k in taps)
    assert all(np.array_equal(a, b) for a, b in zip(k0, k1))


@pytest.mark.parametrize("mode", ["on", "off"])
def test_decoding_submits_layers_only_when_asked_and_the_tokens_do_not_change(monkeypatch, mode):
    s = make_session("e", block_size=3, generation={"submit_layers": mode})
    n = len(s.target.inner.layers)
    assert s.submit_layers is (mode == "on")
    ids = prompt("e", "long")
    seen = AsyncEvals(monkeypatch)
    out = decode(s, ids, 24)
    monkeypatch.undo()
    assert out == reference(s, ids, 24)  # the drafted chain rounds verify as before
    layer_outputs = [c for c in seen.calls if len(c) == 1 and c[0].ndim == 3 and c[0].shape[-1] == s.target.hidden_size]
    if mode == "on":
        assert len(layer_outputs) >= (n - 1) * s.stats.rounds
    else:
        assert layer_outputs == []


def test_trees_and_the_null_path_submit_too(monkeypatch):
    for block, tree in ((1, "off"), (3, "2,1")):
        s = make_session("e", block_size=block, draft={"tree": tree, "policy": "fixed"}, generation={"submit_layers": "on"})
        ids = prompt("e", "short")
        trees = []
        real_tree = s.target.forward_tree

        def spy(*a, submit=False, **kw):
            trees.append(submit)
            return real_tree(*a, submit=submit, **kw)

        seen = AsyncEvals(monkeypatch)
        monkeypatch.setattr(s.target, "forward_tree", spy)
        out = decode(s, ids, 20)
        monkeypatch.undo()
        assert out == reference(s, ids, 20)
        assert trees == ([] if tree == "off" else [True] * len(trees)) and (tree == "off" or trees)
        hs = s.target.hidden_size
        per_round = len(s.target.inner.layers) - 1
        assert sum(1 for c in seen.calls if len(c) == 1 and c[0].ndim == 3 and c[0].shape[-1] == hs) >= per_round * s.stats.rounds


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_draft_model_submits_its_layers_as_the_target_does(monkeypatch, mode):
    """The ``model`` kind's k small forwards per round start layer by layer too."""
    s = make_session("e", block_size=4, with_drafter=False, generation={"submit_layers": mode},
                     model={"draft_kind": "model", "draft_model": str(FIXTURES / "pair_d" / "target")})
    ids = prompt("e", "short")
    calls = []
    real = s.drafter.model.forward_with_taps

    def spy(tokens, cache, layers=(), submit=False, **kw):
        calls.append(submit)
        return real(tokens, cache, layers, submit=submit, **kw)

    monkeypatch.setattr(s.drafter.model, "forward_with_taps", spy)
    assert decode(s, ids, 20) == reference(s, ids, 20)
    on = mode == "on"
    # one forward per drafted token (the catch-up, then k - 1 single steps) follows the setting;
    # the drafter's own prefill (the prompt but its last token, then that token) does not submit
    assert calls.count(on) >= s.stats.draft_tokens > 0
    assert calls.count(not on) == (2 if on else 0)


def test_auto_is_on_for_a_cpu_device_and_a_bad_value_is_refused(monkeypatch):
    s = make_session("e", with_drafter=False)
    assert s.config.generation.submit_layers == "auto"
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert s.submit_layers is True
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))  # Metal / CUDA: async_eval runs ahead already
    assert s.submit_layers is False
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="submit_layers"):
        load_config(overrides={"generation": {"submit_layers": "sometimes"}})

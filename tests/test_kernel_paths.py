"""The attention kernel each call would run on CUDA, and the greedy token, as mlx-lm's own loop.

On the CPU every attention call runs one unfused computation, so what a GPU would run is read from
the call itself: MLX 0.32's CUDA backend picks cuDNN, its fused vector kernel or the unfused
fallback from the query and key lengths, the head dim, the dtype, the kind of mask, and, for a
one-query step over >= 256 keys, from the buffer the keys are sliced from (cuDNN's decoding path
takes a slice of a cache buffer of whole 256-slot steps and reads it from the buffer's start).
:func:`cuda_kernel` restates those rules; the tests compare, call by call, mtpflow's block-1
rounds and mlx-lm's ``generate_step`` on a random bf16 Gemma 4 pair whose window (256) the
context outgrows, through prefill, the window and the cache compactions.  ``tests/
test_attention_paths.py`` compares the masks and key lengths on the small fixture."""

import importlib.util
import random
from pathlib import Path

import mlx.core as mx
import pytest

from mtpflow.engine import generate_stream, make_request, target_only_greedy
from mtpflow.targets import cache as slot_cache

ROOT = Path(__file__).resolve().parents[1]
WINDOW, PROMPT, NEW = 256, 300, 70  # the prompt outgrows the window; the engine compacts after ~340 slots


def cuda_kernel(q_len, k_len, mask, dtype, head_dim, cap, start) -> str:
    """The kernel MLX 0.32's CUDA SDPA runs for a call (``cap``: the slots of the buffer the keys
    are a slice of, ``start``: the slice's first slot)."""
    arr = mask is not None and not isinstance(mask, str)
    half = dtype in (mx.float16, mx.bfloat16)
    vector = q_len < 4 and head_dim in (64, 96, 128) and not arr
    cudnn_dims = head_dim % 8 == 0 and head_dim <= 128 and half
    if q_len == 1:  # the graph is built with the vector kernel in mind; cuDNN decodes a cache slice
        if not vector:
            return "fallback"
        if k_len >= 256 and cap % 256 == 0 and cudnn_dims:
            return "cudnn decode" if start == 0 else "cudnn decode from the buffer's start (wrong keys)"
        return "vector"
    if cudnn_dims and not (mask == "causal" and q_len > k_len):
        return "cudnn"
    return "vector" if vector else "fallback"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("make_gemma4_pair", ROOT / "scripts" / "make_gemma4_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build(tmp_path_factory.mktemp("pair"), hidden=128, layers=3, vocab=2048, window=WINDOW)


@pytest.fixture(scope="module")
def session(pair):
    from mtpflow.config import load_config
    from mtpflow.engine import load_session
    from mtpflow.logs import null_logger

    return load_session(load_config(overrides={
        "model": {"model": str(pair[0]), "draft_model": str(pair[1]), "dtype": "bfloat16"},
        "draft": {"block_size": 1, "policy": "fixed"},
        "generation": {"fuse_ops": "off", "submit_layers": "off", "bucket_shapes": "on"},  # the CUDA profile's
    }), log=null_logger())


@pytest.fixture
def calls(monkeypatch):
    """Every SDPA call's ``(kernel, mask kind, q len, k len, dtype)``, with the buffer its keys
    come from as each cache class hands them over (a GPU's choice of window buffer)."""
    from mlx_lm.models import cache as lm_cache

    got, where = [], {}
    monkeypatch.setattr(slot_cache, "_on_cuda", lambda: True, raising=False)
    monkeypatch.setattr(slot_cache.SlotKVCache, "causal_array", False)  # a GPU's masks

    def slot_update(self, keys, values, _f=slot_cache.SlotKVCache.update_and_fetch):
        k, v = _f(self, keys, values)
        start = self.idx - k.shape[2] if k.shape[2] != self.idx else 0
        own = getattr(self, "window_buffer", False) is not False and start  # a take: a buffer of its own
        where[id(k)] = (k.shape[2], 0) if own else (self.keys.shape[2], start)
        return k, v

    def lm_update(cls):
        f = cls.update_and_fetch

        def rec(self, keys, values):
            k, v = f(self, keys, values)
            where[id(k)] = (self.keys.shape[2], 0)  # a prefix slice of its buffer, or the buffer
            return k, v
        return rec

    monkeypatch.setattr(slot_cache.SlotKVCache, "update_and_fetch", slot_update)
    for cls in (lm_cache.KVCache, lm_cache.RotatingKVCache):
        monkeypatch.setattr(cls, "update_and_fetch", lm_update(cls))
    sdpa = mx.fast.scaled_dot_product_attention

    def rec_sdpa(q, k, v, *a, mask=None, **kw):
        cap, start = where.get(id(k), (k.shape[2], 0))
        kind = "none" if mask is None else mask if isinstance(mask, str) else "array"
        got.append((cuda_kernel(q.shape[2], k.shape[2], mask, q.dtype, q.shape[3], cap, start), kind,
                    q.shape[2], k.shape[2], q.dtype))
        return sdpa(q, k, v, *a, mask=mask, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", rec_sdpa)
    return got


def _prompt(vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(PROMPT)]


def _engine(s, p, n):
    req = make_request(s, p, max_tokens=n)
    req.stop_ids = frozenset()
    return [t for ev in generate_stream(s, [req]) for t in ev.tokens]


def test_rounds_run_mlx_lms_kernels_past_the_window(session, calls):
    """Per attention call, the kernel a GPU would run, the mask kind, the query and key lengths
    and the dtype are mlx-lm's, through the window and the cache's compactions."""
    from mlx_lm.generate import generate_step

    s, p = session, _prompt(session.target.vocab_size)
    ref = [int(t) for t, _ in zip((t for t, _ in generate_step(mx.array(p), s.target.model, max_tokens=NEW)), range(NEW))]
    want = list(calls)
    calls.clear()
    assert _engine(s, p, NEW) == ref
    got = list(calls)
    assert len(got) <= len(want) and got == want[: len(got)]  # mlx-lm builds one step ahead
    assert len(got) >= 3 * NEW
    kernels = {c[0] for c in got}
    assert "cudnn decode" in kernels and not any("wrong" in k for k in kernels)
    calls.clear()
    assert target_only_greedy(s.target, p, NEW) == ref
    assert list(calls) == got


def test_a_compacted_cache_keeps_whole_steps():
    c = slot_cache.SlotKVCache(window=4, retain=6)
    c.offset = mx.array([0], dtype=mx.int32)
    for _ in range(300):
        c.update_and_fetch(mx.ones((1, 1, 1, 8)), mx.ones((1, 1, 1, 8)))
    c.compact(6, mx.array([294], dtype=mx.int32))
    k, v, pos = c.view()
    assert c.keys.shape[2] % c.step == 0 and c.idx == 6 and pos.tolist() == [list(range(294, 300))]


def test_the_window_buffer_changes_no_logit(session):
    """A window handed over in a buffer of its own (a GPU) and as a slice (the CPU) give the
    same logits, bitwise."""
    s, p = session, _prompt(session.target.vocab_size, seed=1)[: WINDOW + 4]
    out = {}
    for own in (False, True):
        slot_cache.SlotKVCache.window_buffer = own
        try:
            cache, h = s.target.prefill([p])
            logits = []
            for _ in range(4):
                logits.append(s.target.logits(h))
                h = s.target.forward(mx.argmax(logits[-1], axis=-1)[:, None].astype(mx.int32), cache)[:, -1]
            out[own] = mx.stack(logits)
        finally:
            slot_cache.SlotKVCache.window_buffer = None
    assert mx.array_equal(out[False], out[True]).item()


def test_greedy_tokens_are_mlx_lms_in_bf16():
    """mlx-lm and mlx-vlm take the argmax of ``logits - logsumexp(logits)`` in the logits' dtype;
    in bf16 two logits 1/64 apart round to one log-probability and the lower id wins."""
    from mlx_lm.sample_utils import make_sampler

    from mtpflow.builtins.samplers import GreedySampler
    from mtpflow.sampling import greedy_accept

    V = 2048
    logits = mx.zeros((1, V), dtype=mx.bfloat16)
    logits[0, 7] = 1.0
    logits[0, 9] = 1.015625  # one bf16 step above, near 1; the log-probabilities near -7.6 step by 1/32
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = int(make_sampler(temp=0.0)(lp)[0].item())
    assert want == 7 and int(mx.argmax(logits, axis=-1)[0].item()) == 9
    sampler = GreedySampler()
    sampler.prepare([], V)
    assert int(sampler.first(logits, None)[0].item()) == want
    _, tokens = greedy_accept(logits[:, None], mx.zeros((1, 0), mx.int32))
    assert int(tokens[0, 0].item()) == want

"""Training throughput against the machine's limit: FLOPs per step and the measured matmul rate.

:class:`count_matmuls` counts the multiply-add FLOPs of the matrix products a
piece of code *builds* (lazily, nothing is evaluated): every ``nn.Linear`` /
``nn.QuantizedLinear`` call (``2·N·in·out``), every tied head
(``Embedding.as_linear``, ``2·N·D·V``), every
``mx.fast.scaled_dot_product_attention`` (``4·B·H·L·S·d``: scores and the
weighted sum, whatever the mask hides) and every ``mx.matmul``.  Elementwise
work (norms, softmax, RoPE) is left out, as MFU figures do.

A training step costs ``3 ×`` the forward FLOPs of the trained module (the
forward, and a backward of about twice it: gradients of the activations and of
the weights), less once the products by a weight that is not trained (a frozen
LM head: its backward computes the activations' gradient only), plus the frozen
target's forward when its features are not cached (no backward through it).
The objective names the weights it trains (:meth:`count_matmuls.trained`, the
arrays the gradient is taken of); a counter never told counts every weight as
trained.  Products a checkpointed block recomputes in the backward
(``--grad-checkpoint``) count apart, in :attr:`count_matmuls.recomputed`: the share is of the
model's FLOPs (MFU), not of the hardware's (recomputation included).  :func:`matmul_rate`
measures the machine: a loop of ``1024³`` float32 matmuls in the same process,
so the share ``step FLOPs / step time / rate`` stays meaningful on a busy
machine (both are slowed alike).
"""

from __future__ import annotations

import contextlib
import time

import mlx.core as mx
import mlx.nn as nn

__all__ = ["count_matmuls", "matmul_rate", "Throughput"]


def _rows(x) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


class count_matmuls:
    """``with count_matmuls() as c: ...`` -- ``c.flops``: the matmul FLOPs built inside.

    Patches the classes and functions above for the duration of the block
    (single-threaded code; nested counters each count)."""

    _active: list = []

    def __init__(self):
        self.flops = 0
        #: the forward FLOPs of products by a weight outside :meth:`trained`'s (no weight gradient)
        self.frozen = 0
        #: the FLOPs of products recomputed in the backward (:meth:`recomputing`), in neither of the above
        self.recomputed = 0
        self._trained: set | None = None
        self._held: list = []  # the arrays named trained, alive while counting: their ids stay theirs

    _recomputing: int = 0

    @classmethod
    @contextlib.contextmanager
    def recomputing(cls):
        """Inside: the products built are a checkpointed block's recomputation in the backward."""
        cls._recomputing += 1
        try:
            yield
        finally:
            cls._recomputing -= 1

    @classmethod
    def trained(cls, params) -> None:
        """The weights (a tree of arrays) the gradient is taken of, for the active counters: a
        product by any other weight counts in :attr:`frozen` too."""
        from mlx.utils import tree_flatten

        arrays = [a for _, a in tree_flatten(params)]
        ids = {id(a) for a in arrays}
        for c in cls._active:
            # (held: a freed array's id could name a frozen weight made later, e.g. a head's rows)
            c._held.append(arrays)
            c._trained = ids if c._trained is None else c._trained | ids

    @classmethod
    def _add(cls, n: int, weight=None) -> None:
        for c in cls._active:
            if cls._recomputing:
                c.recomputed += int(n)
                continue
            c.flops += int(n)
            if weight is not None and c._trained is not None and id(weight) not in c._trained:
                c.frozen += int(n)

    def __enter__(self):
        cls = type(self)
        if not cls._active:
            cls._patch()
        cls._active.append(self)
        return self

    def __exit__(self, *exc):
        cls = type(self)
        cls._active.remove(self)
        self._held = []
        if not cls._active:
            cls._unpatch()
        return False

    _saved: dict = {}

    @classmethod
    def _patch(cls) -> None:
        lin, qlin = nn.Linear.__call__, nn.QuantizedLinear.__call__
        emb, qemb = nn.Embedding.as_linear, nn.QuantizedEmbedding.as_linear
        sdpa, mm = mx.fast.scaled_dot_product_attention, mx.matmul
        cls._saved = {"lin": lin, "qlin": qlin, "emb": emb, "qemb": qemb, "sdpa": sdpa, "mm": mm}

        def linear(self, x):
            cls._add(2 * _rows(x) * self.weight.shape[0] * x.shape[-1], self.weight)
            return lin(self, x)

        def qlinear(self, x):
            cls._add(2 * _rows(x) * self.weight.shape[0] * x.shape[-1], self.weight)
            return qlin(self, x)

        def as_linear(self, x):
            cls._add(2 * _rows(x) * self.weight.shape[0] * x.shape[-1], self.weight)
            return emb(self, x)

        def q_as_linear(self, x):
            cls._add(2 * _rows(x) * self.weight.shape[0] * x.shape[-1], self.weight)
            return qemb(self, x)

        def attention(q, k, v, *a, **kw):
            B, H, L, d = q.shape
            cls._add(4 * B * H * L * k.shape[-2] * d)
            return sdpa(q, k, v, *a, **kw)

        def matmul(a, b, *args, **kw):
            n = 1
            for s in a.shape[:-2]:
                n *= s
            cls._add(2 * n * a.shape[-2] * a.shape[-1] * b.shape[-1])
            return mm(a, b, *args, **kw)

        nn.Linear.__call__, nn.QuantizedLinear.__call__ = linear, qlinear
        nn.Embedding.as_linear, nn.QuantizedEmbedding.as_linear = as_linear, q_as_linear
        mx.fast.scaled_dot_product_attention, mx.matmul = attention, matmul

    @classmethod
    def _unpatch(cls) -> None:
        s = cls._saved
        nn.Linear.__call__, nn.QuantizedLinear.__call__ = s["lin"], s["qlin"]
        nn.Embedding.as_linear, nn.QuantizedEmbedding.as_linear = s["emb"], s["qemb"]
        mx.fast.scaled_dot_product_attention, mx.matmul = s["sdpa"], s["mm"]


_RATE: dict = {}


def matmul_rate(seconds: float = 0.3, n: int = 1024, max_age_s: float = 300.0) -> float:
    """The float32 matmul rate of this machine, FLOP/s: ``n³`` products, one
    sync each, for about ``seconds`` (at least two, after a warm-up).  The
    figure is kept for ``max_age_s`` in this process, so runs in one process
    share a probe.  Its buffers are freed before it returns."""
    now = time.monotonic()
    if n in _RATE and now - _RATE[n][1] < max_age_s:
        return _RATE[n][0]
    a = mx.random.normal((n, n), key=mx.random.key(0)) / n**0.5
    b = mx.random.normal((n, n), key=mx.random.key(1)) / n**0.5
    mx.eval(a, b, a @ b)
    done, t0 = 0, time.perf_counter()
    while True:
        c = a @ b
        mx.eval(c)
        done += 1
        el = time.perf_counter() - t0
        if el >= seconds and done >= 2:
            break
    del a, b, c
    mx.clear_cache()
    _RATE[n] = (2.0 * n**3 * done / el, time.monotonic())
    return _RATE[n][0]


class Throughput:
    """Per step FLOPs (``3 ×`` the trained module's forward + the target's
    forward) against the measured :func:`matmul_rate`; ``share`` is the
    training rate as a fraction of it over the steps so far."""

    def __init__(self, rate: float | None = None):
        self.rate = rate
        self.flops = 0
        self.seconds = 0.0
        self.step_flops = {"drafter_fwd": 0, "target_fwd": 0, "frozen_fwd": 0, "recomputed": 0}
        self.steps = 0

    def add(self, drafter_fwd: int, target_fwd: int, seconds: float, frozen_fwd: int = 0, recomputed: int = 0) -> None:
        """A step's forward FLOPs (``frozen_fwd`` of them by weights not trained: backward once;
        ``recomputed``: a checkpointed block's recomputation, reported, not in the total)."""
        self.step_flops = {"drafter_fwd": int(drafter_fwd), "target_fwd": int(target_fwd), "frozen_fwd": int(frozen_fwd),
                           "recomputed": int(recomputed)}
        self.flops += self.step_total(self.step_flops)
        self.seconds += seconds
        self.steps += 1

    @staticmethod
    def step_total(f: dict) -> int:
        return 3 * f["drafter_fwd"] - f.get("frozen_fwd", 0) + f["target_fwd"]

    @property
    def achieved(self) -> float:
        return self.flops / self.seconds if self.seconds > 0 else 0.0

    @property
    def share(self) -> float | None:
        return self.achieved / self.rate if self.rate else None

    def text(self) -> str:
        s = self.share
        return f"{self.achieved / 1e9:.1f} GFLOP/s" + (f" ({100 * s:.0f}% of matmul)" if s is not None else "")

    def summary(self) -> dict:
        last = self.step_flops
        return {
            "matmul_rate_gflops": round(self.rate / 1e9, 2) if self.rate else None,
            "achieved_gflops": round(self.achieved / 1e9, 3),
            "share_of_matmul": round(self.share, 4) if self.share is not None else None,
            "last_step_gflop": {"drafter_forward": round(last["drafter_fwd"] / 1e9, 4),
                                "frozen_weight_forward": round(last["frozen_fwd"] / 1e9, 4),
                                "target_forward": round(last["target_fwd"] / 1e9, 4),
                                "recomputed_forward": round(last["recomputed"] / 1e9, 4),
                                "total": round(self.step_total(last) / 1e9, 4)},
            "steps_timed": self.steps,
        }

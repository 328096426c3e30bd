"""Measuring ``mtpflow bench``'s variants: the interleaved timed runs, acceptance per position,
peak memory and the verify-cost curve."""

from __future__ import annotations

import math
import resource
import statistics
import sys
import time

from .. import hookimpl
from .variants import MTPFlowVariant

#: the verify-cost curve: target forwards of this many tokens (batch 1) on a cache of VERIFY_CONTEXT tokens
VERIFY_LENGTHS = (1, 2, 4, 8, 16, 32, 64)
VERIFY_CONTEXT = 128


def summarize(values: list[float]) -> dict:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"median": None, "min": None, "max": None, "stdev": None, "n": 0}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "n": len(vals),
    }


class RoundCollector:
    """Keeps per-position acceptance counts of the rounds: registered as a
    plugin for a run, its ``mtpflow_emit`` reads each round's record (so no
    round event needs building)."""

    def __init__(self):
        self.reset()

    @hookimpl
    def mtpflow_emit(self, session, record, emitted):
        nodes = record.nodes if record.nodes is not None else record.drafted
        self.add(record.drafted, record.accepted, verified=nodes + 1)

    def reset(self):
        self.proposed: list[int] = []  # row-rounds that drafted > i tokens
        self.accepted: list[int] = []  # of which the draft at i was accepted
        self.verified = 0  # tokens the target verified, summed over row-rounds (a tree: its nodes + root)
        self.row_rounds = 0

    def add(self, drafted: int, accepted: list[int], verified: int | None = None):
        self.verified += (drafted + 1 if verified is None else verified) * len(accepted)
        self.row_rounds += len(accepted)
        if drafted <= 0:
            return
        if len(self.proposed) < drafted:
            grow = drafted - len(self.proposed)
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        for n in accepted:
            for i in range(drafted):
                self.proposed[i] += 1
                if i < n:
                    self.accepted[i] += 1

    def per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def conditional(self) -> list[float]:
        """P(draft i accepted | draft i-1 accepted)."""
        out, prev = [], None
        for i, (a, p) in enumerate(zip(self.accepted, self.proposed)):
            base = p if i == 0 else prev
            out.append(a / base if base else 0.0)
            prev = a
        return out


def _reset_peak():
    import mlx.core as mx

    try:
        mx.reset_peak_memory()
    except AttributeError:  # pragma: no cover - old mlx
        mx.metal.reset_peak_memory()


def _peak() -> tuple[int, str]:
    import mlx.core as mx

    try:
        v = int(mx.get_peak_memory())
    except AttributeError:  # pragma: no cover
        v = int(mx.metal.get_peak_memory())
    if v > 0:
        return v, "mx.get_peak_memory"
    # CPU backends may report 0: the process high-water mark (never reset)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "ru_maxrss (process-wide, not reset)"


def _progress(total: int, disable: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, file=sys.stderr, disable=disable, unit="run", dynamic_ncols=True)
    except ImportError:  # pragma: no cover
        class _P:
            def __init__(self):
                self.n = 0

            def update(self, k=1):
                self.n += k
                if not disable:
                    print(f"\r[{self.n}/{total}]", end="", file=sys.stderr, flush=True)

            def set_description(self, d):
                pass

            def close(self):
                if not disable:
                    print(file=sys.stderr)

        return _P()


def verify_cost(session, lengths=VERIFY_LENGTHS, context: int = VERIFY_CONTEXT, repeats: int = 3) -> list[dict]:
    """Milliseconds of one target forward plus its LM head over ``n`` new
    tokens (batch 1) on a cache of ``context`` tokens, for each ``n`` in
    ``lengths``: every size warmed once, then the median of ``repeats``
    interleaved timings, and its ratio to the first size.  The new slots are
    trimmed after each call, so every call sees the same cache."""
    import mlx.core as mx

    t = session.target
    V = t.vocab_size
    ctx = [(7 * i + 3) % V for i in range(context)]
    cache, _ = t.prefill([ctx], extra=max(lengths) + 8)
    mx.eval([c.keys for c in cache])
    pos = mx.array([context], dtype=mx.int32)

    def once(n):
        tokens = mx.array([[(11 * i + 5) % V for i in range(n)]], dtype=mx.int32)
        t.set_offsets(cache, pos)
        t0 = time.perf_counter()
        h, _ = t.forward_with_taps(tokens, cache, (), submit=session.submit_layers)
        mx.eval(t.logits(h))
        dt = time.perf_counter() - t0
        for c in cache:
            c.trim(n)
        return dt

    for n in lengths:  # warm every shape once
        once(n)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            times[n].append(once(n))
    base = statistics.median(times[lengths[0]])
    return [{"tokens": n, "ms": round(1e3 * statistics.median(times[n]), 4),
             "ratio": round(statistics.median(times[n]) / base, 3) if base > 0 else None} for n in lengths]


def _measure(args, variants, prompts) -> tuple[dict, dict, dict, set]:
    """Warm up (every bucketed verify shape once, then ``args.warmup`` passes),
    then run every variant ``args.repeats`` times (in a rotating order); each
    variant's round collector, peak memory and failure, and the verify shapes
    warmed."""
    import mlx.core as mx

    bar = _progress(len(variants) * (args.warmup + args.repeats), args.no_progress)
    acc: dict[str, RoundCollector] = {v.name: RoundCollector() for v in variants}
    peaks: dict[str, tuple[int, str]] = {}
    failed: dict[str, str] = {}
    wprompts = prompts[: max(args.batch_sizes)]
    warmed: set = set()  # (rows, tokens, tree) verify shapes warmed
    try:
        if args.warmup:  # every bucketed verify shape once (a no-op where the device does not bucket)
            from ..backend.shapes import warm_up

            for v in variants:
                if isinstance(v, MTPFlowVariant):
                    warmed = warm_up(v.session, max(args.batch_sizes), warmed)
        for w in range(args.warmup):  # compile, allocate, fill caches
            for v in variants:
                bar.set_description(f"warmup {v.name}")
                try:
                    v.run(wprompts[: v.batch_size], min(args.max_tokens, 16), RoundCollector())
                except Exception as exc:  # e.g. an mlx-lm batch path the model does not support
                    failed[v.name] = f"{type(exc).__name__}: {exc}"
                bar.update()
        live = [v for v in variants if v.name not in failed]
        for r in range(args.repeats):
            order = live[r % len(live):] + live[: r % len(live)] if live else []
            for v in order:
                bar.set_description(f"rep {r + 1}/{args.repeats} {v.name}")
                _reset_peak()
                acc_c = acc[v.name]
                v.run_result = v.run(prompts, args.max_tokens, acc_c)
                mx.synchronize()
                v.runs.append(v.run_result)
                pk = _peak()
                peaks[v.name] = max(peaks.get(v.name, (0, pk[1])), pk)
                bar.update()
            bar.update(len(variants) - len(live))
    finally:
        bar.close()
    return acc, peaks, failed, warmed

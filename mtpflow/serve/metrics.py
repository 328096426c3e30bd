"""Prometheus metrics of ``mtpflow serve`` (``GET /metrics``), without a client library.

The names are vLLM's where vLLM has the metric (``vllm:`` prefix, a
``model_name`` label), so dashboards and scrapers written for vLLM read
mtpflow unchanged; the speculative-decoding counters are those of vLLM v1's
``SpecDecodingProm``:

* ``vllm:spec_decode_num_drafts`` -- (row, round) pairs in which drafts were
  proposed (rows of ``speculative: false`` requests are not counted);
* ``vllm:spec_decode_num_draft_tokens`` / ``vllm:spec_decode_num_accepted_tokens``;
* ``vllm:spec_decode_num_accepted_tokens_per_pos`` with a ``position`` label
  (0 = the first draft of a block).

Mean acceptance length = 1 + rate(accepted_tokens) / rate(drafts), as vLLM.
Counters are written in the text format 0.0.4 as prometheus_client writes
them (``_total`` appended); histograms have vLLM's buckets.  Every method is
thread-safe (the scheduler thread writes, the HTTP handlers read).
"""

from __future__ import annotations

import math
import threading

#: vLLM's buckets for request latency and queue time (seconds)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
#: vLLM's buckets for the time to first token (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: queue time starts well below a second on an idle server
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5) + LATENCY_BUCKETS[3:]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


class _Metric:
    kind = ""

    def __init__(self, registry: "Registry", name: str, doc: str, labelnames: tuple[str, ...]):
        self.registry, self.name, self.doc, self.labelnames = registry, name, doc, tuple(labelnames)

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.labelnames)}")
        return tuple(str(labels[k]) for k in self.labelnames)


class _Valued(_Metric):
    """A metric with one number per label set (counters and gauges)."""

    #: what the exposition appends to the name (``_total`` for counters)
    suffix = ""

    def __init__(self, *a):
        super().__init__(*a)
        self.values: dict[tuple, float] = {} if self.labelnames else {(): 0.0}  # as prometheus_client

    def get(self, **labels) -> float:
        with self.registry.lock:
            return self.values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        n = self.name + self.suffix
        out = [f"# HELP {n} {self.doc}", f"# TYPE {n} {self.kind}"]
        for key, v in sorted(self.values.items()):
            out.append(f"{n}{_labels(self.registry.base + tuple(zip(self.labelnames, key)))} {_num(v)}")
        return out


class Counter(_Valued):
    kind = "counter"
    suffix = "_total"

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        key = self._key(labels)
        with self.registry.lock:
            self.values[key] = self.values.get(key, 0.0) + amount


class Gauge(_Valued):
    kind = "gauge"

    def set(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self.registry.lock:
            self.values[key] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry, name, doc, labelnames, buckets):
        super().__init__(registry, name, doc, labelnames)
        self.buckets = tuple(sorted(buckets))
        self.values: dict[tuple, list] = {}  # key -> [bucket counts..., sum, count]
        if not self.labelnames:
            self.values[()] = [0] * len(self.buckets) + [0.0, 0]

    def observe(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self.registry.lock:
            v = self.values.setdefault(key, [0] * len(self.buckets) + [0.0, 0])
            for i, b in enumerate(self.buckets):
                if value <= b:
                    v[i] += 1
            v[-2] += value
            v[-1] += 1

    def count(self, **labels) -> int:
        with self.registry.lock:
            v = self.values.get(self._key(labels))
            return 0 if v is None else v[-1]

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        for key, v in sorted(self.values.items()):
            base = self.registry.base + tuple(zip(self.labelnames, key))
            for b, c in zip(self.buckets, v):
                out.append(f"{self.name}_bucket{_labels(base + (('le', _num(b)),))} {_num(c)}")
            out.append(f"{self.name}_bucket{_labels(base + (('le', '+Inf'),))} {_num(v[-1])}")
            out.append(f"{self.name}_sum{_labels(base)} {_num(v[-2])}")
            out.append(f"{self.name}_count{_labels(base)} {_num(v[-1])}")
        return out


class Registry:
    """A set of metrics sharing constant labels (``model_name``)."""

    def __init__(self, **const_labels):
        self.lock = threading.Lock()
        self.base = tuple(const_labels.items())
        self.metrics: list[_Metric] = []

    def _add(self, m):
        self.metrics.append(m)
        return m

    def counter(self, name: str, doc: str, labelnames=()) -> Counter:
        return self._add(Counter(self, name, doc, labelnames))

    def gauge(self, name: str, doc: str, labelnames=()) -> Gauge:
        return self._add(Gauge(self, name, doc, labelnames))

    def histogram(self, name: str, doc: str, buckets, labelnames=()) -> Histogram:
        return self._add(Histogram(self, name, doc, labelnames, buckets))

    def render(self) -> str:
        with self.lock:
            lines = [ln for m in self.metrics for ln in m.lines()]
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """Everything ``/metrics`` shows."""

    def __init__(self, model_name: str):
        r = self.registry = Registry(model_name=model_name)
        self.running = r.gauge("vllm:num_requests_running", "Rows decoding in the batch.")
        self.waiting = r.gauge("vllm:num_requests_waiting", "Requests queued for a row in the batch.")
        self.success = r.counter("vllm:request_success",
                                 "Requests (choices) that finished, by finish reason.", ("finished_reason",))
        self.outcomes = r.counter("mtpflow:requests_finished", "Requests (choices) that ended, by outcome: "
                                  "ok, timeout, cancelled (client went away), error (failed while decoding).",
                                  ("outcome",))
        self.rejected = r.counter("mtpflow:requests_rejected",
                                  "HTTP requests refused before decoding, by status code.", ("status",))
        self.prompt_tokens = r.counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = r.counter("vllm:generation_tokens", "Tokens generated.")
        self.prefill_tokens = r.counter("mtpflow:prefill_tokens",
                                        "Prompt tokens prefilled (identical prompts joining together count once).")
        self.drafts = r.counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = r.counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = r.counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = r.counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.", ("position",))
        self.rounds = r.counter("mtpflow:rounds", "Decoding rounds (one target forward each).")
        self.recoveries = r.counter("mtpflow:batch_recoveries",
                                    "Rounds or prefills that raised and were isolated row by row.")
        self.queue_time = r.histogram("vllm:request_queue_time_seconds",
                                      "Time from submission to joining the batch.", QUEUE_BUCKETS)
        self.ttft = r.histogram("vllm:time_to_first_token_seconds",
                                "Time from arrival to the first token.", TTFT_BUCKETS)
        self.e2e = r.histogram("vllm:e2e_request_latency_seconds",
                               "Time from arrival to the last token.", LATENCY_BUCKETS)

    def declare(self, max_drafts: int) -> None:
        """Show the labelled series at 0 before anything happened (as vLLM pre-creates its positions)."""
        for pos in range(max_drafts):
            self.accepted_per_pos.inc(0, position=pos)
        for reason in ("stop", "length"):
            self.success.inc(0, finished_reason=reason)
        for outcome in ("ok", "timeout", "cancelled", "error"):
            self.outcomes.inc(0, outcome=outcome)

    def observe_round(self, record, speculative_rows: list[bool]) -> None:
        """One round's spec-decode counters (``speculative_rows``: per row of ``record``)."""
        self.rounds.inc()
        if record.drafted <= 0:
            return
        n = sum(speculative_rows)
        if not n:
            return
        acc = [a for a, s in zip(record.accepted, speculative_rows) if s]
        self.drafts.inc(n)
        self.draft_tokens.inc(n * record.drafted)
        self.accepted_tokens.inc(sum(acc))
        for pos in range(record.drafted):
            self.accepted_per_pos.inc(sum(1 for a in acc if a > pos), position=pos)

    def render(self) -> str:
        return self.registry.render()


__all__ = ["CONTENT_TYPE", "Counter", "Gauge", "Histogram", "Registry", "ServerMetrics"]

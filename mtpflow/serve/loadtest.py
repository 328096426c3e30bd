"""A bounded load test of ``mtpflow serve`` on 127.0.0.1 (``python -m mtpflow.loadtest``).

It starts the server in a child process (or uses ``--url``), builds a pool
of greedy requests (completions and chat, some streamed), records each one's
**solo** output by sending it alone, then runs ``--clients`` concurrent
clients for ``--duration`` seconds, each sending a random good request --
or, with probability ``--bad-fraction``, a random bad one (a seed out of
range, NaN, a deep or broken JSON body, a lone surrogate, bytes that are not
UTF-8, an out-of-vocabulary token, a body over the size limit, an image that
names a local file or whose header claims 9000 x 9000 pixels, a bad
``logit_bias`` key, ``echo`` / ``best_of`` / ``suffix``, ...; with
``--faults`` also requests that pass validation and make their prefill or
round raise), or opens a connection that sends half a request head and must
be closed by the server's header timeout.  Some good requests carry
``logit_bias`` and frequency / presence penalties.  Every good request must
return its solo output exactly; every bad one must get its 4xx (a failing one
its 500) with an OpenAI-style error body.  It reports latency percentiles,
throughput, the server's resident memory (at startup, after the first seconds
of load, peak, at the end and after the server went idle) against a budget of
``1.25 * (footprint + --prefix-cache-mb)``, where the footprint is the RSS
after the warm-up seconds of load (the model, the batch's working memory),
less what the prefix cache held then (``--check-memory`` fails the run when
the peak after the warm-up exceeds it), the server's open file descriptors, and the spec-decode counters of
``/metrics``; the exit status is 1 if any request misbehaved.

    python -m mtpflow.loadtest --model tests/fixtures/hf_gemma4/pair_e/target \\
        --draft-model tests/fixtures/hf_gemma4/pair_e/drafter --clients 64 --duration 60 --bad-fraction 0.1

Only the standard library is used on the client side (``http.client``).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

from .cli import DEFAULT_PREFIX_CACHE_MB as DEFAULT_SERVE_PREFIX_CACHE_MB
from .workload import bad_request, good_requests, half_header


# --------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------
class Client:
    """One keep-alive connection (one per client thread)."""

    def __init__(self, base: str, timeout: float = 120.0):
        u = urlparse(base)
        self.host, self.port, self.timeout = u.hostname, u.port, timeout
        self.conn = None

    def _connect(self):
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self.conn

    def request(self, method: str, path: str, body: bytes | None = None, stream: bool = False):
        """``(status, headers, body bytes or SSE data lines)``; a broken connection is retried once."""
        for attempt in (0, 1):
            conn = self._connect()
            try:
                conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
                resp = conn.getresponse()
                if stream and resp.status == 200:
                    lines = []
                    for raw in resp:
                        line = raw.decode("utf-8").rstrip("\r\n")
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            if line == "data: [DONE]":
                                break
                    resp.read()
                    data = lines
                else:
                    data = resp.read()
                if resp.getheader("connection", "").lower() == "close":
                    self.close()
                return resp.status, dict(resp.getheaders()), data
            except (http.client.HTTPException, ConnectionError, socket.timeout, OSError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _text_of(status: int, data, chat: bool, stream: bool) -> str | None:
    if status != 200:
        return None
    if stream:
        out = []
        for d in data:
            if d == "[DONE]":
                break
            obj = json.loads(d)
            if "error" in obj:
                return None
            for c in obj.get("choices", []):
                out.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
        return "".join(out)
    obj = json.loads(data)
    c = obj["choices"][0]
    return c["message"]["content"] if chat else c["text"]


def _tokens_of(status: int, data, stream: bool) -> int:
    if status != 200:
        return 0
    if stream:
        for d in reversed(data):
            if d != "[DONE]":
                return json.loads(d).get("usage", {}).get("completion_tokens", 0)
        return 0
    return json.loads(data)["usage"]["completion_tokens"]


# --------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------
def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) / 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def open_fds(pid: int | None) -> int | None:
    """The process's open file descriptors (Linux ``/proc``), or None."""
    import os

    try:
        return len(os.listdir(f"/proc/{pid}/fd")) if pid is not None else None
    except OSError:
        return None


class MemorySampler(threading.Thread):
    def __init__(self, pid: int | None, every: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self):
        while self.pid is not None and not self.stop.is_set():
            m = rss_mb(self.pid)
            if m is not None:
                self.samples.append((time.monotonic(), m))
            self.stop.wait(self.every)


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from mtpflow.cli import main; sys.exit(main())", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
           "--max-body-size", str(args.max_body_size), "--max-batch-size", str(args.max_batch_size)]
    if args.model:
        cmd += ["--model", args.model]
    if args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    if args.draft_block_size:
        cmd += ["--draft-block-size", str(args.draft_block_size)]
    if args.faults:
        cmd += ["--set", 'plugins.load=["mtpflow.serve.faults"]']
    if args.prefix_cache_mb is not None:
        cmd += ["--prefix-cache-mb", str(args.prefix_cache_mb)]
    cmd += ["--header-timeout", str(args.header_timeout)]
    cmd += args.server_arg
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if args.quiet else None)
    base = f"http://127.0.0.1:{port}"
    c = Client(base, timeout=5)
    deadline = time.monotonic() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise SystemExit(f"loadtest: the server exited with status {proc.returncode}\n{err[-2000:]}")
        try:
            if c.request("GET", "/health")[0] == 200:
                return proc, base
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("loadtest: the server did not start in time")
        time.sleep(0.2)


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def _metrics(base: str) -> dict:
    status, _, data = Client(base).request("GET", "/metrics")
    out: dict = {}
    if status != 200:
        return out
    for line in data.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, val = line.rsplit(" ", 1)
        name = key.split("{")[0]
        out[name] = out.get(name, 0.0) + float(val)
    return out


def run(args) -> dict:
    proc = None
    if args.url:
        base = args.url.rstrip("/")
    else:
        proc, base = start_server(args)
    try:
        return _run(args, base, proc)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


class _Clients:
    """The concurrent clients of one run: each sends good requests (checked against their solo
    output), bad ones (the kinds in turn) and half-header connections until ``stop_at``."""

    def __init__(self, args, base: str, model: str, goods: list[dict], solo: list[str | None]):
        self.args, self.base, self.model, self.goods, self.solo = args, base, model, goods, solo
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.picks = itertools.count()  # bad requests take the kinds in turn: a short run still covers them all
        self.stop_at = time.monotonic() + args.duration

    def loop(self, i: int) -> None:
        args = self.args
        rng = random.Random(args.seed * 1000 + i)
        cl = Client(self.base, timeout=args.request_timeout)
        while time.monotonic() < self.stop_at:
            if rng.random() < args.bad_fraction and rng.random() < args.half_header_share:
                rec = self._half_header()
            elif rng.random() < args.bad_fraction:
                rec = self._bad(rng, cl)
            else:
                rec = self._good(rng, cl)
            with self.lock:
                self.records.append(rec)
        cl.close()

    def _half_header(self) -> dict:
        limit = self.args.header_timeout + 3.0
        try:
            closed, took = half_header(self.base, limit)
        except OSError as exc:
            closed, took = repr(exc), limit
        return {"good": False, "kind": "half-header", "status": "closed" if closed is True else closed,
                "ok": closed is True, "latency": took}

    def _bad(self, rng: random.Random, cl: Client) -> dict:
        with self.lock:
            pick = next(self.picks)
        path, raw, want, kind = bad_request(rng, self.model, self.args.max_body_size, self.args.faults, pick)
        t = time.monotonic()
        try:
            status, _, data = cl.request("POST", path, raw)
            ok = status in want
            if ok:
                err = json.loads(data)["error"]
                ok = bool(err.get("message")) and "\n" not in err["message"]
        except Exception as exc:  # a bad request must still get an answer
            status, ok = repr(exc), False
        return {"good": False, "kind": kind, "status": status, "ok": ok, "latency": time.monotonic() - t}

    def _good(self, rng: random.Random, cl: Client) -> dict:
        k = rng.randrange(len(self.goods))
        g = self.goods[k]
        stream = rng.random() < 0.5
        body = dict(g["body"], stream=True) if stream else g["body"]
        t = time.monotonic()
        try:
            status, _, data = cl.request("POST", g["path"], json.dumps(body).encode(), stream=stream)
            text = _text_of(status, data, g["chat"], stream)
            tokens = _tokens_of(status, data, stream)
        except Exception as exc:
            status, text, tokens = repr(exc), None, 0
        return {"good": True, "kind": "stream" if stream else "plain", "status": status,
                "ok": text == self.solo[k], "latency": time.monotonic() - t, "tokens": tokens,
                "mismatch": status == 200 and text != self.solo[k], "pool_index": k}


def _solo_pass(c: Client, goods: list[dict]) -> list[str | None]:
    """Each good request alone: the reference every concurrent run must reproduce."""
    solo = []
    for g in goods:
        status, _, data = c.request("POST", g["path"], json.dumps(g["body"]).encode())
        if status != 200:
            raise SystemExit(f"loadtest: a good request failed alone ({status}): {data[:300]!r}")
        solo.append(_text_of(status, data, g["chat"], False))
    return solo


def _footprint(base: str, pid: int | None) -> float | None:
    """The server's RSS less what its prefix cache holds (MiB)."""
    rss = rss_mb(pid) if pid is not None else None
    st = json.loads(Client(base).request("GET", "/v1/stats")[2])
    held = (st.get("prefix_cache") or {}).get("bytes", 0) / 2**20
    return None if rss is None else rss - held


def _memory_report(samples, startup_rss, footprint, cap: int, warm: float, t_load: float, wall: float):
    mem = [m for _, m in samples]
    if not mem:
        return None
    load_mem = [m for t, m in samples if t_load + warm <= t <= t_load + wall]
    mm = {
        "startup": None if startup_rss is None else round(startup_rss, 1),
        "footprint": None if footprint is None else round(footprint, 1),
        "prefix_cache_cap": cap,
        "budget": None if footprint is None else round(1.25 * (footprint + cap), 1),
        "warmup_s": round(warm, 1),
        "after_warmup": round(load_mem[0] if load_mem else mem[0], 1),
        "peak": round(max(mem), 1),
        "end_of_load": round(load_mem[-1] if load_mem else mem[-1], 1),
        "after_idle": round(mem[-1], 1),
    }
    mm["growth_during_load_pct"] = round(100 * (mm["end_of_load"] - mm["after_warmup"]) / mm["after_warmup"], 2)
    peak_after = max(load_mem, default=mm["peak"])
    mm["peak_after_warmup"] = round(peak_after, 1)
    mm["within_budget"] = None if mm["budget"] is None else peak_after <= mm["budget"]
    return mm


def _report(args, records: list[dict], goods: list, solo_s: float, wall: float, m0: dict, m1: dict) -> dict:
    good = [r for r in records if r["good"]]
    bad = [r for r in records if not r["good"]]
    lat = [r["latency"] for r in good if r["ok"]]

    def d(name):
        return m1.get(name, 0.0) - m0.get(name, 0.0)

    drafts = d("vllm:spec_decode_num_drafts_total")
    return {
        "clients": args.clients, "duration_s": round(wall, 2), "bad_fraction": args.bad_fraction,
        "pool": len(goods), "solo_pass_s": round(solo_s, 2),
        "requests": len(records),
        "good": {"sent": len(good), "ok": sum(r["ok"] for r in good),
                 "mismatched": sum(bool(r.get("mismatch")) for r in good),
                 "mismatched_pool_indices": sorted({r["pool_index"] for r in good if r.get("mismatch")}),
                 "failed": [r["status"] for r in good if not r["ok"] and not r.get("mismatch")][:20],
                 "streamed": sum(r["kind"] == "stream" for r in good)},
        "bad": {"sent": len(bad), "answered_as_expected": sum(r["ok"] for r in bad),
                "unexpected": [(r["kind"], r["status"]) for r in bad if not r["ok"]][:20],
                "kinds": sorted({r["kind"] for r in bad})},
        "latency_s": {"p50": _pct(lat, 50), "p95": _pct(lat, 95), "p99": _pct(lat, 99), "max": max(lat, default=None)},
        "throughput": {"good_requests_per_s": round(len(lat) / wall, 3),
                       "completion_tokens_per_s": round(sum(r.get("tokens", 0) for r in good if r["ok"]) / wall, 2)},
        "server_metrics": {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": d("vllm:spec_decode_num_draft_tokens_total"),
            "spec_decode_num_accepted_tokens": d("vllm:spec_decode_num_accepted_tokens_total"),
            "mean_acceptance_length": None if not drafts else round(
                1 + d("vllm:spec_decode_num_accepted_tokens_total") / drafts, 3),
            "rejected": d("mtpflow:requests_rejected_total"),
            "batch_recoveries": d("mtpflow:batch_recoveries_total"),
        },
        "passed": len(good) > 0 and sum(r["ok"] for r in good) == len(good) and all(r["ok"] for r in bad),
    }


def _run(args, base: str, proc) -> dict:
    pid = proc.pid if proc is not None else args.pid
    startup_rss, startup_fds = rss_mb(pid) if pid is not None else None, open_fds(pid)
    c = Client(base)
    model = json.loads(c.request("GET", "/v1/models")[2])["data"][0]["id"]
    goods = good_requests(model, args.pool, args.seed)
    t0 = time.monotonic()
    solo = _solo_pass(c, goods)
    solo_s = time.monotonic() - t0
    sampler = MemorySampler(pid)
    sampler.start()
    time.sleep(1.0)
    m0 = _metrics(base)

    clients = _Clients(args, base, model, goods, solo)
    threads = [threading.Thread(target=clients.loop, args=(i,), daemon=True) for i in range(args.clients)]
    t_load = time.monotonic()
    warm = args.warmup if args.warmup is not None else min(10.0, args.duration / 4)
    baseline: dict = {}

    def measure_footprint():  # the RSS after the warm-up, less the prefix cache's bytes then
        time.sleep(warm)
        baseline["footprint"] = _footprint(base, pid)

    meter = threading.Thread(target=measure_footprint, daemon=True)
    meter.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.duration + args.request_timeout + 30)
    wall = time.monotonic() - t_load
    time.sleep(args.idle_wait)  # the server goes idle: memory after the run
    m1 = _metrics(base)
    end_fds = open_fds(pid)
    sampler.stop.set()
    sampler.join(5)
    meter.join(30)

    report = _report(args, clients.records, goods, solo_s, wall, m0, m1)
    cap = args.prefix_cache_mb if args.prefix_cache_mb is not None else DEFAULT_SERVE_PREFIX_CACHE_MB
    report["open_fds"] = {"startup": startup_fds, "after_idle": end_fds}
    report["memory_mb"] = _memory_report(sampler.samples, startup_rss, baseline.get("footprint"), cap, warm,
                                         t_load, wall)
    if args.check_memory and report["memory_mb"] and report["memory_mb"]["within_budget"] is False:
        report["passed"] = False
    return report


def format_report(r: dict) -> str:
    lat, th, mem, sm = r["latency_s"], r["throughput"], r["memory_mb"], r["server_metrics"]

    def s(x, nd=3):
        return "-" if x is None else f"{x:.{nd}f}"

    lines = [
        f"{r['clients']} clients for {r['duration_s']} s, bad fraction {r['bad_fraction']}: "
        f"{'PASS' if r['passed'] else 'FAIL'}",
        f"  good: {r['good']['ok']}/{r['good']['sent']} equal to their solo output "
        f"({r['good']['streamed']} streamed, {r['good']['mismatched']} mismatched, failed: {r['good']['failed'] or 'none'})",
        f"  bad:  {r['bad']['answered_as_expected']}/{r['bad']['sent']} answered with their 4xx/500 "
        f"(unexpected: {r['bad']['unexpected'] or 'none'})",
        f"  latency p50 {s(lat['p50'])} s, p95 {s(lat['p95'])} s, p99 {s(lat['p99'])} s, max {s(lat['max'])} s",
        f"  throughput {th['good_requests_per_s']} good requests/s, {th['completion_tokens_per_s']} tokens/s",
    ]
    if mem:
        lines.append(f"  server RSS MB: at startup {mem['startup']}, after {mem['warmup_s']} s of load {mem['after_warmup']}, "
                     f"peak {mem['peak']}, end of load {mem['end_of_load']} ({mem['growth_during_load_pct']:+.2f} %), "
                     f"after idle {mem['after_idle']}; budget 1.25 x (footprint {mem['footprint']} + prefix cache "
                     f"{mem['prefix_cache_cap']} MiB)"
                     f" = {mem['budget']}: {'within' if mem['within_budget'] else 'OVER'}")
    fds = r.get("open_fds") or {}
    if fds.get("startup") is not None:
        lines.append(f"  server open file descriptors: {fds['startup']} at startup, {fds['after_idle']} after idle")
    lines.append(f"  spec decode: {sm['spec_decode_num_drafts']:.0f} drafts, mean acceptance length "
                 f"{s(sm['mean_acceptance_length'])}; rejected {sm['rejected']:.0f}, batch recoveries "
                 f"{sm['batch_recoveries']:.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtpflow.loadtest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an already running server (default: start one on 127.0.0.1)")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, to sample its memory")
    ap.add_argument("--model", help="target for the started server")
    ap.add_argument("--draft-model", help="drafter for the started server")
    ap.add_argument("--draft-block-size", type=int, default=4, help="(default 4)")
    ap.add_argument("--max-batch-size", type=int, default=8, help="(default 8)")
    ap.add_argument("--max-body-size", type=int, default=256 * 1024,
                    help="the started server's body limit in bytes; the oversized bad request exceeds it "
                         "(default 262144)")
    ap.add_argument("--prefix-cache-mb", type=int, default=None,
                    help=f"the started server's prefix cache (default: serve's, {DEFAULT_SERVE_PREFIX_CACHE_MB})")
    ap.add_argument("--header-timeout", type=float, default=2.0,
                    help="the started server's --header-timeout; half-header connections must close within it + 3 s "
                         "(default 2)")
    ap.add_argument("--half-header-share", type=float, default=0.1,
                    help="share of the bad requests that are half-header connections (default 0.1)")
    ap.add_argument("--check-memory", action="store_true",
                    help="fail the run when the server's peak RSS after the warm-up exceeds 1.25 x (its footprint "
                         "then + the prefix cache cap)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for mtpflow serve (repeatable)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    ap.add_argument("--bad-fraction", type=float, default=0.0, help="share of bad requests (default 0)")
    ap.add_argument("--faults", action="store_true",
                    help="load mtpflow.serve.faults into the started server and mix in requests that fail while "
                         "decoding (a 500 for them, nothing for the others)")
    ap.add_argument("--pool", type=int, default=48, help="distinct good requests (default 48)")
    ap.add_argument("--seed", type=int, default=0, help="(default 0)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="client timeout per request (default 120)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="(default 300)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds of load before the memory baseline (default: a quarter of the run, at most 10)")
    ap.add_argument("--idle-wait", type=float, default=3.0, help="seconds idle before the last memory sample (default 3)")
    ap.add_argument("--json", help="also write the report as JSON to this file")
    ap.add_argument("--quiet", action="store_true", help="hide the server's stderr")
    args = ap.parse_args(argv)
    if not 0.0 <= args.bad_fraction <= 1.0:
        ap.error("--bad-fraction must be in [0, 1]")
    if not args.url and not args.model:
        ap.error("give --model (and --draft-model) to start a server, or --url of a running one")
    report = run(args)
    print(format_report(report), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0 if report["passed"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

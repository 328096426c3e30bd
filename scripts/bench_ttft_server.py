"""Time to the first streamed token through the OpenAI-compatible server.

Starts ``mtpflow serve`` on the fixture pair (target + drafter), sends 4 warm-up
and 24 measured streaming ``/v1/completions`` requests one after another
(greedy, 32 tokens), and prints the median time to the first text chunk and to
the end of the stream.  ``python scripts/bench_ttft_server.py PORT [PYTHONPATH]``:
a second argument runs another checkout's mtpflow (e.g. a ``git worktree`` of an
older commit) for a before/after comparison.
"""
import json, sys, time, statistics, subprocess, os, urllib.request
port = int(sys.argv[1]); env = dict(os.environ)
if len(sys.argv) > 2: env["PYTHONPATH"] = sys.argv[2]
T = "tests/fixtures/hf_gemma4/pair_e"
srv = subprocess.Popen([sys.executable, "-m", "mtpflow.cli", "serve", "--model", f"{T}/target", "--draft-model", f"{T}/drafter", "--port", str(port)],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1); break
        except Exception:
            time.sleep(0.2)
    def one(prompt):
        body = json.dumps({"model": "target", "prompt": prompt, "max_tokens": 32, "stream": True, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter(); first = None
        with urllib.request.urlopen(req) as r:
            for line in r:
                if line.startswith(b"data: ") and b'"text"' in line and first is None:
                    d = json.loads(line[6:])
                    if d["choices"][0].get("text"):
                        first = time.perf_counter() - t0
        return first, time.perf_counter() - t0
    prompts = ["Hello there, how are you", "Write a poem about the sea and the sky", "List three colours", "What is two plus two"]
    for p in prompts: one(p)
    F, A = [], []
    for i in range(6):
        for p in prompts:
            f, a = one(p); F.append(f); A.append(a)
    print(f"TTFT med {statistics.median(F)*1e3:.1f} ms  total med {statistics.median(A)*1e3:.1f} ms  (n={len(F)})")
finally:
    srv.terminate(); srv.wait()

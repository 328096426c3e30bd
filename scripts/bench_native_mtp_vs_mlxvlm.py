"""mtpflow's native-MTP kind next to mlx-vlm 0.7.10's native MTP, on the same tiny checkpoint.

    PYTHONPATH=$PWD python scripts/bench_native_mtp_vs_mlxvlm.py [--model FOLDER] [--block 3] [--max-tokens 48]

Default checkpoint: the GLM-5 parity fixture (``tests/fixtures/native_mtp/glm_moe_dsa``).
Both sides decode greedily in float32 with whole-prompt drafter prefill and the
same block size, never stopping at EOS, runs interleaved; the script checks that every prompt
gets the same tokens and prints throughput and the time ratio at batch 1 (each
prompt alone) and batch 4.  mlx-vlm's ``glm_moe_dsa_mtp`` drafter does not run
batched (its prefill concatenates a one-row bonus with the batch's hidden
states), so its batch-4 row runs the four prompts one after another, which is
what a user of it gets.  Needs mlx-vlm importable next to mtpflow.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 9, 17, 33, 2, 8], [7, 3, 11, 4, 4, 4], [40, 41, 42, 43, 44, 45], [100, 3, 77, 21, 64, 9]]


def mlx_vlm_runner(path: Path, block: int, max_tokens: int):
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    model = load_model(path)
    model.set_dtype(mx.float32)
    dm, kind = load_drafter(str(path), kind="mtp")
    dm.set_dtype(mx.float32)

    def run(prompts):
        outs, acc = [], []
        for p in prompts:
            toks = [int(t) for t, _ in generate_step(mx.array([p]), model, None, None, max_tokens=max_tokens, draft_model=dm,
                                                     draft_kind=kind, draft_block_size=block, prefill_step_size=None,
                                                     temperature=0.0)]
            outs.append(toks)
            acc += list(dm.accept_lens)
        return outs, 1 + sum(acc) / max(len(acc), 1)

    return run


def mtpflow_runner(path: Path, block: int, max_tokens: int, context: str):
    import attrs

    from mtpflow.config import load_config
    from mtpflow.engine import generate_stream, load_session, make_request
    from mtpflow.logs import null_logger

    s = load_session(load_config(overrides={
        "model": {"model": str(path), "draft_kind": "mtp"}, "draft": {"block_size": block, "policy": "fixed"},
        "batch": {"max_batch_size": 4}, "plugins": {"native_mtp": {"context": context}},
    }), log=null_logger())
    assert s.draft_kind == "native_mtp"

    def run(prompts):
        from mtpflow.metrics import SpecDecodingStats

        s.stats = SpecDecodingStats()
        reqs = [attrs.evolve(make_request(s, p, max_tokens=max_tokens, request_id=str(i)), stop_ids=frozenset())
                for i, p in enumerate(prompts)]
        out = {r.id: [] for r in reqs}
        for ev in generate_stream(s, reqs):
            out[ev.request_id].extend(ev.tokens)
        return [out[r.id] for r in reqs], s.stats.as_dict()["tau"]

    return run


def timed_pair(a, b, prompts, repeats):
    """Median wall time of ``a`` and ``b`` on ``prompts``, runs interleaved
    (a, b, a, b, ...) after one warm-up each, so load on a shared machine
    hits both alike."""
    a(prompts), b(prompts)
    ta, tb, ra, rb = [], [], None, None
    for _ in range(repeats):
        t = time.perf_counter()
        ra = a(prompts)
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        rb = b(prompts)
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), ra, statistics.median(tb), rb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "native_mtp" / "glm_moe_dsa"))
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", default="drafted", choices=("drafted", "verified"))
    a = ap.parse_args(argv)
    path = Path(a.model)
    vlm = mlx_vlm_runner(path, a.block, a.max_tokens)
    ours = mtpflow_runner(path, a.block, a.max_tokens, a.context)
    print(f"checkpoint {path.name}, block {a.block}, {a.max_tokens} tokens/prompt, median of {a.repeats}, context={a.context}")
    print("batch  mlx-vlm tok/s  mtpflow tok/s  ratio  same tokens  tau mlx-vlm  tau mtpflow")
    ok = True
    for b in (1, 4):
        prompts = PROMPTS[:b] if b == 1 else PROMPTS
        tv, (ov, tauv), to, (oo, tauo) = timed_pair(vlm, ours, prompts, a.repeats)
        n = sum(len(o) for o in oo)
        same = oo == ov
        ok &= same
        print(f"{b:>5}  {n / tv:>13.1f}  {n / to:>13.1f}  {tv / to:>5.2f}  {str(same):>11}  {tauv:>11.3f}  {tauo:>11.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Training tokens/s of every drafter kind, from the target per batch and from one shared feature cache.

    python scripts/bench_train_kinds.py --target smollm2-135m --data random:32:256 --steps 5

One process, the same data for every run (``random:N:L``: N rows of L random
token ids, loss on the second half, written to a JSONL file; or any data
spec): first a ``cache:`` folder is
collected once with what every kind reads (the hidden states, the assistant
kind's K/V, the union of EAGLE-3's and DFlash's layer taps); then each kind
trains ``--steps`` steps twice, recomputing the target's features per batch
("target") and reading them from the shared cache ("cache").  A run's rate is
the tokens of steps 2.. over their time (step 1 pays the graph set-up), from
its ``train_log.jsonl``.  On a shared machine compare the ratios, not the
absolute figures: the last column is each run's rate over the assistant
kind's cached rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KIND_OPTIONS = {
    "assistant": None,
    "eagle3": {"draft_vocab_size": 8192},
    "dflash": {"block_size": 8, "num_hidden_layers": 2},
    "mtp": {"depth": 2},
}


def rate(out: Path) -> float:
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    if len(log) < 2:
        return float("nan")
    return (log[-1]["tokens_seen"] - log[0]["tokens_seen"]) / max(log[-1]["elapsed_s"] - log[0]["elapsed_s"], 1e-9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data", default="random:32:256")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--kinds", default="assistant,eagle3,dflash,mtp")
    args = p.parse_args(argv)

    from mtpflow.train.run import tap_layers, train
    from mtpflow.train.target import load_target

    target = load_target(args.target)
    KIND_OPTIONS["eagle3"]["draft_vocab_size"] = min(8192, target.vocab_size)
    kinds = args.kinds.split(",")
    union = sorted({t for k in kinds if k in ("eagle3", "dflash") for t in tap_layers(k, target, KIND_OPTIONS[k])})
    common = dict(batch_size=args.batch_size, steps=args.steps, warmup=1, checkpoint_every=10_000, progress=False,
                  unroll=3, anchors=8, max_len=512)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.data.startswith("random:"):
            import numpy as np

            n, length = (int(x) for x in args.data.split(":")[1:3])
            rng = np.random.default_rng(0)
            f = tmp / "random.jsonl"
            f.write_text("".join(json.dumps({"tokens": rng.integers(4, target.vocab_size, length).tolist(),
                                             "loss_mask": [i >= length // 2 for i in range(length)]}) + "\n"
                                 for _ in range(n)))
            args.data = str(f)
        cache = tmp / "cache"
        # one collection for every kind (the assistant kind reads the K/V, so it collects)
        s = train(target, KIND_OPTIONS["assistant"], f"cache:{args.data}", tmp / "collect", kind="assistant",
                  cache_dir=str(cache), cache_taps=tuple(union), **dict(common, steps=1))
        print(f"collected {s['cache']['tokens']} tokens in {s['cache']['seconds']} s, taps {union}", file=sys.stderr)
        for kind in kinds:
            for how, spec in (("target", args.data), ("cache", f"cache:{args.data}")):
                out = tmp / f"{kind}-{how}"
                train(target, KIND_OPTIONS[kind], spec, out, kind=kind, cache_dir=str(cache), **common)
                rows[(kind, how)] = rate(out)
                print(f"{kind:9s} {how:6s} {rows[(kind, how)]:8.1f} tokens/s", file=sys.stderr)
    ref = rows.get(("assistant", "cache"))
    print(f"{'kind':9s} {'from':6s} {'tokens/s':>9s} {'/ assistant(cache)':>19s}")
    for (kind, how), r in rows.items():
        print(f"{kind:9s} {how:6s} {r:9.1f} {r / ref if ref else float('nan'):19.2f}")
    print(json.dumps({f"{k}/{h}": round(r, 1) for (k, h), r in rows.items()}))
    return 0


if __name__ == "__main__":
    from mtpflow._blas import ensure_fast_blas

    ensure_fast_blas()
    sys.exit(main())

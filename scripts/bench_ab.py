"""``mtpflow bench`` on two checkouts of mtpflow, taking turns: are the figures where they were?

Each turn runs the same ``mtpflow bench`` command once in checkout A, then once
in checkout B (each in its own process, with that checkout first on
``PYTHONPATH``), and reads each run's ``bench.json``.  A row's figure is its
``ratio``: its tokens/s over the mlx-lm target-only row of the same batch size,
measured in the same process.  mlx-lm is the same package on both sides, so
that ratio is the checkout's speed with the machine's load divided out; the
script prints, per row, the median ratio of each side over the turns and B's
over A's.

    python scripts/bench_ab.py --a /path/to/old-checkout --b . --turns 3 -- \\
        --target tests/fixtures/hf_gemma4/pair_e/target --block-sizes 1 --batch-sizes 1,4 --repeats 6 \\
        --max-tokens 48 --prompts tiny

Both checkouts must accept the bench arguments given after ``--``; ``--out``,
``--no-plots`` and ``--no-progress`` are added.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = "import sys; from mtpflow.cli import main; sys.argv = ['mtpflow', 'bench'] + sys.argv[1:]; sys.exit(main())"


def run_once(checkout: Path, bench_args: list[str], out: Path) -> dict:
    """One ``mtpflow bench`` in ``checkout``: ``{row name: ratio}`` (``None`` for a baseline row)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-c", RUN, *bench_args, "--out", str(out), "--no-plots", "--no-progress"]
    subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    result = json.loads((out / "bench.json").read_text())
    return {v["name"]: v.get("ratio") for v in result["variants"]}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, type=Path, help="checkout A (the 'before')")
    ap.add_argument("--b", required=True, type=Path, help="checkout B (the 'after')")
    ap.add_argument("--turns", type=int, default=3, help="turns (one bench run on each side per turn)")
    args = ap.parse_args(own)
    ratios: dict[str, dict[str, list]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.turns):
            for side, checkout in (("a", args.a.resolve()), ("b", args.b.resolve())):
                rows = run_once(checkout, bench_args, Path(tmp) / f"{side}{turn}")
                for name, r in rows.items():
                    ratios.setdefault(name, {"a": [], "b": []})[side].append(r)
            print(f"turn {turn + 1}/{args.turns} done", file=sys.stderr)
    print(f"A = {args.a}\nB = {args.b}\n{args.turns} turns; figure: tokens/s over mlx-lm target-only at the same batch, median")
    print(f"{'row':<44} {'A':>7} {'B':>7} {'B/A':>6}")
    for name, sides in ratios.items():
        a = [r for r in sides["a"] if r]
        b = [r for r in sides["b"] if r]
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{name:<44} {ma:>7.3f} {mb:>7.3f} {mb / ma:>6.3f}")


if __name__ == "__main__":
    main()

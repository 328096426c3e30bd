"""Data-parallel training on mx.distributed (issue 20, item 2): two local ranks
launched by ``mlx.launch`` over the ring backend give the parameters of one
rank with the whole batch, and the run resumes with another number of ranks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES

from mtpflow.train.run import train
from mtpflow.train.parallel import Ranks

PAIR_E = FIXTURES / "pair_e" / "target"

SCRIPT = textwrap.dedent("""
    import json, sys
    from mtpflow.backend.blas import ensure_fast_blas
    ensure_fast_blas()
    from mtpflow.train.run import train
    from mtpflow.train.parallel import world
    target, drafter, data, out, kw = json.loads(open(sys.argv[1]).read())
    ranks = world()
    summary = train(target, drafter, data, out, **kw)
    with open(f"{out}/done-rank{ranks.rank}-of-{ranks.size}.json", "w") as f:
        json.dump({"steps": summary["steps"]}, f)
""")


def _free_ports(n: int = 2) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            socks = []
            for q in range(p, p + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free ports")


def _launcher() -> str:
    here = Path(sys.executable).parent / "mlx.launch"
    return str(here) if here.is_file() else (shutil.which("mlx.launch") or "")


def launch(tmp_path, ranks: int, target, drafter, data, out, **kw):
    """``mlx.launch --hosts 127.0.0.1,... -- python SCRIPT``: ``ranks`` processes on this machine, ring backend."""
    script, args = tmp_path / "rank.py", tmp_path / f"args-{out.name}.json"
    script.write_text(SCRIPT)
    args.write_text(json.dumps([str(target), drafter, data, str(out), kw]))
    cmd = [_launcher(), "--backend", "ring", "--hosts", ",".join(["127.0.0.1"] * ranks),
           "--starting-port", str(_free_ports(ranks)), "--", sys.executable, str(script), str(args)]
    env = dict(os.environ, MTPFLOW_DISABLE_PLUGIN_AUTOLOAD="1")
    p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=600)
    done = sorted(x.name for x in out.glob("done-rank*"))
    # (mlx.launch exits 0 even when a rank fails: the ranks' own markers say whether they finished)
    assert done == [f"done-rank{r}-of-{ranks}.json" for r in range(ranks)], (p.stdout.decode()[-3000:],
                                                                              p.stderr.decode()[-3000:])


def _params(folder):
    return {k: np.array(v) for k, v in mx.load(str(folder / "checkpoint" / "model.safetensors")).items()}


def _log(out):
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


def _chat_file(path, n: int):
    words = (FIXTURES / "prompt_short.txt").read_text().split()
    rng = np.random.default_rng(4)
    path.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(rng.choice(words, size=4))},
        {"role": "assistant", "content": " ".join(rng.choice(words, size=int(rng.integers(6, 16))))}]})
        for _ in range(n)) + "\n")
    return path


@pytest.mark.skipif(not _launcher(), reason="needs mlx.launch (mlx >= 0.23)")
def test_two_ranks_equal_one_rank_with_the_whole_batch_and_resume_on_one(tmp_path):
    """The assistant kind on ``cache:`` features: the two ranks share the collection, then train."""
    drafter = {"num_hidden_layers": 1, "intermediate_size": 64}
    data = f"cache:{_chat_file(tmp_path / 'chat.jsonl', 24)}"
    kw = dict(batch_size=8, steps=6, warmup=1, lr=3e-3, checkpoint_every=3, progress=False, targets="hard", unroll=2,
              cache_batch=4, max_len=64, step_weights="position")
    one, two = tmp_path / "one", tmp_path / "two"
    train(PAIR_E, drafter, data, one, stop_at=3, **kw)
    at3 = _params(one)
    train(PAIR_E, drafter, data, one, **kw)
    launch(tmp_path, 2, PAIR_E, drafter, data, two, stop_at=3, **kw)  # ranks 0 and 1, 4 rows each
    got = _params(two)
    assert got.keys() == at3.keys()
    # the same update from the same global batch, summed in another order.  Adam divides each
    # step by the gradient's own scale, so a near-zero gradient summed in another order can
    # move a weight by a small fraction of lr (1.1e-5 seen on an AMD host's OpenBLAS kernels);
    # a wrong split of the batch moves weights by ~lr (3e-3) per step
    for k in at3:
        assert np.allclose(got[k], at3[k], rtol=1e-4, atol=5e-5), (k, np.abs(got[k] - at3[k]).max())
    # and the tolerance tells a wrong split apart: training on one rank's half of every batch
    # (what a rank that skipped the all-reduce would do) moves some weight far past it
    half = tmp_path / "half"
    shutil.copytree(one / "features-cache", half / "features-cache")  # the same collected features
    train(PAIR_E, drafter, data, half, stop_at=3, **{**kw, "batch_size": 4})
    wrong = _params(half)
    moved = max(float(np.abs(wrong[k] - at3[k]).max()) for k in at3)
    assert moved > 20 * 5e-5, moved
    assert json.loads((two / "checkpoint" / "state.json").read_text())["ranks"] == 2
    # each rank collected its share of the shards into the shared folder: together, all of them
    shards = sorted(p.name for p in (one / "features-cache").glob("shard-*.npz"))
    assert len(shards) == 6 and sorted(p.name for p in (two / "features-cache").glob("shard-*.npz")) == shards
    train(PAIR_E, drafter, data, two, **kw)  # the 2-rank checkpoint resumed by one rank
    la, lb = _log(one), _log(two)
    assert [r["step"] for r in lb] == list(range(1, 7))
    assert np.allclose([r["loss"] for r in lb], [r["loss"] for r in la], rtol=1e-4, atol=1e-5)
    assert [r["tokens_seen"] for r in lb] == [r["tokens_seen"] for r in la]  # global tokens, not one rank's


def test_dflash_anchors_are_a_function_of_the_global_row():
    from mtpflow.drafters.dflash.train import _anchors

    rng = np.random.default_rng(0)
    lens = rng.integers(10, 30, size=8)
    lmask = np.zeros((8, 32), bool)
    for r, n in enumerate(lens):
        lmask[r, 4:n] = True
    whole = _anchors(lmask, lens, 3, 4, seed=1, step=5)
    halves = [_anchors(lmask[a:a + 4], lens[a:a + 4], 3, 4, seed=1, step=5, row0=a) for a in (0, 4)]
    for i in range(2):
        assert np.array_equal(np.concatenate([h[i] for h in halves]), whole[i])
    assert not np.array_equal(whole[0], _anchors(lmask, lens, 3, 4, seed=1, step=6)[0])


def test_ranks_split_the_global_batch_and_refuse_a_ragged_one():
    one = Ranks(None)
    assert one.rows(8) == slice(0, 8) and one.sum(3) == 3 and one.any(True)

    class Fake:
        def __init__(self, r, n):
            self.r, self.n = r, n

        def rank(self):
            return self.r

        def size(self):
            return self.n

    assert [Ranks(Fake(r, 2)).rows(8) for r in (0, 1)] == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        Ranks(Fake(0, 3)).rows(8)

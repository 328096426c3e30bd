"""Data-parallel training on MLX's own distributed backend (``mx.distributed``).

Launched by ``mlx.launch`` (ring over TCP, MPI, ...), every process runs the
same ``mtpflow train``; :func:`world` is the group of them (a single process is
a group of size 1, and then nothing here communicates).  The rules that make
``R`` ranks give what one process gives with the same ``--batch-size``:

* ``--batch-size`` is the **global** batch: the examples of step ``s`` are
  :func:`mtpflow.train.data.batch_indices` ``(seed, s)`` whatever the number of
  ranks, and rank ``r`` reads rows ``r*B/R .. (r+1)*B/R - 1`` of it
  (:meth:`Ranks.rows`);
* the loss of every unrolled step is normalised by the **global** count of
  its terms (one ``all_sum`` of the counts inside the differentiated
  function), so the summed per-rank gradients are the gradient of the global
  batch's loss; gradients are averaged with :func:`mlx.nn.average_gradients`
  (``all_sum`` in ~32 MB buckets);
* rank 0 reads and writes the checkpoint, the log and the drafter, and at
  the start sends its parameters, optimiser state and step to every rank
  (:meth:`Ranks.broadcast_tree`), so a run resumes with any number of ranks,
  and only rank 0's machine needs the checkpoint;
* every rank must hold the same training data (the same feature folder, or
  the same data spec): :meth:`Ranks.check_same` compares a fingerprint and
  stops every rank with one line when they differ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _launched() -> bool:
    """Whether this process was started as one of several ranks (then a backend
    that fails to start is an error, not a silent group of one)."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and Path(hostfile).is_file() and Path(hostfile).read_text().strip():
        return True
    for var in ("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        try:
            if int(os.environ.get(var, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


class Ranks:
    """This process's place in the group, and the few collectives training needs."""

    def __init__(self, group=None):
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1

    @classmethod
    def current(cls) -> "Ranks":
        import mlx.core as mx

        if not mx.distributed.is_available():
            return cls(None)
        return cls(mx.distributed.init(strict=_launched()))

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes."""
        return self.rank == 0

    def sum(self, x):
        """``all_sum`` over the ranks (``x`` itself with one rank)."""
        import mlx.core as mx

        return x if self.size == 1 else mx.distributed.all_sum(x, group=self.group)

    def max(self, x: float) -> float:
        """The largest ``x`` over the ranks."""
        import mlx.core as mx

        if self.size == 1:
            return x
        return float(mx.distributed.all_max(mx.array([x], mx.float32), group=self.group).item())

    def barrier(self) -> None:
        import mlx.core as mx

        if self.size > 1:
            mx.eval(self.sum(mx.array([1], mx.int32)))

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of ``batch_size``."""
        if batch_size % self.size:
            raise ValueError(f"--batch-size {batch_size} is the global batch and must be a multiple of the "
                             f"{self.size} ranks")
        b = batch_size // self.size
        return slice(self.rank * b, (self.rank + 1) * b)

    def broadcast_tree(self, tree):
        """Rank 0's values of a tree of arrays (same structure on every rank)."""
        import mlx.core as mx
        from mlx.utils import tree_flatten, tree_unflatten

        if self.size == 1:
            return tree
        flat = tree_flatten(tree)
        out = [(k, self.sum(v if self.main else mx.zeros_like(v))) for k, v in flat]
        mx.eval([v for _, v in out])
        return tree_unflatten(out)

    def broadcast_json(self, obj):
        """Rank 0's JSON-able ``obj``."""
        import mlx.core as mx
        import numpy as np

        if self.size == 1:
            return obj
        data = json.dumps(obj).encode() if self.main else b""
        n = int(self.sum(mx.array([len(data)], mx.int32)).item())
        buf = np.frombuffer(data, np.uint8) if self.main else np.zeros(n, np.uint8)
        got = self.sum(mx.array(buf.astype(np.int32)))
        return json.loads(bytes(np.array(got).astype(np.uint8)).decode())

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank (every rank gets the same answer)."""
        import mlx.core as mx

        if self.size == 1:
            return bool(flag)
        return int(self.sum(mx.array([int(bool(flag))], mx.int32)).item()) > 0

    def check_same(self, digest: str, what: str, fix: str) -> None:
        """Stop every rank when ``digest`` (a hex string) differs from rank 0's."""
        if self.size == 1:
            return
        ref = self.broadcast_json(digest)
        if self.any(digest != ref):
            mine = "differs from" if digest != ref else "is rank 0's, but another rank's differs from"
            raise ValueError(f"rank {self.rank} of {self.size}: {what} {mine} rank 0's; {fix}")


def device() -> dict:
    """Where this process computes: ``{"device": "gpu:0", "backend": "metal" |
    "cuda" | "cpu", "name": ...}`` (MLX's default device; the same code runs
    on each)."""
    import mlx.core as mx

    d = mx.default_device()
    kind = "gpu" if d.type == mx.DeviceType.gpu else "cpu"
    backend = "cpu"
    if kind == "gpu":
        backend = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "gpu"
    try:
        name = str(mx.device_info().get("device_name", ""))
    except Exception:  # (older MLX, or a backend without device information)
        name = ""
    index = getattr(d, "index", None)
    if index is None:  # (the Python binding exposes the index only in the repr: "Device(gpu, 0)")
        index = str(d).rstrip(")").rpartition(",")[2].strip() or 0
    return {"device": f"{kind}:{index}", "backend": backend, "name": name}


def throughput(tokens: int, seconds: float, ranks: "Ranks") -> dict:
    """Tokens per second over every rank and per device, with the device."""
    tps = tokens / seconds if seconds > 0 else 0.0
    return {"tokens_per_s": round(tps, 1), "tokens_per_s_per_device": round(tps / ranks.size, 1),
            "ranks": ranks.size, **device()}


def rate_text(tps: float, ranks: "Ranks") -> str:
    """``"812 tok/s"`` or, with several ranks, ``"1624 tok/s (812/device x2)"``."""
    if ranks.size == 1:
        return f"{tps:.0f} tok/s"
    return f"{tps:.0f} tok/s ({tps / ranks.size:.0f}/device x{ranks.size})"


def world() -> Ranks:
    """The ranks of this run (see the module docstring)."""
    return Ranks.current()

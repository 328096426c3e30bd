"""Training lanes: the parts of a batch evaluated side by side, one per CPU core.

On ``mlx[cpu]`` an elementwise kernel runs on one thread, and one ``mx.eval``
keeps only a few operations in flight, so a training step leaves a core idle
for most of its elementwise work (``docs/training.md``, "Throughput against
the limit").  Lanes cut each micro-batch into ``n`` parts: the calling thread
builds every part's graph, each on the CPU stream of a worker thread of its
own, and the workers evaluate the parts at the same time, with single-threaded
OpenBLAS products (:func:`mtpflow.backend.blas.blas_threads`).  The parts are
summed in order, so the result is that of the same parts evaluated one after
another (what :class:`Lanes` does with ``inline=True``).

A part may only use arrays that are evaluated or that it built itself: a module
that caches a lazy array the first time it is called would hand one lane's
unevaluated array to another.  The optimiser loop therefore runs the first step
of every sitting inline, which evaluates such caches.
"""

from __future__ import annotations

import os
import queue
import threading

import mlx.core as mx

__all__ = ["Lanes", "lane_count"]


def lane_count(requested: int, rows: int, ranks: int = 1) -> int:
    """How many lanes a step of ``rows`` rows (per micro-batch) runs: ``requested``,
    or with 0 the device profile's ``train_lanes`` (on a CPU: its cores shared by
    the ``ranks`` on this machine), never more than the rows."""
    if requested == 0:  # (TrainConfig refuses a negative value)
        from ..backend.profiles import current

        requested = current().train_lanes or max(1, (os.cpu_count() or 1) // max(1, ranks))
    return max(1, min(requested, rows))


class _Worker:
    """A thread with a CPU stream of its own that evaluates what it is given."""

    def __init__(self, index: int):
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        ready: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(ready,), name=f"mtpflow-lane-{index}", daemon=True)
        self.thread.start()
        self.stream = ready.get()

    def _run(self, ready) -> None:
        ready.put(mx.new_stream(mx.cpu))
        while True:
            arrays = self.jobs.get()
            if arrays is None:
                return
            try:
                mx.eval(arrays)
                self.done.put(None)
            except BaseException as exc:  # handed to the thread that waits
                self.done.put(exc)


class Lanes:
    """``n`` lanes: :meth:`stream` is the stream part ``i`` is built on,
    :meth:`submit` starts evaluating it, :meth:`wait` waits for all that was
    submitted (re-raising a lane's error).  ``inline``: everything on the
    calling thread and its default stream, one part after another."""

    def __init__(self, n: int):
        self.n = n
        self.inline = False
        self._workers: list[_Worker] = []
        self._pending: list[int] = []

    def _worker(self, i: int) -> _Worker:
        while len(self._workers) <= i:
            self._workers.append(_Worker(len(self._workers)))
        return self._workers[i]

    def stream(self, i: int):
        """The stream context to build part ``i`` in."""
        if self.inline:
            return mx.stream(mx.default_stream(mx.default_device()))
        return mx.stream(self._worker(i).stream)

    def submit(self, i: int, arrays) -> None:
        if self.inline:
            mx.eval(arrays)
            return
        self._worker(i).jobs.put(arrays)
        self._pending.append(i)

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        errors = [self._workers[i].done.get() for i in pending]
        for exc in errors:
            if exc is None:
                continue
            if isinstance(exc, RuntimeError) and "no Stream" in str(exc):
                raise RuntimeError(f"a training lane's graph uses an array another lane built and did not evaluate "
                                   f"({exc}); run with --lanes 1 and report it") from exc
            raise exc

    def close(self) -> None:
        for w in self._workers:
            w.jobs.put(None)
        for w in self._workers:
            w.thread.join(timeout=5)
        self._workers = []

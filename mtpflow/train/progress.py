"""A progress bar on stderr for training, feature collection and evaluation (tqdm when it is
installed, else a plain line per update)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A tqdm bar on stderr (a plain line per update without tqdm)."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str = "train"):
        self.bar = None
        self.enabled = enabled
        self.desc = desc
        self.total, self.t0, self.start = total, time.time(), initial
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, file=sys.stderr, dynamic_ncols=True, desc=desc)
            except ImportError:
                self.bar = None

    def update(self, step: int, info: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(info, refresh=False)
            self.bar.refresh()
        else:
            el = time.time() - self.t0
            done = step - self.start
            eta = el / done * (self.total - step) if done else float("nan")
            print(f"{self.desc} {step}/{self.total} {info} eta {eta:.0f}s", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


"""Training generic KV-sharing MTP drafters (``mtpflow_assistant``) against a frozen target.

* :mod:`.data`: ShareGPT / JSONL / plain-text / self-distillation examples,
  rendered with the target's chat template, loss on assistant tokens only;
* :mod:`.loop`: :func:`train` (AdamW, warm-up + cosine, clipping, resumable
  checkpoints, progress bar) and the training objective :func:`drafter_loss`;
* :mod:`.eval`: :func:`evaluate` -- tau and acceptance per position through
  the real engine, JSON + PNG report.

Nothing here imports mlx at module import time except through the submodules.
"""

__all__ = ["train", "evaluate", "load_examples"]


def __getattr__(name):
    if name == "train":
        from .loop import train

        return train
    if name == "evaluate":
        from .eval import evaluate

        return evaluate
    if name == "load_examples":
        from .data import load_examples

        return load_examples
    raise AttributeError(name)

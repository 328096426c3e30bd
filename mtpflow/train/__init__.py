"""Training drafters against a frozen target, the parts every drafter kind shares.

* :mod:`.run`: :func:`train`, which finds the kind's trainer among the registered drafter kinds
  (:class:`mtpflow.api.TrainableDrafter`; the built-in ones live next to their drafters,
  ``mtpflow/drafters/<kind>/train.py``) and hands it the loaded target; :mod:`.cli` its command line;
* :mod:`.optimize`: the optimiser loop (AdamW / Adafactor, warm-up + cosine or linear schedule,
  clipping, accumulation, resumable checkpoints, ``train_log.jsonl``, progress bar);
* :mod:`.data`, :mod:`.sources`, :mod:`.features`: ShareGPT / JSONL / plain-text /
  self-distillation examples rendered with the target's chat template (loss on assistant tokens
  only), and cached target features (``distill:``, ``cache:``);
* :mod:`.target`, :mod:`.objective`, :mod:`.kind`: the frozen target and the pieces of the
  objective and of a run that several kinds share;
* :mod:`.eval`: :func:`evaluate` -- tau and acceptance per position through the real engine,
  JSON + PNG report.

Nothing here imports mlx at module import time except through the submodules.
"""

__all__ = ["train", "evaluate", "load_examples"]


def __getattr__(name):
    if name == "train":
        from .run import train

        return train
    if name == "evaluate":
        from .eval import evaluate

        return evaluate
    if name == "load_examples":
        from .data import load_examples

        return load_examples
    raise AttributeError(name)

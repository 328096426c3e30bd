"""Sampling and lossless speculative acceptance as pure MLX functions.

Everything here is vectorised over the batch ``B`` and the position axis
``L``; no function performs a host sync (no ``.item()``, ``.tolist()`` or
``mx.eval``), so they can be fused into one lazy graph (and ``mx.compile``-d).
Output shapes depend only on input shapes.

Processing pipeline (:func:`process_logits`), applied per row in this order --
the same function is used for target-only decoding, for the drafter's own
distribution and for verification, so every path sees the same distribution:

1. logit bias (dense ``[B, V]`` built once from each row's ``logit_bias``),
2. repetition penalty (HF semantics: tokens present in the row's context get
   ``x / r`` if ``x > 0`` else ``x * r``), then OpenAI's frequency and presence
   penalties over the tokens the row generated (``x - count * frequency -
   (count > 0) * presence``); while verifying, position ``l`` also counts the
   drafts before it (:func:`token_counts`), as target-only decoding would,
3. temperature (greedy rows, ``temperature <= 0``, are turned into a one-hot
   distribution at the argmax of the logits after steps 1-2),
4. top-k (``0`` = disabled; ties with the k-th value are kept, as in HF),
5. top-p / nucleus (keep the smallest prefix of the sorted distribution whose
   mass reaches ``top_p``; ties with the last kept value are kept),
6. min-p (keep tokens with ``p >= min_p * max(p)``).

The result is a log-softmax; removed tokens get ``-inf``.

Speculative acceptance:

* :func:`greedy_accept` -- exact-match against the target argmax.
* :func:`coupled_accept` -- position-keyed Gumbel coupling: the target's token
  at every verified position is drawn by Gumbel-max with noise keyed by the
  row's seed and that **absolute position** (:func:`position_keys`), and a
  draft is accepted while it equals it.  Lossless (each emitted token is an
  exact sample of the processed target distribution given its prefix), and
  the output is exactly what target-only sampling with the same seed gives:
  it does not depend on the drafts, the block size, the batch or the round.
  For drafts chosen deterministically (argmax, ``q`` one-hot) a draft is
  accepted with probability ``p(d)``, the same as rejection sampling.
* :func:`rejection_accept` -- Leviathan et al. / Chen et al. speculative
  sampling, for drafts *sampled* from a drafter distribution ``q``;
  lossless, i.e. the emitted tokens are distributed exactly as target-only
  sampling from the processed target distribution.

The code lives in :mod:`~mtpflow.sampling.params` (:class:`ProcessParams`),
:mod:`~mtpflow.sampling.logits` (processing), :mod:`~mtpflow.sampling.draw`
(keys and draws), :mod:`~mtpflow.sampling.accept` (chain acceptance) and
:mod:`~mtpflow.sampling.tree` (tree acceptance); every public name is
importable from here.
"""

from __future__ import annotations

from mtpflow.sampling.accept import coupled_accept, coupled_sample, greedy_accept, position_keys, rejection_accept
from mtpflow.sampling.draw import greedy, greedy_tokens, row_keys, sample, sample_logits, split_keys
from mtpflow.sampling.logits import presence_mask, process_logits, token_counts
from mtpflow.sampling.params import ProcessParams
from mtpflow.sampling.tree import tree_accept, tree_visibility

__all__ = [
    "ProcessParams",
    "process_logits",
    "presence_mask",
    "token_counts",
    "greedy_accept",
    "rejection_accept",
    "sample",
    "greedy",
    "greedy_tokens",
    "sample_logits",
    "split_keys",
    "row_keys",
    "position_keys",
    "coupled_sample",
    "coupled_accept",
    "tree_visibility",
    "tree_accept",
]

"""``mtpflow bench``: throughput of speculative decoding against plain mlx-lm.

Every variant runs in one process on the *same* target model object, and the
repeats are interleaved round-robin (the variant order rotates every repeat),
so thermal or load drift hits all variants alike:

* ``mlx_lm``: target-only decoding through mlx-lm itself (``generate_step``
  at batch 1, ``BatchGenerator`` for larger batches; greedy, or mlx-lm's
  ``make_sampler`` with ``--temperature``) -- the baseline every ratio refers
  to (same batch size);
* ``mtpflow-null``: mtpflow without a drafter (block size 1) -- the cost of
  mtpflow's round loop and cache against plain mlx-lm;
* ``mtpflow-k{K}``: mtpflow with the drafter at block size K (K-1 drafts);
* ``mlx_lm-spec-k{K}``: mlx-lm's own speculative decoding with
  ``--mlx-lm-draft-model`` (``num_draft_tokens=K-1``; batch 1 only, as in mlx-lm).

Batch size B decodes consecutive groups of B prompts together; batch 1 decodes
the prompts one after another.  By default EOS is ignored so every variant
produces exactly ``max_tokens`` tokens per prompt (``--stop-at-eos`` to stop).

Outputs ``DIR/bench.json`` and PNG plots.  Nothing here imports mlx at module
level (OpenBLAS must be loaded first, see :mod:`mtpflow.backend.blas`).

* :mod:`.options`: the command line (:func:`add_bench_arguments`, the presets) and the run's config;
* :mod:`.prompt_sets`: the built-in prompt sets, a prompt file, their encoding;
* :mod:`.variants`: what is compared (:class:`MLXLMVariant`, :class:`MTPFlowVariant`, :func:`build_variants`);
* :mod:`.measure`: the interleaved timed runs, acceptance per position, peak memory, the verify-cost curve;
* :mod:`.report` and :mod:`.plots`: ``bench.json``'s figures, the table, the PNG plots;
* :mod:`.run`: :func:`run_bench` and ``python -m mtpflow.bench`` (:func:`main`).
"""

from .measure import (  # noqa: F401
    VERIFY_CONTEXT,
    VERIFY_LENGTHS,
    RoundCollector,
    summarize,
    verify_cost,
)
from .options import (  # noqa: F401
    PRESETS,
    BenchError,
    _config,
    add_bench_arguments,
    apply_preset,
    resolve_model_path,
)
from .prompt_sets import CHAT_SETS, FIXTURES, PROMPT_SETS, encode_prompts, load_prompt_texts  # noqa: F401
from .report import ONE_REPEAT, format_table  # noqa: F401
from .run import main, run_bench  # noqa: F401
from .variants import MLXLMVariant, MTPFlowVariant, Variant, build_variants  # noqa: F401

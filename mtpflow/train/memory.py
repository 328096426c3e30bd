"""The memory budget of training: a quantized frozen target, gradient
accumulation, gradient checkpointing, a factored optimizer, and peak-memory
reporting.

* ``--target-bits 4|8``: the frozen target is quantized in memory with MLX's
  affine group quantization (``nn.quantize``, what ``mlx_lm.utils.quantize_model``
  applies) before any feature is computed, so the drafter trains on the
  features the deployed (quantized) model produces.  Layers whose input width
  is not a multiple of the group size stay as they are.
* ``--grad-accum N``: each optimizer step runs the batch in ``N`` micro-batches
  and sums their gradients; the loss is normalised by the term counts of the
  whole batch, so the gradient equals the one-pass gradient (to rounding).
* ``--grad-checkpoint``: the drafter layers' activations are recomputed in the
  backward pass instead of kept (``mx.checkpoint``, :func:`checkpointed`): each layer's MLP, or
  the methods a layer names in ``checkpoint_methods`` (EAGLE-3: attention output + MLP).
* ``--optimizer adafactor``: MLX's maintained ``optim.Adafactor`` keeps
  factored second moments (a row and a column vector per matrix, no first
  moment) instead of AdamW's two full moments.  MLX has no maintained 8-bit
  Adam (neither mlx nor mlx-lm ship one), so that is the factored option.

:func:`peak` reports MLX's peak allocation (``mx.get_peak_memory``) and the
process's peak resident set (``ru_maxrss``).
"""

from __future__ import annotations

import resource
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

__all__ = ["check_config", "make_optimizer", "quantize_target", "quantized_from_path", "checkpoint_layers", "checkpointed", "peak",
           "micro_slices", "tree_bytes"]

OPTIMIZERS = ("adamw", "adafactor")


def check_config(cfg) -> None:
    """Refuse bad memory-budget settings of a :class:`~mtpflow.train.loop.TrainConfig`."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} (got {cfg.optimizer!r}); "
                         "8-bit Adam has no maintained MLX implementation, use adafactor for a small optimizer state")
    if cfg.grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1 (got {cfg.grad_accum})")
    if cfg.target_bits not in (None, 4, 8):
        raise ValueError(f"target_bits must be 4 or 8 (got {cfg.target_bits}); omit it to keep the target as loaded")
    if cfg.schedule not in ("cosine", "linear"):
        raise ValueError(f"schedule must be 'cosine' or 'linear' (got {cfg.schedule!r})")
    if not 0.0 < cfg.dpace_alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in (0, 1] (got {cfg.dpace_alpha})")


def make_optimizer(cfg, schedule):
    """AdamW as torch defines it (bias-corrected moments, decoupled weight
    decay) or Adafactor with the same schedule and weight decay."""
    if cfg.optimizer == "adafactor":
        return optim.Adafactor(learning_rate=schedule, relative_step=False, scale_parameter=False,
                               weight_decay=cfg.weight_decay)
    return optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay, bias_correction=True)


def quantize_target(target, bits: int, group_size: int = 64) -> int:
    """Quantize a loaded target adapter's weights in place (affine, ``bits``
    bits, groups of ``group_size`` columns, 32 where a width needs it).
    Returns the number of quantized layers."""
    n = _quantize_model(target.model, bits, group_size)
    mx.eval(target.model.parameters())
    target.config = dict(target.config, quantization={"group_size": group_size, "bits": bits})
    return n


def quantized_from_path(cls, path, config: dict, bits: int, group_size: int = 64):
    """``cls.from_path`` with the weights quantized as they load: mlx-lm loads
    them lazily, the quantized layers are built from the lazy weights and
    evaluated a few arrays at a time, so the full-precision checkpoint is never
    in memory at once.  Unquantized parameters (norms, scales) are float32."""
    import mlx_lm.utils as lm_utils
    from mlx.utils import tree_flatten

    real = lm_utils.load_model

    def load_model(model_path, *args, **kwargs):
        kwargs["lazy"] = True
        model, cfg = real(model_path, *args, **kwargs)
        _quantize_model(model, bits, group_size)
        model.set_dtype(mx.float32)  # floating parameters only: quantized weights stay packed
        arrays = [v for _, v in tree_flatten(model.parameters())]
        for i in range(0, len(arrays), 8):
            mx.eval(arrays[i:i + 8])
        return model, cfg

    lm_utils.load_model = load_model
    try:
        target = cls.from_path(path, config, dtype=None)
    finally:
        lm_utils.load_model = real
    target.config = dict(target.config, quantization={"group_size": group_size, "bits": bits})
    return target


def _quantize_model(model, bits: int, group_size: int) -> int:
    """Quantize every layer that can be (``to_quantized``, not yet quantized)
    whose input width is a multiple of ``group_size`` (else of 32)."""
    n = 0
    for g in (group_size, 32):
        def pred(path, m, g=g):
            w = getattr(m, "weight", None)
            if not hasattr(m, "to_quantized") or isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                return False
            if w is None or w.ndim != 2 or w.shape[-1] % g:
                return False
            return g == 32 or w.shape[-1] % group_size == 0

        before = _count_quantized(model)
        nn.quantize(model, group_size=g, bits=bits, class_predicate=pred)
        n += _count_quantized(model) - before
    return n


def _count_quantized(model) -> int:
    return sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def tree_bytes(tree) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


def checkpointed(module, fn):
    """``fn`` (a call of ``module``) with its activations recomputed in the backward pass
    (``mx.checkpoint`` over ``module``'s trainable parameters, as ``nn.utils.checkpoint``).  The
    parameters inside are the transform's copies: they are named to the FLOP counter as trained
    (:meth:`~mtpflow.train.flops.count_matmuls.trained`), and the backward's second call counts as
    recomputation (:meth:`~mtpflow.train.flops.count_matmuls.recomputing`)."""
    from .flops import count_matmuls

    def call(*args, **kwargs):
        calls = []

        def inner(params, *a, **k):
            module.update(params)
            count_matmuls.trained(params)
            calls.append(None)
            if len(calls) > 1:  # mx.checkpoint's vjp runs the function again
                with count_matmuls.recomputing():
                    return fn(*a, **k)
            return fn(*a, **k)

        return mx.checkpoint(inner)(module.trainable_parameters(), *args, **kwargs)

    return call


#: set on what :func:`checkpoint_layers` made (a layer's wrapped method, an MLP's subclass), so a
#: second call wraps nothing twice
_MARK = "_mtpflow_checkpointed"


def _checkpointed_class(cls):
    """A subclass of ``cls`` whose ``__call__`` recomputes its activations in
    the backward pass (parameter names unchanged)."""

    def __call__(self, *args, **kwargs):
        return checkpointed(self, lambda *a, **k: cls.__call__(self, *a, **k))(*args, **kwargs)

    return type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": __call__, _MARK: True})


def _mlps(layer) -> list:
    """The outermost submodules of ``layer`` named ``*mlp`` (``mlp``, an MTP block's
    ``block.mlp``, a mixer's ``switch_mlp``), in order."""
    chosen = []
    for name, m in sorted(layer.named_modules(), key=lambda kv: kv[0].count(".")):
        leaf = name.rsplit(".", 1)[-1]
        if name and leaf.endswith("mlp") and not any(name.startswith(c + ".") for c, _ in chosen):
            chosen.append((name, m))
    return [m for _, m in chosen]


def checkpoint_layers(model) -> int:
    """Gradient checkpointing of a drafter's layers: each layer's methods named in its
    ``checkpoint_methods`` (a layer that training calls through methods of its own, not
    ``__call__``: EAGLE-3's ``finish`` and ``finish_ttt``, attention output + MLP), else its MLPs
    (its outermost submodules named ``*mlp``: an MTP layer's ``block.mlp``).  Returns the number
    of checkpointed blocks; none is an error (the option would silently do nothing)."""
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    n = 0
    for layer in layers or []:
        names = getattr(type(layer), "checkpoint_methods", ())
        for name in names:
            if not getattr(getattr(layer, name), _MARK, False):
                call = checkpointed(layer, getattr(type(layer), name).__get__(layer))
                setattr(call, _MARK, True)
                setattr(layer, name, call)
            n += 1
        for mlp in [] if names else _mlps(layer):
            if not type(mlp).__dict__.get(_MARK, False):
                mlp.__class__ = _checkpointed_class(type(mlp))
            n += 1
    if not n:
        raise ValueError(f"--grad-checkpoint: {type(model).__name__} has no layer with an MLP or checkpoint_methods "
                         "to recompute; train without --grad-checkpoint")
    return n


def micro_slices(rows: slice, n: int) -> list[slice]:
    """``rows`` cut into ``n`` contiguous micro-batches (the last ones one row shorter)."""
    start, stop = rows.start or 0, rows.stop
    size = stop - start
    if n > size:
        raise ValueError(f"grad_accum {n} is more than the {size} rows of a batch; use at most {size}")
    cuts = [start + (size * i) // n for i in range(n + 1)]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


def peak(mlx_bytes: int | None = None) -> dict:
    """``{"mlx_peak_gb", "rss_peak_gb", "mlx_peak_bytes"}``: MLX's peak
    allocation (``mlx_bytes``, default ``mx.get_peak_memory()``) and the
    process's peak resident set so far."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    b = int(mx.get_peak_memory() if mlx_bytes is None else mlx_bytes)
    return {"mlx_peak_gb": round(b / 2**30, 4), "rss_peak_gb": round(rss_bytes / 2**30, 4), "mlx_peak_bytes": b}

"""Config of the generic assistant drafter, the target's attention geometry,
and the drafter/target compatibility check (on the two config.json files).

A drafter ``config.json``::

    {"model_type": "mtpflow_assistant", "target_model_type": "llama",
     "backbone_hidden_size": 576,            # the target's hidden size Dt
     "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
     "layer_types": ["full_attention", "full_attention"],
     "attention": {"full_attention": {"num_attention_heads": 9, "num_key_value_heads": 3,
                                       "head_dim": 64, "scale": 0.125, "q_norm": false}},
     "sliding_window": null, "rms_norm_eps": 1e-5, "vocab_size": 49152,
     "lm_head": "target",                    # "target" | "own"
     "hidden_norm": "target"}                # h' through the target's final norm (or "none")

``lm_head``:

* ``"target"`` (default): logits = ``target.logits(post_projection(final))``.
  The drafter owns no vocabulary-sized matrix (small checkpoint), and the
  projected state -- which is fed back as the next ``h`` -- is trained to
  behave like the target's own post-norm hidden state, whose LM-head readout
  is the next token.  That is exactly what ``h`` means at the first step.
* ``"own"``: an own ``Linear(hidden_size, vocab_size)`` on the final normed
  state (bigger, independent of the target's head).
"""

from __future__ import annotations

from typing import Literal

import attrs

from ...targets.base import FULL, SLIDING
from ...targets.mlxlm import _text
from ..base import IncompatibleDrafter, target_class  # noqa: F401  (IncompatibleDrafter re-exported)
from . import MODEL_TYPES

LM_HEADS = ("target", "own")


def _positive(inst, attribute, value):
    if value is not None and value < 1:
        raise ValueError(f"must be >= 1 (got {value})")


@attrs.frozen(kw_only=True)
class TrainOptions:
    """``mtpflow train --drafter-config`` options of the assistant kind
    (:func:`make_config`'s arguments; unset: derived from the target)."""

    num_hidden_layers: int = attrs.field(default=2, validator=_positive)
    hidden_size: int | None = attrs.field(default=None, validator=_positive)
    intermediate_size: int | None = attrs.field(default=None, validator=_positive)
    layer_types: list[str] | None = None
    lm_head: Literal["target", "own"] = "target"
    q_norm: bool | None = None
    #: a reduced draft vocabulary of this many of the data's most frequent tokens
    draft_vocab_size: int | None = attrs.field(default=None, validator=_positive)
    hidden_norm: Literal["target", "none"] = "target"
    sliding_window: int | None = attrs.field(default=None, validator=_positive)
    rms_norm_eps: float | None = None




def target_geometry(target_config: dict) -> dict:
    """Per attention type of the target: ``{num_attention_heads,
    num_key_value_heads, head_dim, scale, q_norm}``, plus ``hidden_size``,
    ``vocab_size``, ``sliding_window``, ``rms_norm_eps``, ``layer_types``,
    ``model_type`` (config only, no weights; from the target's adapter class)."""
    cls = target_class(target_config)
    tc = cls.text_config(target_config)
    types = cls.layer_types_of(target_config)
    return {
        "model_type": str(target_config.get("model_type", "")),
        "hidden_size": tc["hidden_size"],
        "vocab_size": tc.get("vocab_size") or target_config.get("vocab_size"),
        "sliding_window": tc.get("sliding_window") if SLIDING in types else None,
        "rms_norm_eps": tc.get("rms_norm_eps", 1e-6),
        "layer_types": types,
        "attention": cls.attention_geometry(target_config),
    }


def default_layer_types(target_types, n_layers: int) -> list[str]:
    """Sliding layers then one full layer when the target has both, else its one type."""
    kinds = set(target_types)
    if kinds == {FULL, SLIDING} and n_layers > 1:
        return [SLIDING] * (n_layers - 1) + [FULL]
    return [FULL if FULL in kinds else SLIDING] * n_layers


def make_config(
    target_config: dict,
    *,
    num_hidden_layers: int = 2,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    layer_types: list[str] | None = None,
    lm_head: str = "target",
    q_norm: bool | None = None,
    **extra,
) -> dict:
    """A drafter config.json dict for ``target_config`` (defaults: Dd = Dt,
    MLP width = the target's, 2 layers)."""
    geo = target_geometry(target_config)
    tc = _text(target_config)
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head must be one of {LM_HEADS} (got {lm_head!r})")
    types = list(layer_types or default_layer_types(geo["layer_types"], num_hidden_layers))
    att = {t: dict(geo["attention"][t]) for t in sorted(set(types)) if t in geo["attention"]}
    if q_norm is not None:
        for a in att.values():
            a["q_norm"] = bool(q_norm)
    cfg = {
        "model_type": MODEL_TYPES[0],
        "architectures": ["MtpflowAssistant"],
        "target_model_type": geo["model_type"],
        "backbone_hidden_size": geo["hidden_size"],
        "hidden_size": hidden_size or geo["hidden_size"],
        "intermediate_size": intermediate_size or tc.get("intermediate_size") or 4 * geo["hidden_size"],
        "num_hidden_layers": len(types),
        "layer_types": types,
        "attention": att,
        "sliding_window": geo["sliding_window"] if SLIDING in types else None,
        "rms_norm_eps": geo["rms_norm_eps"],
        "vocab_size": geo["vocab_size"],
        "lm_head": lm_head,
        "hidden_act": "silu",
        "hidden_norm": "target",
    }
    cfg.update(extra)
    check_compatible(target_config, cfg)
    return cfg


def check_compatible(target_config: dict, drafter_config: dict) -> dict:
    """Raise :class:`IncompatibleDrafter` naming the first mismatching field;
    return the drafter config."""
    d = drafter_config
    if d.get("model_type") not in MODEL_TYPES:
        raise IncompatibleDrafter(f"drafter model_type is {d.get('model_type')!r}, expected {MODEL_TYPES[0]!r}")
    geo = target_geometry(target_config)

    def bad(field, tval, dval, extra=""):
        raise IncompatibleDrafter(
            f"drafter does not fit target: {field} is {dval} in the drafter but {tval} in the target{extra}; "
            "train a drafter for this target (mtpflow train)"
        )

    if d.get("backbone_hidden_size") != geo["hidden_size"]:
        bad("backbone_hidden_size (target hidden_size)", geo["hidden_size"], d.get("backbone_hidden_size"))
    if d.get("vocab_size") != geo["vocab_size"]:
        bad("vocab_size", geo["vocab_size"], d.get("vocab_size"))
    tmt = d.get("target_model_type")
    if tmt and geo["model_type"] and tmt != geo["model_type"]:
        bad("target_model_type", geo["model_type"], tmt)
    types = list(d.get("layer_types") or [])
    if len(types) != d.get("num_hidden_layers", len(types)) or not types:
        raise IncompatibleDrafter(f"drafter config: layer_types {types} does not match num_hidden_layers {d.get('num_hidden_layers')}")
    missing = set(types) - set(geo["layer_types"])
    if missing:
        bad("layer_types", sorted(set(geo["layer_types"])), sorted(set(types)), f" (the target has no {sorted(missing)} layer to read K/V from)")
    for t in sorted(set(types)):
        da = (d.get("attention") or {}).get(t)
        if da is None:
            raise IncompatibleDrafter(f"drafter config: no attention geometry for {t}")
        ta = geo["attention"][t]
        name = "full" if t == FULL else "sliding"
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
            if da.get(key) != ta[key]:
                bad(f"{name}-attention {key}", ta[key], da.get(key))
    if SLIDING in types and d.get("sliding_window") != geo["sliding_window"]:
        bad("sliding_window", geo["sliding_window"], d.get("sliding_window"))
    if d.get("hidden_norm") not in (None, "none", "target"):
        raise IncompatibleDrafter(f"drafter config: hidden_norm {d.get('hidden_norm')!r} is not 'target' or 'none'")
    if d.get("lm_head", "target") not in LM_HEADS:
        raise IncompatibleDrafter(f"drafter config: lm_head {d.get('lm_head')!r} is not one of {LM_HEADS}")
    return d

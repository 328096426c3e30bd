"""Drafter config parsing and the drafter/target compatibility check.

The check runs on the two ``config.json`` files before any weight is loaded
and names the field, both values and what to use instead.
"""

from __future__ import annotations

import attrs

from ...targets.base import FULL, SLIDING
from ..base import IncompatibleDrafter  # noqa: F401  (re-exported)
from ...targets.gemma4 import head_geometry, text_config

# Published pairings: which drafter goes with which target (for error messages).
KNOWN_PAIRS = {
    1536: "google/gemma-4-E2B-it-assistant (E2B targets)",
    2560: "google/gemma-4-E4B-it-assistant (E4B targets)",
}


@attrs.frozen(kw_only=True)
class AssistantConfig:
    text: dict
    backbone_hidden_size: int
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int
    model_type: str

    @classmethod
    def from_dict(cls, cfg: dict) -> "AssistantConfig":
        if "text_config" not in cfg:
            raise IncompatibleDrafter("drafter config.json has no text_config; is this a gemma4_assistant checkpoint?")
        tc = text_config({"text_config": cfg["text_config"], "vocab_size": cfg.get("vocab_size", cfg["text_config"].get("vocab_size"))})
        # an assistant's layers all read the target's K/V (spec 1.3)
        tc["num_kv_shared_layers"] = tc["num_hidden_layers"]
        return cls(
            text=tc,
            backbone_hidden_size=int(cfg.get("backbone_hidden_size", 1536)),
            use_ordered_embeddings=bool(cfg.get("use_ordered_embeddings", False)),
            num_centroids=int(cfg.get("num_centroids", 2048)),
            centroid_top_k=int(cfg.get("centroid_intermediate_top_k", 32)),
            model_type=cfg.get("model_type", "gemma4_assistant"),
        )

    @property
    def head_kind(self) -> str:
        return "centroid" if self.use_ordered_embeddings else "tied_dense"


def _hint(target_tc: dict) -> str:
    d = target_tc.get("hidden_size")
    known = KNOWN_PAIRS.get(d)
    return f"use {known}" if known else f"use the assistant published for this target (backbone_hidden_size {d})"


def check_compatible(target_config: dict, drafter_config: dict) -> AssistantConfig:
    """Raise :class:`IncompatibleDrafter` naming the first mismatching field."""
    ttc = text_config(target_config)
    acfg = AssistantConfig.from_dict(drafter_config)
    dtc = acfg.text
    hint = _hint(ttc)

    def bad(field, tval, dval, extra=""):
        raise IncompatibleDrafter(
            f"drafter does not fit target: {field} is {dval} in the drafter but {tval} in the target{extra}; {hint}"
        )

    if acfg.backbone_hidden_size != ttc["hidden_size"]:
        bad("backbone_hidden_size (target hidden_size)", ttc["hidden_size"], acfg.backbone_hidden_size)
    if dtc["vocab_size"] != ttc["vocab_size"]:
        bad("vocab_size", ttc["vocab_size"], dtc["vocab_size"])
    tgeo, dgeo = head_geometry(ttc), head_geometry(dtc)
    t_types, d_types = set(ttc["layer_types"]), set(dtc["layer_types"])
    missing = d_types - t_types
    if missing:
        bad("layer_types", sorted(t_types), sorted(d_types), f" (the target has no {sorted(missing)} layer to read K/V from)")
    for t in sorted(d_types):
        tk, th = tgeo[t]
        dk, dh = dgeo[t]
        name = "full" if t == FULL else "sliding"
        if dk != tk:
            bad(f"{name}-attention KV heads", tk, dk)
        if dh != th:
            bad(f"{name}-attention head_dim", th, dh)
    if SLIDING in d_types and dtc.get("sliding_window") != ttc.get("sliding_window"):
        bad("sliding_window", ttc.get("sliding_window"), dtc.get("sliding_window"))
    for t in sorted(d_types):
        tr = (ttc.get("rope_parameters") or {}).get(t)
        dr = (dtc.get("rope_parameters") or {}).get(t)
        if tr is not None and dr is not None:
            for key in ("rope_type", "rope_theta", "partial_rotary_factor"):
                if tr.get(key) != dr.get(key):
                    bad(f"rope_parameters.{t}.{key}", tr.get(key), dr.get(key))
    if acfg.use_ordered_embeddings and dtc["vocab_size"] % acfg.num_centroids:
        raise IncompatibleDrafter(
            f"drafter vocab_size {dtc['vocab_size']} is not a multiple of num_centroids {acfg.num_centroids}; the checkpoint is broken"
        )
    return acfg

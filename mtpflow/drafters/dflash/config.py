"""z-lab DFlash configs and the drafter/target compatibility check.

``dflash_config.target_layer_ids`` name the target layers whose **outputs**
are the context features (transformers' ``hidden_states[l + 1]``): one layer
later than EAGLE-3's ids, so in mtpflow's tap convention (the residual
stream entering a layer) they are ``l + 1``.
"""

from __future__ import annotations

import attrs

from ...errors import IncompatibleDrafter

ARCHITECTURES = ("DFlashDraftModel",)


def _positive(inst, attribute, value):
    if value is not None and value < 1:
        raise ValueError(f"must be >= 1 (got {value})")


@attrs.frozen(kw_only=True)
class TrainOptions:
    """``mtpflow train --kind dflash --drafter-config`` options (unset: the
    defaults of :class:`mtpflow.drafters.dflash.train.DFlashTrainer`)."""

    block_size: int = attrs.field(default=8, validator=_positive)
    num_hidden_layers: int = attrs.field(default=2, validator=_positive)
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = attrs.field(default=None, validator=_positive)
    intermediate_size: int | None = attrs.field(default=None, validator=_positive)


@attrs.frozen(kw_only=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: tuple[bool, ...]  # per layer: causal inside the block (default: sliding layers are)
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int
    num_target_layers: int | None
    target_hidden_size: int
    input_embedding_scale: float
    output_multiplier: float

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers in mtpflow's convention (entering layer ``l + 1``)."""
        return tuple(i + 1 for i in self.target_layer_ids)


def is_dflash(config: dict) -> bool:
    return bool(config.get("dflash_config")) or any(a in ARCHITECTURES for a in config.get("architectures") or ())


def parse(config: dict) -> DFlashConfig:
    dc = config.get("dflash_config")
    if not isinstance(dc, dict) or not dc:
        raise IncompatibleDrafter(
            "DFlash config.json has no dflash_config {block_size, target_layer_ids, mask_token_id}; "
            "is this a z-lab DFlash checkpoint?"
        )
    for key in ("target_layer_ids", "mask_token_id"):
        if key not in dc:
            raise IncompatibleDrafter(f"DFlash config.json: dflash_config has no {key}; the checkpoint is incomplete")
    n = int(config["num_hidden_layers"])
    types = list(config.get("layer_types") or ["full_attention"] * n)
    if len(types) != n:
        raise IncompatibleDrafter(f"DFlash config.json: {len(types)} layer_types for {n} layers")
    sliding = "sliding_attention" in types
    window = config.get("sliding_window") if sliding else None
    if sliding and not window:
        raise IncompatibleDrafter("DFlash config.json: sliding_attention layers but no sliding_window")
    causal_all = config.get("is_causal", dc.get("is_causal"))
    causal = tuple(bool(causal_all) if causal_all is not None else t == "sliding_attention" for t in types)
    rp = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rp["rope_theta"] = float(rp.get("rope_theta", config.get("rope_theta", 10000.0)))
    rp.setdefault("rope_type", rp.get("type", "default"))
    H = int(config["hidden_size"])
    nh = int(config["num_attention_heads"])
    return DFlashConfig(
        hidden_size=H,
        num_hidden_layers=n,
        num_attention_heads=nh,
        num_key_value_heads=int(config.get("num_key_value_heads") or nh),
        head_dim=int(config.get("head_dim") or H // nh),
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rp,
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        layer_types=tuple(types),
        sliding_window=int(window) if window else None,
        causal=causal,
        block_size=int(dc.get("block_size") or config.get("block_size") or 16),
        target_layer_ids=tuple(int(i) for i in dc["target_layer_ids"]),
        mask_token_id=int(dc["mask_token_id"]),
        vocab_size=int(config.get("vocab_size")),
        num_target_layers=config.get("num_target_layers"),
        target_hidden_size=int(config.get("target_hidden_size") or H),
        input_embedding_scale=float(dc.get("input_embedding_scale", 1.0)),
        output_multiplier=float(dc.get("output_multiplier", 1.0)),
    )


def check_compatible(target_config: dict, drafter_config: dict, drafter_path=None) -> DFlashConfig:
    """Raise :class:`IncompatibleDrafter` naming the first mismatch (config.json files only)."""
    from ..base import target_class

    cfg = parse(drafter_config)
    tc = target_class(target_config).text_config(target_config)
    n = int(tc["num_hidden_layers"])
    hint = "use the DFlash drafter published for this target (z-lab/<target>-DFlash-…) or train one (mtpflow train --kind dflash)"
    if cfg.target_hidden_size != tc["hidden_size"]:
        raise IncompatibleDrafter(
            f"DFlash drafter does not fit target: its fc reads hidden size {cfg.target_hidden_size}, "
            f"the target's hidden_size is {tc['hidden_size']}; {hint}"
        )
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n]
    if bad:
        raise IncompatibleDrafter(
            f"DFlash drafter reads target layer {bad[0]} but the target has {n} layers (ids 0..{n - 1}); {hint}"
        )
    if cfg.num_target_layers is not None and int(cfg.num_target_layers) != n:
        raise IncompatibleDrafter(
            f"DFlash drafter was trained on a target with {cfg.num_target_layers} layers, this one has {n}; {hint}"
        )
    tv = int(tc.get("vocab_size") or target_config.get("vocab_size"))
    if cfg.vocab_size != tv:
        raise IncompatibleDrafter(
            f"DFlash drafter does not fit target: vocab_size is {cfg.vocab_size} in the drafter but {tv} in the target; {hint}"
        )
    if not 0 <= cfg.mask_token_id < tv:
        raise IncompatibleDrafter(
            f"DFlash mask_token_id {cfg.mask_token_id} is outside the target's vocabulary (0..{tv - 1}); {hint}"
        )
    return cfg

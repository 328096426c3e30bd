"""EAGLE-3 checkpoint configs: vLLM Speculators and SGLang/SpecForge, and the check.

Both formats become one :class:`Eagle3Config`.  Layer ids are always in
vLLM's / speculators' convention: id ``l`` is the residual stream
**entering** target decoder layer ``l`` (``hidden_states[l]`` in
transformers); ``l = num_hidden_layers`` is the last layer's output before
the final norm.  SpecForge's config names the layer whose *output* is taken,
so its ids are one less (``[1, 3, 4]`` there = ``[2, 4, 5]`` here).

The check runs before any weight is read: on the two ``config.json`` files
and the header of the drafter's safetensors file (shapes only).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import attrs

from ...errors import IncompatibleDrafter

SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Qwen3ForCausalLMEagle3")
SPECULATORS_ARCHITECTURES = ("Eagle3DraftModel", "Eagle3Speculator")


def _positive(inst, attribute, value):
    if value is not None and value < 1:
        raise ValueError(f"must be >= 1 (got {value})")


@attrs.frozen(kw_only=True)
class TrainOptions:
    """``mtpflow train --kind eagle3 --drafter-config`` options (the
    arguments of :func:`mtpflow.drafters.eagle3.export.new_config`; unset:
    ``speculators train``'s defaults for the target)."""

    draft_vocab_size: int | None = attrs.field(default=None, validator=_positive)
    aux_layer_ids: list[int] | None = None
    intermediate_size: int | None = attrs.field(default=None, validator=_positive)
    sliding_window: int | None = attrs.field(default=None, validator=_positive)
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    norm_output: bool = True


@attrs.frozen(kw_only=True)
class Eagle3Config:
    format: str  # "speculators" | "specforge"
    hidden_size: int
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: dict  # rope_theta, rope_type / scaling, as mlx-lm's initialize_rope takes them
    max_position_embeddings: int
    sliding_window: int | None  # the decoder layer's window (None: full attention)
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool  # the *normed* layer output is fed back as the next step's hidden
    qk_norm: bool  # Qwen3-style q_norm / k_norm in the attention
    verifier_architectures: tuple[str, ...] = ()
    verifier_name: str | None = None

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)


def is_eagle3(config: dict) -> bool:
    if config.get("speculators_model_type") == "eagle3":
        return True
    archs = config.get("architectures") or []
    return any(a in SPECFORGE_ARCHITECTURES or a in SPECULATORS_ARCHITECTURES for a in archs)


def _rope(tc: dict) -> dict:
    rp = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    theta = rp.get("rope_theta", tc.get("rope_theta", 10000.0))
    rp["rope_theta"] = float(theta)
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def parse(config: dict) -> Eagle3Config:
    """An :class:`Eagle3Config` from a Speculators or a SpecForge config.json."""
    if config.get("speculators_model_type") is not None:
        algo = config.get("speculators_model_type")
        if algo != "eagle3":
            raise IncompatibleDrafter(
                f"this Speculators checkpoint is algorithm {algo!r}; the eagle3 drafter kind loads only "
                "speculators_model_type 'eagle3' (use a DFlash checkpoint with the dflash kind)"
            )
        tc = config.get("transformer_layer_config") or {}
        if not tc:
            raise IncompatibleDrafter("Speculators eagle3 config.json has no transformer_layer_config; the checkpoint is incomplete")
        fmt = "speculators"
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        norm_output = bool(config.get("norm_output", False))
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        v_arch = tuple(verifier.get("architectures") or ())
        v_name = verifier.get("name_or_path")
    else:
        tc = config
        fmt = "specforge"
        sf_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = None if sf_ids is None else [int(i) + 1 for i in sf_ids]  # SpecForge names the layer whose output is taken
        norm_output = False  # SpecForge always feeds the pre-norm output back
        v_arch, v_name = (), None
    if int(tc.get("num_hidden_layers", 1)) != 1:
        raise IncompatibleDrafter(
            f"EAGLE-3 drafter with {tc.get('num_hidden_layers')} decoder layers: mtpflow runs the 1-layer EAGLE-3 head only"
        )
    if config.get("fc_norm") and config.get("norm_before_fc"):
        raise IncompatibleDrafter("EAGLE-3 config sets both fc_norm and norm_before_fc; the checkpoint is inconsistent")
    H = int(tc["hidden_size"])
    nh = int(tc["num_attention_heads"])
    layer_types = tc.get("layer_types") or []
    sliding = (layer_types and layer_types[0] == "sliding_attention") or (not layer_types and tc.get("use_sliding_window"))
    return Eagle3Config(
        format=fmt,
        hidden_size=H,
        target_hidden_size=int(config.get("target_hidden_size") or H),
        vocab_size=int(tc.get("vocab_size") or config.get("vocab_size")),
        draft_vocab_size=int(config.get("draft_vocab_size") or tc.get("draft_vocab_size") or tc.get("vocab_size")),
        num_attention_heads=nh,
        num_key_value_heads=int(tc.get("num_key_value_heads") or nh),
        head_dim=int(tc.get("head_dim") or H // nh),
        intermediate_size=int(tc["intermediate_size"]),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope=_rope(tc),
        max_position_embeddings=int(tc.get("max_position_embeddings", 4096)),
        sliding_window=int(tc["sliding_window"]) if sliding and tc.get("sliding_window") else None,
        aux_layer_ids=tuple(int(i) for i in ids) if ids is not None else (),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=norm_output,
        qk_norm=str(tc.get("model_type", "")).startswith("qwen3"),
        verifier_architectures=v_arch,
        verifier_name=v_name,
    )


def default_aux_layer_ids(n_layers: int) -> tuple[int, int, int]:
    """speculators' / SGLang's default: ``[2, n // 2, n - 3]``."""
    return (2, n_layers // 2, n_layers - 3)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` from the headers of a folder's ``*.safetensors`` (no tensor is read)."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, struct.error, ValueError) as exc:
            raise IncompatibleDrafter(f"{f}: cannot read the safetensors header ({exc}); the file is corrupt, re-download it") from None
        out.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return out


def check_compatible(target_config: dict, drafter_config: dict, drafter_path=None) -> Eagle3Config:
    """Raise :class:`IncompatibleDrafter` naming the first mismatch (configs
    and safetensors header only); return the parsed config with its aux
    layer ids resolved (the defaults for the target's depth when absent)."""
    from ..base import target_class

    cfg = parse(drafter_config)
    tc = target_class(target_config).text_config(target_config)
    n = int(tc["num_hidden_layers"])
    hint = "use an EAGLE-3 drafter trained for this target (or train one: mtpflow train --kind eagle3)"
    if cfg.target_hidden_size != tc["hidden_size"]:
        raise IncompatibleDrafter(
            f"EAGLE-3 drafter does not fit target: target_hidden_size is {cfg.target_hidden_size} in the drafter "
            f"but hidden_size is {tc['hidden_size']} in the target; {hint}"
        )
    tv = tc.get("vocab_size") or target_config.get("vocab_size")
    if cfg.vocab_size != tv:
        raise IncompatibleDrafter(
            f"EAGLE-3 drafter does not fit target: vocab_size is {cfg.vocab_size} in the drafter but {tv} in the target; {hint}"
        )
    ids = cfg.aux_layer_ids or default_aux_layer_ids(n)
    bad = [i for i in ids if not 0 <= i <= n]
    if bad:
        raise IncompatibleDrafter(
            f"EAGLE-3 drafter reads target layer {bad[0]} but the target has {n} layers (ids 0..{n}); {hint}"
        )
    t_arch = set(target_config.get("architectures") or ())
    if cfg.verifier_architectures and t_arch and not t_arch & set(cfg.verifier_architectures):
        name = f" ({cfg.verifier_name})" if cfg.verifier_name else ""
        raise IncompatibleDrafter(
            f"EAGLE-3 drafter was trained for a {'/'.join(cfg.verifier_architectures)} verifier{name}, "
            f"the target is {'/'.join(sorted(t_arch))}; {hint}"
        )
    if drafter_path is not None:
        shapes = safetensors_shapes(Path(drafter_path))
        want = {
            "d2t": (cfg.draft_vocab_size,),
            "lm_head.weight": (cfg.draft_vocab_size, cfg.hidden_size),
            "fc.weight": (cfg.hidden_size, len(ids) * cfg.target_hidden_size),
        }
        for name, shape in want.items():
            got = shapes.get(name)
            if got is None and name == "d2t" and cfg.draft_vocab_size == cfg.vocab_size:
                continue  # a full-vocabulary head needs no mapping
            if got is None:
                raise IncompatibleDrafter(f"{drafter_path}: EAGLE-3 checkpoint has no {name}; the checkpoint is incomplete")
            if tuple(got) != shape:
                raise IncompatibleDrafter(
                    f"{drafter_path}: EAGLE-3 tensor {name} has shape {list(got)}, expected {list(shape)} "
                    f"(draft_vocab_size {cfg.draft_vocab_size}, hidden_size {cfg.hidden_size}, {len(ids)} aux layers); "
                    "the checkpoint does not match its config.json"
                )
    return attrs.evolve(cfg, aux_layer_ids=tuple(ids))

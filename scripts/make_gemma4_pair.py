"""A random Gemma 4 target and assistant drafter of any size, in the Hugging Face layout
mtpflow and mlx-vlm read, scaled from the fixture pair ``tests/fixtures/hf_gemma4/pair_e``
(an E2B/E4B-style target: per-layer inputs, KV-shared layers; an assistant with the centroid
head).  For measuring speed on a machine without a model hub: the weights are random.

    python scripts/make_gemma4_pair.py OUT [--hidden 768] [--layers 12] [--vocab 16384] \
        [--window 512] [--dtype bfloat16] [--seed 0] [--accepting]

Writes OUT/target (a ``gemma4`` checkpoint: the text model plus the multimodal fixture's tiny
vision tower, so mlx-vlm loads it as well as mtpflow) and OUT/drafter.  The residual branches (``o_proj``, ``down_proj``) are scaled up so
greedy text varies instead of repeating one token (tests/fixtures notes).

``--accepting`` builds a drafter whose drafts the target accepts, so a speculative run emits more
than one token per round: a random target of this kind settles into repeating a token, and this
assistant drafts its input token again (a copy).  Its pre-projection keeps a random projection
``P`` of the token's embedding (none of the target hidden state), its attention and MLP branches
add nothing (``o_proj`` and ``down_proj`` are zero, every other weight random, so each step costs
what a real assistant's does), and its tied dense head is ``E P^T`` (``E``: the target's
embedding), whose argmax at ``P e`` is the token itself.  Its acceptance is what the target's
repetition allows: measure it (``mtpflow bench`` reports tau).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIR_E = ROOT / "tests" / "fixtures" / "hf_gemma4" / "pair_e"
#: the tiny vision tower, tokenizer and processor files of the multimodal fixture: with them the
#: target is a ``gemma4`` (Gemma4ForConditionalGeneration) checkpoint, which mlx-vlm loads too
VISION = ROOT / "tests" / "fixtures" / "gemma4_vision"
VISION_FILES = ("generation_config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja")


def target_config(hidden: int, layers: int, vocab: int, window: int, dtype: str) -> dict:
    cfg = json.loads((PAIR_E / "target" / "config.json").read_text())
    heads = max(hidden // 128, 1)
    types = ["full_attention" if (i + 1) % 3 == 0 or i == layers - 1 else "sliding_attention" for i in range(layers)]
    cfg.update(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, layer_types=types,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=128, global_head_dim=256,
        hidden_size_per_layer_input=64, vocab_size=vocab, vocab_size_per_layer_input=vocab,
        # the shared layers read the last full and sliding layers before them
        num_kv_shared_layers=max(0, min(layers // 3, layers - 1 - types.index("full_attention"))), sliding_window=window, max_position_embeddings=8192, dtype=dtype,
    )
    return cfg


def drafter_config(tcfg: dict, dtype: str) -> dict:
    cfg = json.loads((PAIR_E / "drafter" / "config.json").read_text())
    tc = cfg["text_config"]
    h = max(tcfg["hidden_size"] // 3, 128)
    tc.update(
        hidden_size=h, intermediate_size=4 * h, num_attention_heads=tcfg["num_attention_heads"],
        head_dim=tcfg["head_dim"], global_head_dim=tcfg["global_head_dim"], vocab_size=tcfg["vocab_size"],
        sliding_window=tcfg["sliding_window"], max_position_embeddings=tcfg["max_position_embeddings"], dtype=dtype,
    )
    cfg.update(backbone_hidden_size=tcfg["hidden_size"], dtype=dtype)
    return cfg


def _weights(model, dtype: str, scale: float) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    w = {}
    for k, v in tree_flatten(model.parameters()):
        if scale != 1 and k.endswith(("o_proj.weight", "down_proj.weight")):
            v = v * scale
        w[k] = v.astype(getattr(mx, dtype)) if mx.issubdtype(v.dtype, mx.floating) else v
    return w


def _save(w: dict, out: Path, cfg: dict, src: Path, files) -> None:
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for f in files:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)


def multimodal(text_cfg: dict, text_w: dict, dtype: str) -> tuple[dict, dict]:
    """The target as a ``gemma4`` checkpoint: the text model under ``model.language_model.``,
    the fixture's tiny vision tower, and a random projection into the text hidden size."""
    import mlx.core as mx

    cfg = json.loads((VISION / "config.json").read_text())
    tc = {k: v for k, v in text_cfg.items() if k not in ("architectures", "transformers_version")}
    cfg.update(text_config=tc, dtype=dtype)
    w = {"model.language_model." + k[len("model."):]: v for k, v in text_w.items() if k.startswith("model.")}
    dt = getattr(mx, dtype)
    for k, v in mx.load(str(VISION / "vision.safetensors")).items():
        if k == "model.embed_vision.embedding_projection.weight":
            v = mx.random.normal((text_cfg["hidden_size"], v.shape[1])) * 0.02
        w[k] = v.astype(dt)
    return cfg, w


def copy_drafter_weights(w: dict, target_embed, dtype: str) -> dict:
    """The assistant's weights ``w`` made into a copy drafter (see the module docstring)."""
    import mlx.core as mx

    D, two_dt = w["pre_projection.weight"].shape
    dt = two_dt // 2
    P = mx.random.normal((D, dt)) / dt**0.5
    out = dict(w)
    out["pre_projection.weight"] = mx.concatenate([P, mx.zeros((D, dt))], axis=1)
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            out[k] = mx.zeros_like(w[k])
    out["model.embed_tokens.weight"] = target_embed.astype(mx.float32) @ P.T
    dt_ = getattr(mx, dtype)
    return {k: v.astype(dt_) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in out.items()}


def build(out, hidden=768, layers=12, vocab=16384, window=512, dtype="bfloat16", seed=0,
          accepting: bool = False) -> tuple[Path, Path]:
    import mlx.core as mx
    from mlx_lm.models import gemma4_text

    from mtpflow.drafters.gemma4_assistant.config import check_compatible
    from mtpflow.drafters.gemma4_assistant.model import Gemma4AssistantModel

    out = Path(out)
    mx.random.seed(seed)
    tcfg = target_config(hidden, layers, vocab, window, dtype)
    target = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(tcfg))
    mcfg, mw = multimodal(tcfg, _weights(target, dtype, 4.0), dtype)
    _save(mw, out / "target", mcfg, VISION, VISION_FILES)
    dcfg = drafter_config(tcfg, dtype)
    if accepting:  # a tied dense head (the centroid head's clusters would not follow the copy)
        dcfg["use_ordered_embeddings"] = False
    acfg = check_compatible(tcfg, dcfg)
    from mtpflow.plugins import get_plugins

    drafter = Gemma4AssistantModel(acfg, get_plugins().lm_heads.get(acfg.head_kind))
    dw = _weights(drafter, dtype, 1.0)
    if accepting:
        dw = copy_drafter_weights(dw, mw["model.language_model.embed_tokens.weight"], dtype)
    _save(dw, out / "drafter", dcfg, PAIR_E / "drafter",
          ("tokenizer.json", "tokenizer_config.json", "generation_config.json"))
    return out / "target", out / "drafter"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accepting", action="store_true", help="a copy drafter whose drafts the target accepts")
    a = p.parse_args(argv)
    t, d = build(a.out, a.hidden, a.layers, a.vocab, a.window, a.dtype, a.seed, a.accepting)
    print(t, d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

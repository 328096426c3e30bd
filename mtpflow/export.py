"""``mtpflow export``: write a drafter in a format other servers load.

``mtpflow export --format speculators --target T DRAFTER OUT`` writes an
EAGLE-3 drafter that mtpflow loads (a Speculators checkpoint, a SpecForge /
SGLang export, or one trained with ``mtpflow train --kind eagle3``) as a
Speculators checkpoint: what vLLM serves (``--speculative-config
'{"method": "eagle3", "model": "OUT"}'``) and SGLang loads.  Use it to serve a
drafter trained on one machine with vLLM or SGLang when one machine is no
longer enough.
"""

from __future__ import annotations

import argparse


class ExportError(ValueError):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", help="drafter folder or packaged name (required)")
    p.add_argument("out", help="output folder (required)")
    p.add_argument("--format", choices=["speculators"], default="speculators", help="checkpoint format to write")
    p.add_argument("--target", required=True, help="the drafter's target: folder, repo id or packaged name (required)")
    p.add_argument("--verifier-name", help="verifier name_or_path to record, e.g. the target's Hub id (default: none)")
    p.add_argument("--speculative-tokens", type=int, default=3, help="drafts per round the checkpoint recommends")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="dtype of the written weights (default: as loaded, float32)")


def export(drafter: str, out: str, target: str, fmt: str = "speculators", verifier_name: str | None = None,
           speculative_tokens: int = 3, dtype: str | None = None):
    from .config import load_config
    from .engine import load_session

    session = load_session(load_config(overrides={"model": {"model": target, "draft_model": drafter}}))
    if session.draft_kind != "eagle3":
        raise ExportError(f"{drafter} is a {session.draft_kind!r} drafter; --format speculators exports eagle3 drafters")
    from .drafters.eagle3.export import save_speculators

    import attrs

    d = session.drafter
    cfg = d.cfg
    if not cfg.verifier_architectures:  # e.g. a SpecForge export: record the target it was loaded with
        cfg = attrs.evolve(cfg, verifier_architectures=tuple(session.target.config.get("architectures") or ()))
    embed = None if "embed_tokens" in d.model else session.target.inner.embed_tokens.weight
    return save_speculators(d.model, cfg, out, embed=embed, verifier_name=verifier_name,
                            speculative_tokens=speculative_tokens, dtype=dtype)


def run(args) -> int:
    path = export(args.drafter, args.out, args.target, args.format, args.verifier_name, args.speculative_tokens, args.dtype)
    print(f"wrote {path}")
    return 0

"""``mtpflow export``: write a drafter in a format other servers load.

Each drafter kind that exports keeps its exporter in its own folder: a module
``export`` next to its drafter (``mtpflow/drafters/<kind>/export.py``) with
``FORMATS`` (the formats it writes, the first is the default) and
``export_drafter(session, out, fmt, *, verifier_name, speculative_tokens,
dtype) -> Path``.  This command loads the drafter with its target and hands
it to that exporter; it never asks which kind it is.

* EAGLE-3 (a Speculators checkpoint, a SpecForge / SGLang export, or one
  trained with ``mtpflow train --kind eagle3``) -> ``--format speculators``:
  what vLLM serves (``--speculative-config '{"method": "eagle3", "model":
  "OUT"}'``) and SGLang loads.
* A native MTP head (a target checkpoint's own, or one trained with
  ``mtpflow train --kind mtp``) -> ``--format native``: the family's native
  layout (``model.layers.{N+i}.*`` next to the target's config with
  ``num_nextn_predict_layers``), what the native-MTP kind loads with
  ``--draft-model`` and what vLLM's / SGLang's MTP methods read.

Use it to serve a drafter trained on one machine with vLLM or SGLang when one
machine is no longer enough.
"""

from __future__ import annotations

import argparse
import importlib


class ExportError(ValueError):
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", help="drafter folder or packaged name (required)")
    p.add_argument("out", help="output folder (required)")
    p.add_argument("--format", choices=["speculators", "native"], default=None,
                   help="checkpoint format to write (default: the drafter kind's own: speculators for eagle3, native for MTP heads)")
    p.add_argument("--target", required=True, help="the drafter's target: folder, repo id or packaged name (required)")
    p.add_argument("--verifier-name", help="verifier name_or_path to record, e.g. the target's Hub id (default: none)")
    p.add_argument("--speculative-tokens", type=int, default=3, help="drafts per round the checkpoint recommends")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="dtype of the written weights (default: as loaded, float32)")


def exporter_for(drafter):
    """The ``export`` module of a loaded drafter's kind (``None``: it exports nothing)."""
    pkg = type(drafter).__module__.rpartition(".")[0]
    try:
        return importlib.import_module(pkg + ".export")
    except ModuleNotFoundError:
        return None


def export(drafter: str, out: str, target: str, fmt: str | None = None, verifier_name: str | None = None,
           speculative_tokens: int = 3, dtype: str | None = None):
    from .config import load_config
    from .session import load_session

    session = load_session(load_config(overrides={"model": {"model": target, "draft_model": drafter}}))
    mod = exporter_for(session.drafter)
    formats = tuple(getattr(mod, "FORMATS", ()))
    if not formats:
        raise ExportError(f"{drafter} is a {session.draft_kind!r} drafter, which has no export format; "
                          "mtpflow exports eagle3 drafters (speculators) and MTP heads (native)")
    fmt = fmt or formats[0]
    if fmt not in formats:
        raise ExportError(f"{drafter} is a {session.draft_kind!r} drafter; it exports as {', '.join(formats)} "
                          f"(--format {formats[0]}), not {fmt}")
    return mod.export_drafter(session, out, fmt, verifier_name=verifier_name, speculative_tokens=speculative_tokens,
                              dtype=dtype)


def run(args) -> int:
    path = export(args.drafter, args.out, args.target, args.format, args.verifier_name, args.speculative_tokens, args.dtype)
    print(f"wrote {path}")
    return 0

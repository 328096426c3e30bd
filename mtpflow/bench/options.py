"""``mtpflow bench``'s command line: its arguments, the presets and the run's config."""

from __future__ import annotations

import argparse

#: ``--preset NAME``: argument values a preset sets where the command line leaves the default
PRESETS = {
    "device": {
        "block_sizes": [2, 3, 5], "batch_sizes": [1, 4], "trees": "auto", "repeats": 2, "warmup": 1,
        "max_tokens": 48, "num_prompts": 4, "no_default": True, "no_plots": True, "verify_cost": True,
    },
}


class BenchError(ValueError):
    """A bad bench argument or a missing prompt set (the message says what to do)."""


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", "--model", dest="target",
                   help="target: model folder, Hugging Face repo id, or a packaged GGUF name "
                        "(smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b, ...); default: the built-in pair (smollm2-135m + its shipped drafter)")
    p.add_argument("--draft-model", help="drafter checkpoint (folder or repo id); default: none, or the built-in drafter with no --target")
    p.add_argument("--draft-kind", help="drafter kind; required for model-free kinds such as ngram (default: detected from the drafter's config.json)")
    p.add_argument("--prompts", default="tiny", help="prompt set: tiny, mtbench, humaneval, or a .txt (one prompt a line) / .jsonl file")
    p.add_argument("--num-prompts", type=int, help="use the first N prompts of the set (default: all)")
    p.add_argument("--block-sizes", type=_int_list, default=[1, 2, 4, 6], help="comma-separated block sizes (drafts + 1)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 4], help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up passes per variant (default 1)")
    p.add_argument("--max-tokens", "-m", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--out", default="bench-out", help="output folder (bench.json, *.png)")
    p.add_argument("--policy", choices=["fixed", "adaptive"], default="fixed",
                   help="block policy; with adaptive each block size K is the largest size the policy may pick")
    p.add_argument("--mlx-lm-draft-model", help="also run mlx-lm's own speculative decoding with this draft model (folder, repo id or packaged GGUF name; default: none)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="weights dtype (auto: the checkpoint's own on a GPU, float32 on a CPU)")
    p.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                   help="apply the target's chat template: auto = for chat sets (mtbench) when the tokenizer has one")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: ignore EOS so all variants emit max_tokens)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0,
                   help="sampling temperature for every variant (default 0: greedy); mlx-lm samples with its make_sampler")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, with --temperature > 0 (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k filter, with --temperature > 0 (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter, with --temperature > 0 (default 0: off)")
    p.add_argument("--seed", type=int, help="sampling seed (mtpflow rows and mlx-lm's generator; default: unseeded)")
    p.add_argument("--submit-layers", choices=("auto", "on", "off"), default="auto",
                   help="mtpflow's verify (and a draft model) starts each layer as it is built ([generation] submit_layers; auto: on a CPU device)")
    p.add_argument("--fuse-ops", choices=("auto", "on", "off"), default="auto",
                   help="mtpflow builds RMSNorm, RoPE and linear layers with fewer graph nodes ([generation] fuse_ops; "
                        "auto: on a CPU device); the mlx_lm rows always run mlx-lm's own modules")
    p.add_argument("--sync-timing", action="store_true",
                   help="synchronise after drafting so draft/verify times split exactly (one extra sync per round)")
    p.add_argument("--no-baseline", action="store_true", help="skip the mlx-lm target-only baseline")
    p.add_argument("--no-null", action="store_true", help="skip the mtpflow null-drafter variant")
    p.add_argument("--trees", default="",
                   help="also run these draft trees, ';'-separated shapes such as '4,2,1;dynamic:4:6:3' (default: none)")
    p.add_argument("--no-default", action="store_true",
                   help="skip the default variant (the adaptive policy from the drafter's recommended block size, as `mtpflow generate` runs it)")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="device: a few-minute accelerator run (null path and mlx-lm, chains at block sizes 2, 3, 5, "
                        "one tree, batches 1 and 4, each shape warmed once, plus the verify-cost curve); flags given "
                        "explicitly win over the preset (default: none, every flag as given)")


def apply_preset(args) -> argparse.Namespace:
    """``args`` with ``--preset``'s values wherever the command line left a default."""
    preset = PRESETS.get(getattr(args, "preset", None) or "", {})
    if not preset:
        return args
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    out = argparse.Namespace(**vars(args))
    for k, v in preset.items():
        if getattr(args, k, None) == p.get_default(k):
            setattr(out, k, v)
    return out


def resolve_model_path(name: str, dtype: str = "float32") -> str:
    """A packaged GGUF name (``smollm2-135m``) -> its converted mlx-lm folder
    (:func:`mtpflow.resolve.resolve_model`); else unchanged."""
    from ..convert.gguf import PACKAGED_GGUFS
    from ..resolve import resolve_model

    return str(resolve_model(name, dtype)) if name in PACKAGED_GGUFS else name


def _config(args):
    from ..config import load_config

    gguf_dtype = "float32" if args.dtype == "auto" else args.dtype  # a packaged GGUF converts to float32 unless told
    target = resolve_model_path(args.target, gguf_dtype) if args.target else None
    draft = resolve_model_path(args.draft_model, gguf_dtype) if args.draft_model else None
    if target is None and draft is None and args.draft_kind is None:
        from ..resolve import default_model_paths

        t, d = default_model_paths()
        target, draft = str(t), str(d)
    return load_config(overrides={
        "model": {"model": target, "draft_model": draft, "draft_kind": args.draft_kind, "dtype": args.dtype},
        "draft": {"block_size": max(args.block_sizes), "policy": args.policy},
        "batch": {"max_batch_size": max(args.batch_sizes)},
        "generation": {"max_tokens": args.max_tokens, "submit_layers": args.submit_layers,
                       "fuse_ops": args.fuse_ops},
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                     "min_p": args.min_p, "seed": args.seed},
    })

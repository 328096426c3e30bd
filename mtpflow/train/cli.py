"""``mtpflow train``'s command line: its arguments and the run."""

from __future__ import annotations

import json
import sys

from .config import TrainConfig


class TrainableKinds:
    """The ``--kind`` choices: the ``train_kind`` names of the registered drafter
    kinds (:class:`mtpflow.api.TrainableDrafter`), looked up only when a
    ``--kind`` is checked or the help is shown."""

    def _names(self) -> list[str]:
        from .run import trainable_kinds

        return sorted(trainable_kinds())

    def __contains__(self, kind) -> bool:
        return kind in self._names()

    def __iter__(self):
        return iter(self._names())


def add_train_arguments(p) -> None:
    """``mtpflow train --target T --drafter-config C --data SPEC --out DIR``."""
    p.add_argument("--target", required=True, help="target model folder, Hugging Face repo id or packaged name (required)")
    p.add_argument("--drafter-config", help="drafter config: a JSON file (full config, or make_config options such as "
                   '{"num_hidden_layers": 2, "draft_vocab_size": 8192}) or inline JSON; default: 2 layers at the target width')
    p.add_argument("--data", required=True, help="data spec: sharegpt[:N], FILE.jsonl[:N], FILE.json, FILE.txt, DIR, selfgen:N[:L]; comma-separated; "
                   "or distill:PROMPTS (distill:sharegpt:N): the target answers the prompts greedily and its features are cached in OUT/features; "
                   "or cache:SPEC (cache:sharegpt:N): the data's own answers, the target's features cached once in OUT/features-cache; "
                   "distill: and cache: combine (distill:sharegpt:4000,cache:sharegpt:3000) (required)")
    p.add_argument("--out", required=True, help="output drafter folder (resumes from OUT/checkpoint) (required)")
    d = TrainConfig()
    helps = {
        "steps": "optimizer steps", "batch_size": "sequences per step (the global batch: under mlx.launch each of R ranks takes batch/R)", "max_len": "tokens per sequence (longer ones are cut)",
        "unroll": "drafting steps unrolled per position (as at inference)", "checkpoint_every": "steps between checkpoints",
        "seed": "random seed", "lr": "peak learning rate (AdamW)", "weight_decay": "AdamW weight decay",
        "grad_clip": "gradient norm clip", "decay": "geometric weight of unrolled step i: decay**i",
        "min_lr_ratio": "cosine schedule floor, as a fraction of --lr",
    }
    for name in ("steps", "batch_size", "max_len", "unroll", "checkpoint_every", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=helps[name])
    for name in ("lr", "weight_decay", "grad_clip", "decay", "min_lr_ratio"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name), help=helps[name])
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    p.add_argument("--init", choices=["identity", "random"], default=d.init,
                   help="drafter initialisation (identity: h' starts as the target's hidden state)")
    p.add_argument("--init-from", default=None,
                   help="warm start from a trained drafter folder or packaged drafter name (its config, weights and draft "
                        "vocabulary; fresh optimiser and schedule), e.g. to continue training on more data (default: none, a fresh drafter)")
    p.add_argument("--vocab-data", default=None,
                   help="data spec whose tokens also rank the draft vocabulary (e.g. sharegpt:6000); needs draft_vocab_size (default: none, the training data alone)")
    p.add_argument("--step-weights", choices=["geometric", "position"], default=d.step_weights,
                   help="loss weight per unrolled step: geometric (--decay) or position (dE[tau]/da_i)")
    p.add_argument("--targets", choices=["soft", "hard"], default=d.targets,
                   help="labels: soft = the target's distribution (KL), hard = its argmax")
    p.add_argument("--max-time", type=float, default=None, help="stop after this many seconds (checkpointed; rerun to resume) (default: no limit)")
    p.add_argument("--distill-tokens", type=int, default=d.distill_tokens,
                   help="distill: data: tokens the target generates per prompt (greedy)")
    p.add_argument("--distill-batch", type=int, default=d.distill_batch, help="distill: data: prompts per generation batch")
    p.add_argument("--distill-time", type=float, default=None,
                   help="distill: data: stop collecting after this many seconds and train on what was collected (rerun to add more) (default: no limit)")
    p.add_argument("--cache-batch", type=int, default=d.cache_batch, help="cache: data: rows per target forward")
    p.add_argument("--cache-time", type=float, default=None,
                   help="cache: data: stop collecting features after this many seconds and train on what was collected (rerun to add more) (default: no limit)")
    p.add_argument("--save-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="dtype of the saved drafter weights (default: as trained, float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--kind", choices=TrainableKinds(), default="assistant",
                   help="drafter kind: assistant (mtpflow's KV-sharing MTP drafter), eagle3 (written as a Speculators "
                        "checkpoint), dflash (written in z-lab's format), mtp (a DeepSeek-style MTP module in the native layout); --drafter-config takes the kind's options, "
                        'e.g. {"draft_vocab_size": 8192} (eagle3) or {"block_size": 16, "num_hidden_layers": 2} (dflash)')
    p.add_argument("--anchors", type=int, default=8, help="dflash: blocks per sequence per step")
    p.add_argument("--schedule", choices=["cosine", "linear"], default=d.schedule,
                   help="learning rate after the warm-up: cosine to --min-lr-ratio, or linear to 0 (Speculators' default)")
    p.add_argument("--dpace-alpha", type=float, default=d.dpace_alpha,
                   help="dflash with --step-weights position (D-PACE): confidence smoothing constant in (0, 1]")
    p.add_argument("--target-bits", type=int, choices=[4, 8], default=None,
                   help="quantize the frozen target to 4 or 8 bits as it loads (mlx affine quantization): the drafter "
                        "trains on the quantized model's features, in a fraction of the memory (default: as loaded)")
    p.add_argument("--optimizer", choices=["adamw", "adafactor"], default=d.optimizer,
                   help="adamw, or adafactor (factored second moments: a much smaller optimizer state)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="micro-batches per optimizer step (same gradient, batch/N rows of activations at a time)")
    p.add_argument("--lanes", type=int, default=d.lanes,
                   help="parts of each micro-batch evaluated side by side on a CPU, one per core (0: the device's "
                        "default, one per core on a CPU and 1 on a GPU, and 1 with --grad-checkpoint or --chunked-update; "
                        "1: off)")
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute the drafter layers' activations in the backward pass instead of keeping them")
    p.add_argument("--chunked-update", action="store_true",
                   help="apply the optimizer update one parameter array at a time (a lower peak memory: the old and "
                        "new optimizer state of one array at a time, not of the whole drafter)")
    p.add_argument("--cache-dir", default=None,
                   help="cache: data: the features folder (default: OUT/features-cache); kinds trained on the same data "
                        "share one, each reading the target layers it needs")
    p.add_argument("--cache-taps", default="",
                   help="cache: data: more target layer ids to collect (comma-separated) so other kinds can train from "
                        "the same --cache-dir (default: only the kind's own)")
    p.add_argument("--tap-cache-mb", type=float, default=0.0,
                   help="eagle3 / dflash: keep the target's hidden states and layer taps of up to this many MiB of "
                        "examples in memory, so later epochs skip the target forward (default: 0, off)")


def run_train(args) -> int:
    from .optimize import TrainingInterrupted
    from .parallel import world
    from .run import train

    dc = args.drafter_config  # inline JSON or a file: checked by train() before anything loads
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, max_len=args.max_len, lr=args.lr, warmup=args.warmup,
        min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip, unroll=args.unroll,
        step_weights=args.step_weights, decay=args.decay, targets=args.targets, seed=args.seed,
        checkpoint_every=args.checkpoint_every, max_time_s=args.max_time, save_dtype=args.save_dtype,
        progress=not args.no_progress, distill_tokens=args.distill_tokens, distill_batch=args.distill_batch,
        distill_time_s=args.distill_time, cache_batch=args.cache_batch, cache_time_s=args.cache_time, init=args.init, vocab_data=args.vocab_data, init_from=args.init_from,
        kind=args.kind, anchors=args.anchors, tap_cache_mb=args.tap_cache_mb, cache_dir=args.cache_dir,
        schedule=args.schedule, dpace_alpha=args.dpace_alpha, target_bits=args.target_bits, optimizer=args.optimizer,
        grad_accum=args.grad_accum, lanes=args.lanes, grad_checkpoint=args.grad_checkpoint,
        chunked_update=args.chunked_update,
        cache_taps=tuple(int(t) for t in args.cache_taps.split(",") if t.strip()),
    )
    try:
        summary = train(args.target, dc, args.data, args.out, config=cfg)
    except TrainingInterrupted as stop:
        if world().main:
            print(f"mtpflow: interrupted by {stop}", file=sys.stderr)
        return 128 + stop.signum
    if world().main:  # (under mlx.launch every rank runs this; one line is enough)
        print(json.dumps({k: summary[k] for k in ("steps", "tokens_seen", "elapsed_s", "examples")} | {"out": str(args.out)}))
    return 0


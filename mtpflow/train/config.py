"""The settings of a training run (:class:`TrainConfig`), the same for every drafter kind."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    max_len: int = 512
    lr: float = 5e-4
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    unroll: int = 3
    step_weights: str = "geometric"  # or "position"
    decay: float = 0.8
    targets: str = "soft"  # or "hard"
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    max_time_s: float | None = None
    #: stop (checkpointed) after this step without changing the schedule; resume later
    stop_at: int | None = None
    save_dtype: str | None = None
    progress: bool = True
    ema: float = 0.9
    #: ``distill:`` data: tokens the target generates per prompt, rows per batch, time limit
    distill_tokens: int = 128
    distill_batch: int = 32
    distill_time_s: float | None = None
    #: ``cache:`` data: rows per teacher-forced target forward, time limit of the feature collection
    cache_batch: int = 8
    cache_time_s: float | None = None
    #: drafter initialisation: "identity" (h' starts as the target's hidden state) or "random"
    init: str = "identity"
    #: a data spec whose tokens also rank the draft vocabulary (``draft_vocab_size``)
    vocab_data: str | None = None
    #: warm start: a trained drafter folder (or packaged drafter name) whose config, weights and
    #: draft vocabulary the run starts from (a fresh optimiser and schedule); replaces ``init``
    init_from: str | None = None
    #: drafter kind: the ``train_kind`` of a registered :class:`mtpflow.api.TrainableDrafter`
    #: ("assistant", mtpflow's KV-sharing MTP drafter, "eagle3", "dflash", "mtp"); checked, with the
    #: kind's own rules, when :func:`mtpflow.train.run.train` resolves its trainer
    kind: str = "assistant"
    #: dflash: anchor positions (blocks) per sequence and step
    anchors: int = 8
    #: eagle3 / dflash: keep the target's states of up to this many MiB of examples in
    #: memory, so a batch of kept examples skips the target forward (0 = off)
    tap_cache_mb: float = 0.0
    #: learning-rate schedule after the warm-up: "cosine" (to ``min_lr_ratio``) or "linear"
    #: (to 0, Hugging Face's get_linear_schedule_with_warmup, Speculators' default)
    schedule: str = "cosine"
    #: dflash D-PACE: confidence smoothing ``(1 - a) * exp(-loss) + a`` (Speculators' dpace_alpha)
    dpace_alpha: float = 0.5
    #: memory budget (mtpflow.train.memory): "adamw" or "adafactor" (factored second moments)
    optimizer: str = "adamw"
    #: micro-batches per optimizer step (the gradient of the whole batch, in batch/N rows at a time)
    grad_accum: int = 1
    #: parts of each micro-batch evaluated side by side, one per CPU core (mtpflow.train.lanes);
    #: 0 = the device's default (one per core on a CPU, 1 on a GPU; 1 with grad_checkpoint or
    #: chunked_update, a memory budget), 1 = off
    lanes: int = 0
    #: recompute the drafter layers' activations in the backward pass (mx.checkpoint)
    grad_checkpoint: bool = False
    #: apply the optimizer update one parameter array at a time, each evaluated before the next
    #: (the peak holds one array's new weights and optimizer state, not the whole drafter's)
    chunked_update: bool = False
    #: quantize the frozen target to 4 or 8 bits before training (None: as loaded)
    target_bits: int | None = None
    #: ``cache:`` data: the features folder (default ``OUT/features-cache``); kinds trained on the
    #: same data share one (each reads the layers it needs)
    cache_dir: str | None = None
    #: ``cache:`` data: target layers collected besides the kind's own, so that other kinds can
    #: train from the same ``cache_dir`` (e.g. EAGLE-3's and DFlash's layers together)
    cache_taps: tuple = ()

    def __post_init__(self):
        if self.step_weights not in ("geometric", "position"):
            raise ValueError(f"step_weights must be 'geometric' or 'position' (got {self.step_weights!r})")
        if self.targets not in ("soft", "hard"):
            raise ValueError(f"targets must be 'soft' or 'hard' (got {self.targets!r})")
        if self.unroll < 1:
            raise ValueError("unroll must be >= 1")
        if self.init not in ("identity", "random"):
            raise ValueError(f"init must be 'identity' or 'random' (got {self.init!r})")
        if self.tap_cache_mb < 0:
            raise ValueError(f"tap_cache_mb must be >= 0 (got {self.tap_cache_mb})")
        if self.lanes < 0:
            raise ValueError(f"lanes must be >= 0 (0: the device's default, 1: off); got {self.lanes}")
        from .memory import check_config

        check_config(self)


"""Former home of the EAGLE-3 and DFlash trainers; they live in their drafters' folders now
(:mod:`mtpflow.drafters.eagle3.train`, :mod:`mtpflow.drafters.dflash.train`), the shared pieces in
:mod:`mtpflow.train.target` and :mod:`mtpflow.train.objective`.  Kept for code that imports them
from here; nothing inside mtpflow does."""

from ..drafters.dflash.train import (  # noqa: F401
    DFlashTrainer,
    dflash_block_logits,
    dflash_loss_terms,
    dpace_weights,
    geometric_decay,
)
from ..drafters.eagle3.train import Eagle3Trainer, eagle3_loss_terms, ttt_logits  # noqa: F401
from .objective import step_terms  # noqa: F401
from .run import tap_layers  # noqa: F401
from .target import TargetStates, target_states  # noqa: F401

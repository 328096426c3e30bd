"""Former home of the training entry point and the assistant kind's objective; the names live on
in :mod:`mtpflow.train.run` (``train``), :mod:`mtpflow.train.optimize`, :mod:`mtpflow.train.config`,
:mod:`mtpflow.train.cli`, :mod:`mtpflow.train.objective` and
:mod:`mtpflow.drafters.mtpflow_assistant.train`.  Kept for code that imports them from here;
nothing inside mtpflow does."""

from ..drafters.mtpflow_assistant.train import (  # noqa: F401
    drafter_loss,
    drafter_loss_terms,
    identity_init,
    label_targets,
    resolve_drafter_config,
    target_pass,
    train_masks,
    unrolled_logp,
)
from .checkpoint import CheckpointError, load_checkpoint, repair_log, save_checkpoint  # noqa: F401
from .cli import add_train_arguments, run_train  # noqa: F401
from .config import TrainConfig  # noqa: F401
from .objective import choose_draft_vocab, step_weights, weighted_loss  # noqa: F401
from .optimize import TrainingInterrupted, optimize  # noqa: F401
from .run import train  # noqa: F401
from .sources import training_data  # noqa: F401

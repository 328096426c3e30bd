"""Former home of the MTP kind's trainer; it lives in the native-MTP drafter's folder now
(:mod:`mtpflow.drafters.native_mtp.train`).  Kept for code that imports it from here; nothing
inside mtpflow does."""

from ..drafters.native_mtp.train import (  # noqa: F401
    MTPTrainer,
    gather_packed,
    mtp_loss_terms,
    mtp_outputs,
    native_config,
    new_head,
    pack,
    pack_plan,
    pair_mask,
    positions_at,
    save_native,
)

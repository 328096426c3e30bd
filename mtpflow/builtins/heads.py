"""Built-in drafter LM heads: the Gemma 4 assistants' tied dense and
centroid-routed sparse heads, and the generic assistant's target, draft-vocabulary
and own heads."""

from mtpflow import hookimpl


@hookimpl
def mtpflow_register_lm_heads(register):
    from mtpflow.drafters.gemma4_assistant.heads import CentroidHead, TiedDenseHead
    from mtpflow.drafters.mtpflow_assistant.heads import OwnHead, TargetHead, TargetSubsetHead

    register("tied_dense", TiedDenseHead)
    register("centroid", CentroidHead)
    register("target", TargetHead)
    register("target_subset", TargetSubsetHead)
    register("own", OwnHead)

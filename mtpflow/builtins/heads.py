"""Built-in drafter LM heads: tied dense and centroid-routed sparse."""

from mtpflow import hookimpl


@hookimpl
def mtpflow_register_lm_heads(register):
    from mtpflow.drafters.gemma4_assistant.heads import CentroidHead, TiedDenseHead

    register("tied_dense", TiedDenseHead)
    register("centroid", CentroidHead)

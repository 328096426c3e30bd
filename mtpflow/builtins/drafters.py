"""Built-in drafter kinds."""

from mtpflow import hookimpl


@hookimpl
def mtpflow_register_drafters(register):
    from mtpflow.drafters.gemma4_assistant.drafter import Gemma4AssistantDrafter

    register("mtp", Gemma4AssistantDrafter)

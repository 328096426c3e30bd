"""Built-in target adapters, by Hugging Face ``model_type``."""

from mtpflow import hookimpl


@hookimpl
def mtpflow_register_targets(register):
    from mtpflow.targets.gemma4 import Gemma4Target

    for model_type in Gemma4Target.model_types:
        register(model_type, Gemma4Target)

"""Built-in target adapters, by Hugging Face ``model_type``."""

from mtpflow import hookimpl


@hookimpl
def mtpflow_register_targets(register):
    from mtpflow.targets.gemma4 import Gemma4Target
    from mtpflow.targets.mlxlm import MLXLMTarget

    for cls in (Gemma4Target, MLXLMTarget):
        for model_type in cls.model_types:
            register(model_type, cls)

"""Built-in target adapters, by Hugging Face ``model_type``."""

from mtpflow import hookimpl


@hookimpl
def mtpflow_register_targets(register):
    from mtpflow.targets.gemma4 import Gemma4Target
    from mtpflow.targets.hybrid import Qwen3NextTarget, Qwen35Target
    from mtpflow.targets.mlxlm import Gemma3Target, MLXLMTarget, Qwen3Target
    from mtpflow.targets.nemotron_h import NemotronHTarget

    for cls in (Gemma4Target, MLXLMTarget, Qwen3Target, Gemma3Target, Qwen35Target, Qwen3NextTarget, NemotronHTarget):
        for model_type in cls.model_types:
            register(model_type, cls)

"""Built-in drafter kinds."""

from mtpflow import hookimpl


@hookimpl
def mtpflow_register_drafters(register):
    from mtpflow.drafters.gemma4_assistant.drafter import Gemma4AssistantDrafter

    register("mtp", Gemma4AssistantDrafter)

    from mtpflow.drafters.mtpflow_assistant.drafter import GenericAssistantDrafter

    register("assistant", GenericAssistantDrafter)

    from mtpflow.drafters.draft_model import DraftModelDrafter
    from mtpflow.drafters.ngram import NgramDrafter

    register("ngram", NgramDrafter)
    register("model", DraftModelDrafter)

    from mtpflow.drafters.dflash.drafter import DFlashDrafter
    from mtpflow.drafters.eagle3.drafter import Eagle3Drafter

    register("eagle3", Eagle3Drafter)
    register("dflash", DFlashDrafter)

    from mtpflow.drafters.native_mtp.drafter import NativeMTPDrafter

    register("native_mtp", NativeMTPDrafter)


@hookimpl
def mtpflow_register_targets(register):
    # targets whose checkpoints carry the native MTP heads the native_mtp kind runs
    from mtpflow.targets.deepseek import DeepseekTarget, DeepseekV32Target

    for cls in (DeepseekTarget, DeepseekV32Target):
        for model_type in cls.model_types:
            register(model_type, cls)

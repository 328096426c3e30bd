"""The Gemma 4 MTP assistant drafter (``gemma4_assistant``, ``gemma4_unified_assistant``).

Folder layout as an mlx-lm-style drafter family: :mod:`.config` (config
parsing and the target compatibility check), :mod:`.model` (the 4-layer
KV-less body), :mod:`.heads` (tied dense and centroid LM heads), :mod:`.masks`
(which target K/V slots a drafting step may see).
"""

MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")

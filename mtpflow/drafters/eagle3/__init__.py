"""EAGLE-3 drafters (vLLM Speculators format, SGLang/SpecForge layout).

:mod:`.config` (both formats into one :class:`.config.Eagle3Config`, and the
target compatibility check on the two config.json files and the safetensors
header), :mod:`.model` (the MLX body: fc over three target layers, one
decoder layer with a 2H input and its own KV cache, the draft LM head),
:mod:`.drafter` (the ``eagle3`` drafter kind), :mod:`.train` (its trainer,
``mtpflow train --kind eagle3``), :mod:`.export` (Speculators format).
"""

"""A generic KV-sharing MTP drafter (``model_type: mtpflow_assistant``).

The Gemma 4 assistant's structure (spec §4) for any target adapter: one
drafting step reads ``concat(target_embed(tok), h)``, projects it to the
drafter width, runs a few layers whose queries (all at the constant bonus
RoPE position) cross-attend to the target's store-layer K/V, and projects the
normed result back to the target width; that projection is the next ``h``.
Geometry (query/KV heads, head_dim, RoPE, attention scale) is the target's.

:mod:`.config` (config dict, target geometry, compatibility check),
:mod:`.model` (the body, with a training forward over all positions),
:mod:`.drafter` (the ``assistant`` drafter kind, save/load), :mod:`.train`
(its trainer, ``mtpflow train --kind assistant``).
"""

MODEL_TYPES = ("mtpflow_assistant",)

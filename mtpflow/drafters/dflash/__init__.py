"""DFlash block-diffusion drafters (z-lab's format, arXiv 2602.06036).

:mod:`.config` (the config and the target compatibility check), :mod:`.model`
(the MLX body: context features from several target layers projected once,
per-layer context K/V, a block of ``[last, mask, ...]`` drafted in one
forward), :mod:`.drafter` (the ``dflash`` drafter kind), :mod:`.train` (its
trainer, ``mtpflow train --kind dflash``).
"""

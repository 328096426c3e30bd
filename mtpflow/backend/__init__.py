"""What mtpflow does differently per device: the CPU's BLAS preload
(:mod:`.blas`), leaner model ops (:mod:`.fusion`), the per-device tuning
table (:mod:`.profiles`) and the dtype a run uses (:mod:`.dtypes`).

Importing this package imports nothing heavy: :mod:`.blas` must run before
``mlx`` is imported.
"""

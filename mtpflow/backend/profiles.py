"""Which tuning runs on which device: one row per device kind, each value with
the measurement (or the reason, where none exists yet) behind it.

A ``[generation]`` tuning set to ``"auto"`` (``submit_layers``, ``fuse_ops``)
takes its device's value from :data:`PROFILES`; ``"on"`` / ``"off"`` force it.
The BLAS preload (:mod:`mtpflow.backend.blas`) runs before ``mlx`` is
imported, so before the device is known: it is cheap and harmless where the
CPU backend does no matmuls, and the table records that it matters on the CPU
only.

The GPU rows are not measured yet (no Metal or CUDA figures exist for these
tunings); ``mtpflow bench --preset device`` times each tuning on and off on the
device it runs on, so a measured row replaces the reasoned one.
"""

from __future__ import annotations

import platform

from attrs import frozen

#: mlx[cpu]'s exp was measured slow on x86-64 only (``power_exp``)
_X86_64 = platform.machine().lower() in ("x86_64", "amd64")


@frozen(kw_only=True)
class Profile:
    """The tunings of one device kind, and why each is what it is."""

    device: str
    #: a verify starts each decoder layer as it is built (``mx.async_eval``)
    submit_layers: bool
    #: RMSNorm / RoPE through ``mx.compile``d fallbacks, linear layers on a kept transpose
    fuse_ops: bool
    #: OpenBLAS instead of the reference BLAS bundled in the mlx[cpu] Linux wheel
    blas_preload: bool
    #: mtpflow's own elementwise chains (final-logit softcapping) as one ``mx.compile``d node
    compile_elementwise: bool
    #: a verify padded to bucket shapes: tokens or tree nodes, and batch rows (:mod:`mtpflow.backend.shapes`)
    bucket_shapes: bool
    #: training losses take ``exp`` as ``mx.power(e, x)`` (and log-softmax from it: :mod:`mtpflow.train.objective`)
    power_exp: bool
    #: training losses sum a vocabulary-wide float32 row as a BLAS product by ones (:func:`mtpflow.train.objective.rowsum`)
    blas_rowsum: bool
    #: training lanes per process (:mod:`mtpflow.train.lanes`): 0 = one per CPU core, shared by the ranks
    train_lanes: int
    #: ``{tuning: the measurement or reason}``
    why: dict


PROFILES: dict[str, Profile] = {
    "cpu": Profile(
        device="cpu",
        submit_layers=True,
        fuse_ops=True,
        blas_preload=True,
        compile_elementwise=True,
        bucket_shapes=False,
        power_exp=_X86_64,
        blas_rowsum=_X86_64,
        train_lanes=0,
        why={
            "train_lanes": "measured (docs/training.md 'Throughput against the limit'): mlx[cpu] runs an "
                           "elementwise kernel on one thread and keeps a few ops in flight per eval, so one "
                           "eval of a step keeps ~1.4 of 2 cores busy; two lanes with single-threaded OpenBLAS "
                           "keep both busy",
            "power_exp": "measured (docs/training.md 'Throughput against the limit'): mlx[cpu] 0.32.4's exp costs "
                         "~8x a multiply on x86-64 and mx.power(e, x) less than half of it, to 1e-6; a "
                         "soft-label KL over an 8192-token head, forward and backward, 1.5x faster; not measured "
                         "on ARM CPUs, which keep mx.exp",
            "blas_rowsum": "measured (docs/training.md 'Throughput against the limit'): mlx[cpu] 0.32.4 sums a "
                           "[1024, 8192] float32 array's rows in 11.4 ms on one thread, OpenBLAS's product by a "
                           "vector of ones in 1.9 ms (3.3 on one thread); not measured on ARM CPUs",
            "bucket_shapes": "measured (docs/benchmarks.md 'Chains and trees'): a CPU verify's cost grows with its tokens "
                             "(and not monotonically), so padding costs compute; MLX's CPU kernels are not "
                             "compiled per shape",
            "submit_layers": "measured (docs/benchmarks.md 'What limits speed on this CPU'): MLX's CPU stream keeps ~10 ops in flight, so "
                             "async_eval cannot run ahead; submitting each layer lifted the fixture's null path "
                             "from 0.924x to 0.972x mlx-lm at batch 1",
            "fuse_ops": "measured (docs/benchmarks.md 'What limits speed on this CPU'): no CPU kernel for mx.fast.rms_norm / rope; a fixture "
                        "token's graph went from 987 to 521 nodes, null path 0.942x -> 1.500x mlx-lm at batch 1",
            "blas_preload": "measured (docs/benchmarks.md 'What limits speed on this CPU'): the wheel's reference sgemm makes 8 rows cost ~8x "
                            "one row; OpenBLAS makes a 4-token verify cost ~1.2x one token",
            "compile_elementwise": "one node instead of three per softcap call; mlx-lm compiles its own too",
        },
    ),
    "metal": Profile(
        device="metal",
        submit_layers=False,
        fuse_ops=False,
        blas_preload=False,
        compile_elementwise=True,
        bucket_shapes=True,
        power_exp=False,
        blas_rowsum=False,
        train_lanes=1,
        why={
            "train_lanes": "one GPU stream: a step's kernels already fill the device",
            "power_exp": "exp is one GPU kernel like power; not measured on Metal",
            "blas_rowsum": "a GPU's sum reduction is one kernel; not measured on Metal",
            "bucket_shapes": "measured on an H200 (CUDA): a verify of 2..64 tokens cost 1.7-2.4x a 1-token "
                             "step, flat from 2 to 64, while each new shape JIT-compiled kernels (a cold "
                             "48-token run took ~25 s); not measured on Metal",
            "submit_layers": "not measured on Metal: async_eval already runs ahead of the host on a GPU stream",
            "fuse_ops": "not measured on Metal: mx.fast.rms_norm and mx.fast.rope are one kernel each there, "
                        "which a compiled fallback would replace by a longer chain",
            "blas_preload": "matmuls run on the GPU (MPS / Metal kernels), not through cblas",
            "compile_elementwise": "not measured on Metal: a forward is launch-bound, so one kernel per chain "
                                   "instead of one per op",
        },
    ),
    "cuda": Profile(
        device="cuda",
        submit_layers=False,
        fuse_ops=False,
        blas_preload=False,
        compile_elementwise=True,
        bucket_shapes=True,
        power_exp=False,
        blas_rowsum=False,
        train_lanes=1,
        why={
            "train_lanes": "one GPU stream: a step's kernels already fill the device",
            "power_exp": "exp is one GPU kernel like power; not measured on CUDA",
            "blas_rowsum": "a GPU's sum reduction is one kernel; not measured on CUDA",
            "bucket_shapes": "measured on an H200 (CUDA): a verify of 2..64 tokens cost 1.7-2.4x a 1-token "
                             "step, flat from 2 to 64, while each new shape JIT-compiled kernels (a cold "
                             "48-token run took ~25 s)",
            "submit_layers": "not measured on CUDA: async_eval already runs ahead of the host on a GPU stream",
            "fuse_ops": "not measured on CUDA: mx.fast.rms_norm and mx.fast.rope are one kernel each there",
            "blas_preload": "matmuls run through cuBLAS on the GPU, not through cblas",
            "compile_elementwise": "not measured on CUDA: a forward is launch-bound (hundreds of small kernels "
                                   "per token on an H200), so one kernel per chain instead of one per op",
        },
    ),
}

#: the tunings a ``[generation]`` setting may leave to the profile
TUNINGS = ("submit_layers", "fuse_ops", "compile_elementwise", "bucket_shapes")


def device_kind() -> str:
    """``"cpu"``, ``"metal"`` or ``"cuda"``: the kind of MLX's default device."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


def current() -> Profile:
    """The profile of MLX's default device."""
    return PROFILES[device_kind()]


def tuning_on(name: str, mode: str = "auto") -> bool:
    """Whether tuning ``name`` runs: ``mode`` ``"on"`` / ``"off"``, or
    ``"auto"``: the current device's profile."""
    if name not in TUNINGS:
        raise ValueError(f"unknown tuning {name!r}; known: {', '.join(TUNINGS)}")
    if mode == "auto":
        return bool(getattr(current(), name))
    return mode == "on"

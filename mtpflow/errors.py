"""Error types shared across mtpflow (a light module: no mlx import)."""


class TargetError(ValueError):
    """A target checkpoint cannot be used."""


class IncompatibleDrafter(TargetError):
    """A drafter checkpoint does not fit the target (raised before any weight is read)."""


class LoadError(ValueError):
    """A model or drafter cannot be resolved or loaded."""

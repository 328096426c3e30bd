"""An example third-party mtpflow plugin whose components take settings.

* a sampler ``fixed_temp``: lossless rejection sampling at one temperature for
  every request, whatever the request asks, from ``[plugins.fixed_temp]``::

      [sampling]
      sampler = "fixed_temp"

      [plugins.fixed_temp]
      temperature = 0.7      # > 0
      top_k = 0              # 0 = off

  (or ``--set plugins.fixed_temp.temperature=0.7`` on the command line);
* an mlx-lm style logits processor ``ban_tokens`` -- ``(tokens, logits) ->
  logits``, exactly the form ``mlx_lm.generate`` takes -- that forbids the
  token ids of ``[plugins.ban_tokens] ids = [...]``.

Only :mod:`mtpflow.api` is imported: the stable surface for plugin authors.
"""

from __future__ import annotations

import attrs

from mtpflow.api import RejectionSampler, hookimpl

__version__ = "0.1.0"


def _positive(inst, attribute, value):
    if not value > 0:
        raise ValueError(f"must be > 0 (got {value})")


@attrs.frozen(kw_only=True)
class FixedTempSettings:
    temperature: float = attrs.field(default=0.7, validator=_positive)
    top_k: int = attrs.field(default=0, validator=attrs.validators.ge(0))


class FixedTempSampler(RejectionSampler):
    """The built-in rejection sampler with every row's temperature and top-k replaced."""

    settings = FixedTempSettings

    def __init__(self, config, processors=(), settings: FixedTempSettings = FixedTempSettings()):
        super().__init__(config, processors)
        self.fixed = settings

    def sampling_of(self, row):
        return attrs.evolve(row.request.sampling, temperature=self.fixed.temperature, top_k=self.fixed.top_k)


@attrs.frozen(kw_only=True)
class BanSettings:
    ids: list[int] = attrs.field(factory=list)


def ban_tokens(config, settings: BanSettings = BanSettings()):
    """A factory returning an mlx-lm logits processor."""
    import mlx.core as mx

    banned = mx.array(settings.ids, dtype=mx.int32)

    def processor(tokens, logits):
        if banned.size == 0:
            return logits
        hit = (mx.arange(logits.shape[-1])[:, None] == banned[None, :]).any(axis=-1)
        return mx.where(hit, -mx.inf, logits)

    return processor


ban_tokens.settings = BanSettings


@hookimpl
def mtpflow_register_samplers(register):
    register("fixed_temp", FixedTempSampler)


@hookimpl
def mtpflow_register_logits_processors(register):
    register("ban_tokens", ban_tokens)

"""Logits processors as plugins: applied identically on both paths."""

import mlx.core as mx
import pytest
from conftest import make_session, reference

from mtpflow import hookimpl
from mtpflow.config import ConfigError, load_config
from mtpflow.engine import generate
from mtpflow.plugins import PluginError, make_plugin_manager

BANNED = {}


class Ban:
    """Registers ``ban``: forbids the token in ``BANNED["token"]``."""

    @hookimpl
    def mtpflow_register_logits_processors(self, register):
        def factory(config):
            def ban(logits, rows):
                return logits + mx.where(mx.arange(logits.shape[-1]) == BANNED["token"], -mx.inf, 0.0)

            return ban

        register("ban", factory)


def test_a_registered_processor_changes_both_paths_alike():
    pm = make_plugin_manager([Ban()], autoload=False)
    ids = list(range(5, 30))
    plain = make_session("e", block_size=5)
    ref = reference(plain, ids, 30)
    BANNED["token"] = ref[3]
    outs = []
    for block in (1, 5):
        s = make_session("e", block_size=block, plugins=pm, sampling={"processors": ["ban"]})
        outs.append(generate(s, ids, max_tokens=30).tokens)
    assert outs[0] == outs[1]  # speculative == target-only, both processed
    assert BANNED["token"] not in outs[0] and outs[0][:3] == ref[:3] and outs[0] != ref


def test_unknown_processor_and_bad_type_are_errors():
    with pytest.raises(PluginError, match="unknown logits processor 'nope'"):
        make_session("e", sampling={"processors": ["nope"]})
    with pytest.raises(ConfigError, match=r"\$.sampling.processors: expected a list"):
        load_config(overrides={"sampling": {"processors": "ban"}})

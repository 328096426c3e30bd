"""Gemma 3 270M (converted from its packaged GGUF: sliding + full attention)
with a random generic drafter: greedy speculative output equals target-only
output at block sizes 2-6 for a prompt longer than the 512-token window."""

import pytest
from conftest import reference
from test_mtpflow_assistant import random_drafter

from mtpflow.config import load_config
from mtpflow.engine import generate, load_session


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from mtpflow.convert.gguf import GGUFError, find_packaged_gguf, load_gguf_cached

    try:
        target = load_gguf_cached(find_packaged_gguf("gemma3-270m"))
    except GGUFError as exc:
        pytest.skip(str(exc))
    drafter = random_drafter(target, tmp_path_factory.mktemp("g3") / "drafter", seed=1)
    cfg = load_config(overrides={"model": {"model": str(target), "draft_model": str(drafter)}, "draft": {"policy": "fixed"}})
    return load_session(cfg)


def test_long_prompt_every_block_size(gemma3):
    s = gemma3
    assert s.target.sliding_window == 512 and "sliding_attention" in s.target.store_layers
    text = "Once upon a time, in a small village by the sea, there lived an old fisherman and his dog. " * 30
    ids = s.tokenizer.encode(text)
    assert len(ids) > 512
    ref = reference(s, ids, 12)
    for block in range(2, 7):
        s.block_policy.size = block
        assert generate(s, ids, max_tokens=12).tokens == ref, block
        assert s.stats.draft_tokens > 0

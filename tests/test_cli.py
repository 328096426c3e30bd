"""The ``mtpflow`` command line, run in-process through ``mtpflow.cli.main``
(plus one subprocess run of the console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtpflow.cli import main

FIX = Path(__file__).resolve().parent / "fixtures" / "hf_gemma4"
E_TARGET = FIX / "pair_e" / "target"
E_DRAFTER = FIX / "pair_e" / "drafter"
D_DRAFTER = FIX / "pair_d" / "drafter"
PROMPT = (FIX / "prompt_short.txt").read_text().strip()

TRACE_KEYS = {"round", "block_size", "drafted", "accepted", "emitted", "draft_s", "verify_s"}


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed before
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc: int, err: str, *words: str) -> str:
    """Exit code 2 and one stderr line ``mtpflow: error: ...`` holding every word."""
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("mtpflow: error: "), line
    for w in words:
        assert w.lower() in line.lower(), f"{w!r} not in {line!r}"
    return line


def generate(capsys, *extra, model=E_TARGET, max_tokens=5):
    return run(capsys, "generate", "--model", model, "--max-tokens", max_tokens, *extra)


@pytest.fixture
def copy_target(tmp_path):
    def make(name="target") -> Path:
        dst = tmp_path / name
        shutil.copytree(E_TARGET, dst)
        return dst

    return make


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------
def test_generate_json_speculative_equals_target_only(capsys):
    rc, out, err = generate(
        capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT, "--draft-block-size", 5, "--json", max_tokens=20
    )
    assert rc == 0, err
    obj = json.loads(out)
    assert isinstance(obj["text"], str) and obj["text"]
    toks = obj["tokens"]
    assert len(toks) == 20 and all(isinstance(t, int) for t in toks)
    stats = obj["stats"]
    for key in ("rounds", "drafts", "accepted_tokens", "tau"):
        assert key in stats
    assert stats["rounds"] > 0 and stats["drafts"] > 0
    assert stats["accepted_tokens"] > 0
    assert stats["tau"] > 1
    assert stats["rounds"] < 20  # drafting saved target forwards
    assert stats["block_size"] == 5
    assert stats["draft_kind"] == "mtp"

    rc, out, err = generate(capsys, "--prompt", PROMPT, "--json", max_tokens=20)
    assert rc == 0, err
    ref = json.loads(out)
    assert ref["stats"]["drafts"] == 0 and ref["stats"]["block_size"] == 1
    assert ref["tokens"] == toks  # greedy speculative decoding is lossless
    assert ref["text"] == obj["text"]


def test_generate_plain_text_output(capsys):
    rc, out, err = generate(capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT)
    assert rc == 0, err
    assert out.strip() and not out.lstrip().startswith("{")
    assert "tok/s" in err and "tau" in err


def test_trace_writes_one_json_line_per_round(capsys, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rc, out, err = generate(
        capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT, "--draft-block-size", 4,
        "--trace", trace, "--json", max_tokens=12,
    )
    assert rc == 0, err
    stats = json.loads(out)["stats"]
    lines = trace.read_text().splitlines()
    assert len(lines) == stats["rounds"] > 0
    recs = [json.loads(ln) for ln in lines]
    for i, rec in enumerate(recs):  # rounds count from 0
        assert TRACE_KEYS <= set(rec), set(rec)
        assert rec["round"] == i
        assert 1 <= rec["block_size"] <= 4
        assert rec["draft_s"] >= 0 and rec["verify_s"] >= 0
    emitted = sum(sum(r["emitted"]) if isinstance(r["emitted"], list) else r["emitted"] for r in recs)
    assert emitted == stats["emitted_tokens"]


def test_prompts_file_gives_a_result_per_prompt(capsys, tmp_path):
    pf = tmp_path / "prompts.txt"
    pf.write_text("beca daka doli bugi\n\ngane bate dozi behe base\n")  # a blank line is skipped
    rc, out, err = generate(capsys, "--draft-model", E_DRAFTER, "--prompts-file", pf, "--json", max_tokens=6)
    assert rc == 0, err
    obj = json.loads(out)
    results = obj["results"]
    assert len(results) == 2
    for r in results:
        assert isinstance(r["text"], str)
        assert len(r["tokens"]) == 6
    assert [r["prompt_tokens"] for r in results] == [4, 5]
    assert "stats" in obj


def test_draft_kind_contradicting_the_checkpoint_is_an_error(capsys):
    rc, out, err = generate(capsys, "--draft-model", E_DRAFTER, "--draft-kind", "ngram", "--prompt", PROMPT, "--json",
                            max_tokens=3)
    assert_user_error(rc, err, "--draft-kind 'ngram'", "gemma4_assistant", "'mtp'")
    assert out == ""
    rc, out, err = generate(capsys, "--draft-model", E_DRAFTER, "--draft-kind", "mtp", "--prompt", PROMPT, "--json",
                            max_tokens=3)  # the checkpoint's own kind, named
    assert rc == 0, err
    assert json.loads(out)["stats"]["draft_kind"] == "mtp"


@pytest.mark.parametrize("model", [E_TARGET, None])
def test_unknown_draft_kind_is_an_error_listing_the_kinds(capsys, model):
    extra = ["--model", model] if model is not None else []
    rc, out, err = run(capsys, "generate", *extra, "--draft-kind", "bogus", "--prompt-ids", "5,6,7", "--max-tokens", 2)
    assert_user_error(rc, err, "'bogus'", "registered", "ngram", "assistant", "eagle3")
    assert out == ""


def test_an_explicit_draft_kind_wins_over_the_built_in_drafter(capsys):
    """No --model: the built-in target runs the kind asked for (ngram: no
    drafter checkpoint), and the built-in drafter only when its kind is asked."""
    rc, out, err = run(capsys, "generate", "--draft-kind", "ngram", "--prompt-ids", "5,6,7,5,6", "--max-tokens", 3, "--json")
    assert rc == 0, err
    assert "warning" not in err
    assert json.loads(out)["stats"]["draft_kind"] == "ngram"
    rc, out, err = run(capsys, "generate", "--draft-kind", "assistant", "--prompt-ids", "5,6,7", "--max-tokens", 2, "--json")
    assert rc == 0, err
    assert json.loads(out)["stats"]["draft_kind"] == "assistant"


# --------------------------------------------------------------------------------------
# user errors: exit 2, one line, no traceback
# --------------------------------------------------------------------------------------
def test_mismatched_drafter_names_field_and_values(capsys):
    t_hidden = json.loads((E_TARGET / "config.json").read_text())
    t_hidden = (t_hidden.get("text_config") or t_hidden)["hidden_size"]
    d_backbone = json.loads((D_DRAFTER / "config.json").read_text())["backbone_hidden_size"]
    assert t_hidden != d_backbone
    rc, out, err = generate(capsys, "--draft-model", D_DRAFTER, "--json")
    assert_user_error(rc, err, "backbone_hidden_size", str(t_hidden), str(d_backbone))
    assert out == ""


def test_missing_safetensors(capsys, copy_target):
    model = copy_target()
    (model / "model.safetensors").unlink()
    rc, _, err = generate(capsys, model=model)
    assert_user_error(rc, err, "safetensors", str(model))


@pytest.mark.parametrize("fraction", [0.5, 0.0005])
def test_corrupt_safetensors(capsys, copy_target, fraction):
    model = copy_target()
    f = model / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(max(16, int(size * fraction)))
    rc, _, err = generate(capsys, model=model)
    assert_user_error(rc, err, "model.safetensors", "corrupt")


def test_unknown_model_type(capsys, copy_target):
    model = copy_target()
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "llama_nonsense"
    cfg_path.write_text(json.dumps(cfg))
    rc, _, err = generate(capsys, model=model)
    assert_user_error(rc, err, "llama_nonsense", "model_type", "gemma4")


def test_unknown_drafter_model_type(capsys, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(E_DRAFTER, drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["model_type"] = "weird_assistant"
    (drafter / "config.json").write_text(json.dumps(cfg))
    rc, _, err = generate(capsys, "--draft-model", drafter)
    assert_user_error(rc, err, "weird_assistant", "gemma4_assistant")


def test_draft_block_size_zero(capsys):
    rc, _, err = generate(capsys, "--draft-model", E_DRAFTER, "--draft-block-size", 0)
    assert_user_error(rc, err, "$.draft.block_size", "must be >= 1")


def test_bad_toml_config(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[draft\nblock_size = = 3\n")
    rc, _, err = generate(capsys, "--config", bad)
    assert_user_error(rc, err, str(bad), "TOML")


def test_config_with_unknown_key(capsys, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[draft]\nblok_size = 3\n")
    rc, _, err = generate(capsys, "--config", cfg)
    assert_user_error(rc, err, "$.draft", "blok_size")


def test_nonexistent_model_path(capsys, tmp_path):
    missing = tmp_path / "no" / "such-model"
    rc, _, err = generate(capsys, model=missing)
    assert_user_error(rc, err, str(missing), "no such folder")


def test_unknown_repo_id_offline(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    # huggingface_hub reads HF_HUB_OFFLINE at import; it is imported already here
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"), raising=False)
    rc, _, err = generate(capsys, model="nobody/does-not-exist")
    assert_user_error(rc, err, "nobody/does-not-exist", "could not be fetched", "offline")


def test_console_script_error_has_no_traceback(tmp_path):
    """The installed ``mtpflow`` script: a clean one-line error and a non-zero exit."""
    exe = shutil.which("mtpflow") or str(Path(sys.executable).parent / "mtpflow")
    assert Path(exe).exists(), "the mtpflow console script is not installed (pip install -e .)"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), MTPFLOW_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run(
        [exe, "generate", "--model", "nobody/does-not-exist", "--max-tokens", "2"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode != 0
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mtpflow: error: "), proc.stderr
    assert "could not be fetched" in lines[0] and "offline" in lines[0]
    assert proc.stdout == ""


# --------------------------------------------------------------------------------------
# plugins
# --------------------------------------------------------------------------------------
def test_plugins_lists_builtins_as_json(capsys):
    rc, out, err = run(capsys, "plugins")
    assert rc == 0, err
    entries = json.loads(out)
    assert isinstance(entries, list) and entries
    for e in entries:
        assert {"name", "version", "hooks"} <= set(e)
        assert isinstance(e["hooks"], list)
    names = {e["name"] for e in entries}
    assert {"stages", "drafters"} <= names
    drafters = next(e for e in entries if e["name"] == "drafters")
    assert "mtpflow_register_drafters" in drafters["hooks"]


# --------------------------------------------------------------------------------------
# prompt encoding (one helper for generate, eval and bench)
# --------------------------------------------------------------------------------------
class _Tok:
    def __init__(self, template):
        self.chat_template = template

    def encode(self, text):
        return [ord(c) for c in text]

    def apply_chat_template(self, msgs, add_generation_prompt):
        assert add_generation_prompt and msgs == [{"role": "user", "content": msgs[0]["content"]}]
        return [1] + [ord(c) for c in msgs[0]["content"]] + [2]


def test_prompt_encoding_is_shared_and_falls_back_to_plain_text():
    from mtpflow.bench import encode_prompts as bench_encode
    from mtpflow.engine import encode_prompt
    from mtpflow.train.eval import encode_prompts as eval_encode

    chat, plain = _Tok("{{ messages }}"), _Tok(None)
    assert encode_prompt(chat, "hi", True) == [1, 104, 105, 2]
    assert encode_prompt(chat, "hi", False) == [104, 105]
    assert encode_prompt(plain, "hi", True) == [104, 105]  # no template: plain text
    # eval and bench encode a prompt set the same way
    for tok in (chat, plain):
        for flag in (True, False):
            assert bench_encode(tok, ["ab", "c"], flag) == eval_encode(tok, ["ab", "c"], flag)

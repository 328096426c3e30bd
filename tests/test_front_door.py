"""A newcomer's first minute: mlx_lm's CLI conventions, shipped configs by
name, a quiet library, one definition of τ, one-line errors for missing extras."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest
from conftest import FIXTURES, make_session
from test_cli import E_DRAFTER, E_TARGET, PROMPT, assert_user_error, generate, run

from mtpflow.engine import generate as api_generate
from mtpflow.engine import load_session

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def chat_target(tmp_path):
    """The fixture target with a chat template in its tokenizer config."""
    dst = tmp_path / "chat-target"
    shutil.copytree(E_TARGET, dst)
    f = dst / "tokenizer_config.json"
    cfg = json.loads(f.read_text())
    cfg["chat_template"] = TEMPLATE
    f.write_text(json.dumps(cfg))
    return dst


def _tok(path):
    from mlx_lm.tokenizer_utils import load

    return load(path)


def test_chat_template_is_applied_by_default_for_every_model(capsys, chat_target):
    tok = _tok(chat_target)
    templated = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    plain = list(tok.encode(PROMPT))
    assert templated != plain
    rc, out, err = generate(capsys, "--prompt", PROMPT, "--json", model=chat_target)
    assert rc == 0, err
    assert json.loads(out)["prompt_tokens"] == len(templated)
    for flag in ("--ignore-chat-template", "--no-chat-template"):  # the mlx_lm name and the old alias
        rc, out, err = generate(capsys, "--prompt", PROMPT, "--json", flag, model=chat_target)
        assert rc == 0, err
        assert json.loads(out)["prompt_tokens"] == len(plain), flag


def test_system_prompt_goes_through_the_template(capsys, chat_target):
    tok = _tok(chat_target)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    want = len(tok.apply_chat_template(msgs, add_generation_prompt=True))
    rc, out, err = generate(capsys, "--prompt", PROMPT, "--system-prompt", "be brief", "--json", model=chat_target)
    assert rc == 0, err
    assert json.loads(out)["prompt_tokens"] == want
    rc, _, err = generate(capsys, "--prompt", PROMPT, "--system-prompt", "x", "--ignore-chat-template", model=chat_target)
    assert_user_error(rc, err, "--system-prompt", "--ignore-chat-template")


def test_without_a_template_prompts_are_plain_and_requiring_one_is_an_error(capsys):
    rc, out, err = generate(capsys, "--prompt", PROMPT, "--json")
    assert rc == 0, err
    assert json.loads(out)["prompt_tokens"] == len(_tok(E_TARGET).encode(PROMPT))
    rc, _, err = generate(capsys, "--prompt", PROMPT, "--chat-template")
    assert_user_error(rc, err, "chat template")
    rc, _, err = generate(capsys, "--prompt", PROMPT, "--system-prompt", "x")
    assert_user_error(rc, err, "--system-prompt", "chat template")


def test_config_by_shipped_name(capsys, tmp_path):
    from mtpflow.config import ConfigError, load_config, shipped_configs

    names = set(shipped_configs())
    assert {"default", "gemma4-e2b", "gemma4-e4b", "gemma4-26b-a4b", "gemma4-31b"} <= names
    assert load_config("gemma4-e2b") == load_config(shipped_configs()["gemma4-e2b"]) == load_config("gemma4-e2b.toml")
    assert load_config("gemma4-e2b").model.model == "google/gemma-4-E2B-it"
    with pytest.raises(ConfigError, match="neither a file nor a shipped config.*gemma4-e2b"):
        load_config("gemma4-e9b")
    # from the CLI, with a flag overriding the shipped file
    rc, out, err = run(capsys, "generate", "--config", "default", "--model", E_TARGET, "--prompt-ids", "5,6,7",
                       "--max-tokens", 4, "--json")
    assert rc == 0, err and len(json.loads(out)["tokens"]) == 4
    rc, _, err = run(capsys, "generate", "--config", "nosuch", "--prompt", "x")
    assert_user_error(rc, err, "nosuch", "shipped config")


def _options():
    from mtpflow.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        fmt = sp._get_formatter()
        for a in sp._actions:
            if a.option_strings and not isinstance(a, argparse._HelpAction):
                yield name, a, fmt._expand_help(a) if a.help else ""


def test_every_flag_states_its_default():
    missing = [f"{cmd} {'/'.join(a.option_strings)}" for cmd, a, h in _options()
               if "default" not in h.lower() and "required" not in h.lower()]
    assert not missing, missing


def test_python_api_prints_nothing(capfd):
    s = make_session("e", block_size=4, log=None)  # the library's own default logger
    s2 = load_session(s.config)
    capfd.readouterr()
    res = api_generate(s2, list(range(5, 20)), max_tokens=12)
    assert len(res.tokens) == 12
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_python_api_is_quiet_in_a_fresh_process():
    code = ("import sys; sys.path.insert(0, 'tests'); import conftest; "
            "from mtpflow.config import load_config; from mtpflow.engine import load_session, generate; "
            f"s = load_session(load_config(overrides={{'model': {{'model': {str(E_TARGET)!r}, 'draft_model': {str(E_DRAFTER)!r}}}}})); "
            "generate(s, [5, 6, 7, 8], max_tokens=8)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "" and out.stderr == ""


def test_round_events_reach_the_stdlib_logger_when_asked(caplog):
    import logging

    s = load_session(make_session("e", block_size=3).config)
    with caplog.at_level(logging.DEBUG, logger="mtpflow.rounds"):
        api_generate(s, list(range(5, 20)), max_tokens=10)
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "mtpflow.rounds"]
    assert events and all(e["event"] == "round" for e in events) and len(events) == s.stats.rounds


def test_verbose_prints_rounds_to_stderr(capsys):
    rc, out, err = generate(capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT, "--verbose")
    assert rc == 0, err
    rounds = [ln for ln in err.splitlines() if ln.startswith("mtpflow.rounds DEBUG")]
    assert rounds and json.loads(rounds[0].split(" ", 2)[2])["event"] == "round"


@pytest.mark.parametrize("block", [1, 2, 5])
def test_tau_is_at_least_one_for_every_run_that_emitted(block):
    s = make_session("e", block_size=block)
    for ids, n in ((list(range(5, 30)), 20), ([7, 8], 1), (list(range(40, 60)), 7)):
        res = api_generate(s, ids, max_tokens=n)
        st = res.stats
        assert st["rounds"] == 0 or st["tau"] >= 1.0, (block, st)
        if block == 1:
            assert st["tau"] in (None, 1.0) and st["acceptance_rate"] is None and st["mean_acceptance_length"] is None
        assert st["produced_tokens"] >= st["emitted_tokens"]


def test_tau_counts_the_stop_token():
    from mtpflow.metrics import SpecDecodingStats
    from mtpflow.state import RoundRecord

    st = SpecDecodingStats()
    # one row-round that produced only its stop token: τ 1, not 0
    st.observe(RoundRecord(round=0, batch_size=1, block_size=1, drafted=0, accepted=[0], emitted=[0], produced=[1],
                           draft_s=0.0, verify_s=0.0, host_s=0.0))
    assert st.tau == 1.0 and st.acceptance_rate is None


def test_stats_line_names_policy_and_block_sizes(capsys):
    rc, _, err = generate(capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT, max_tokens=12)
    assert rc == 0, err
    line = err.strip().splitlines()[-1]
    assert "policy adaptive" in line and "blocks " in line and "tau " in line, line
    rc, _, err = generate(capsys, "--draft-model", E_DRAFTER, "--prompt", PROMPT, "--draft-block-size", 3, max_tokens=12)
    line = err.strip().splitlines()[-1]
    assert "policy fixed" in line and " 3×" in line, line
    rc, _, err = generate(capsys, "--prompt", PROMPT, max_tokens=12)
    line = err.strip().splitlines()[-1]
    assert "acceptance -" in line and "tau 1.00" in line and "blocks 1×" in line, line


def test_missing_extra_is_one_line_naming_the_pip_install(monkeypatch):
    import importlib.util

    from mtpflow import _extras
    from mtpflow.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(_extras.importlib.util, "find_spec", lambda m: None if m in ("starlette", "uvicorn") else real(m))
    with pytest.raises(_extras.MissingExtra, match=r'pip install "mtpflow\[serve\]"'):
        _extras.require("serve", "starlette", "uvicorn")
    code = ("import importlib.util as u, sys; real = u.find_spec; "
            "u.find_spec = lambda m, *a: None if m.split('.')[0] in ('starlette', 'uvicorn', 'matplotlib') else real(m, *a); "
            "from mtpflow.cli import main; sys.exit(main(sys.argv[1:]))")
    for argv, extra in ((["serve", "--model", str(E_TARGET)], "serve"), (["bench", "--target", str(E_TARGET)], "bench")):
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and f'pip install "mtpflow[{extra}]"' in lines[0], out.stderr
    assert main is not None


def test_default_pair_names_its_recommended_block_size():
    from mtpflow.config import load_config
    from mtpflow.drafters.base import recommended_block_size
    from mtpflow.engine import packaged_drafter_path, resolve_draft_config

    d = packaged_drafter_path("smollm2-135m-mtp")
    assert recommended_block_size(json.loads((d / "config.json").read_text()), d) == 2
    # the Gemma assistants carry transformers' num_assistant_tokens (4 drafts: block 5)
    pe = FIXTURES / "pair_e" / "drafter"
    assert recommended_block_size(json.loads((pe / "config.json").read_text()), pe) == 5
    cfg = resolve_draft_config(load_config(), object, {"block_size": 3})
    assert (cfg.draft.block_size, cfg.draft.policy) == (3, "adaptive")
    cfg = resolve_draft_config(load_config(overrides={"draft": {"block_size": 6}}), object, {"block_size": 3})
    assert (cfg.draft.block_size, cfg.draft.policy) == (6, "fixed")
    assert resolve_draft_config(load_config()).draft.block_size == 4

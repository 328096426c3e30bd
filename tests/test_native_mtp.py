"""The native_mtp drafter kind on tiny DeepSeek-V3 checkpoints in the real layout."""

from __future__ import annotations

import json

import pytest

from conftest import drive_with_late_joiners, quiet_log, run_requests
from native_mtp_tiny import make_checkpoint, module_folder, quantized_copy

PROMPTS = [[5, 9, 17, 33, 2, 8], [7, 3, 11], [40, 41, 42, 43, 44, 45, 46, 12, 13]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_mtp")
    return {
        "d1": make_checkpoint(root, 0, depth=1),
        "d2": make_checkpoint(root, 1, depth=2),
        "stripped": make_checkpoint(root, 0, depth=1, strip=True),
        "root": root,
    }


def session(model, block=3, **model_kw):
    from mtpflow.config import load_config
    from mtpflow.engine import load_session

    ov = {"model": {"model": str(model), **model_kw}, "draft": {"block_size": block, "policy": "fixed"}}
    plugins = model_kw.pop("plugins_cfg", None)
    if plugins:
        ov["plugins"] = plugins
    return load_session(load_config(overrides=ov), log=quiet_log())


def reference(s, prompt, n):
    from mtpflow.engine import target_only_greedy

    return target_only_greedy(s.target, prompt, n, s.target.eos_ids)


@pytest.mark.parametrize("name,block,context", [("d1", 3, "verified"), ("d1", 4, "drafted"), ("d2", 4, "verified")])
def test_greedy_ragged_batch_equals_target_only(ckpts, name, block, context):
    from mtpflow.config import load_config
    from mtpflow.engine import load_session

    ov = {"model": {"model": str(ckpts[name]), "draft_kind": "native_mtp"},
          "draft": {"block_size": block, "policy": "fixed"}, "plugins": {"native_mtp": {"context": context}}}
    s = load_session(load_config(overrides=ov), log=quiet_log())
    assert s.draft_kind == "native_mtp" and s.drafter.depth == int(name[1])
    _, out = run_requests(s, PROMPTS, [24, 17, 24])
    for i, p in enumerate(PROMPTS):
        assert out[str(i)] == reference(s, p, [24, 17, 24][i])
    st = s.stats.as_dict()
    # the head drafts some accepted and some rejected tokens: rollback is exercised
    assert st["accepted_tokens"] > 0 and st["accepted_tokens"] < st["draft_tokens"]


def test_continuous_batch_equals_target_only(ckpts):
    from mtpflow.engine import make_request

    s = session(ckpts["d1"], draft_kind="native_mtp")
    first = [make_request(s, p, max_tokens=20, request_id=f"a{i}") for i, p in enumerate(PROMPTS[:2])]
    late = [make_request(s, PROMPTS[2], max_tokens=20, request_id="late")]
    out = drive_with_late_joiners(s, first, late, join_after=3)
    for r in first + late:
        assert out[r.id] == reference(s, r.prompt, 20)


def test_mtp_alias_and_auto_detection_pick_the_native_head(ckpts):
    s = session(ckpts["d1"], draft_kind="mtp")
    assert s.draft_kind == "native_mtp"
    s = session(ckpts["d1"])  # nothing asked: the checkpoint's head is found
    assert s.draft_kind == "native_mtp"
    s = session(ckpts["d1"], draft_kind="none")
    assert s.drafter is None


def test_stats_line_says_the_native_head_ran(ckpts, capsys):
    from mtpflow.cli import main

    rc = main(["generate", "--model", str(ckpts["d1"]), "--draft-kind", "mtp", "--prompt-ids", "5,9,17,33",
               "--max-tokens", "8"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "drafter native MTP head (depth 1, deepseek_v3)" in err


def test_trained_module_folder_loads_and_drafts_as_the_checkpoint(ckpts, tmp_path):
    """The loader contract: config.json + model.layers.{N+i}.* only, with --draft-model."""
    folder = module_folder(ckpts["d1"], tmp_path / "module")
    a = session(ckpts["d1"], draft_kind="native_mtp")
    b = session(ckpts["d1"], draft_model=str(folder))
    assert b.draft_kind == "native_mtp"
    _, oa = run_requests(a, PROMPTS, [16, 16, 16])
    _, ob = run_requests(b, PROMPTS, [16, 16, 16])
    assert oa == ob
    assert a.stats.as_dict()["accepted_per_position"] == b.stats.as_dict()["accepted_per_position"]


def test_module_names_round_trip():
    import mlx.core as mx

    from mtpflow.drafters.native_mtp.module import from_native, to_native

    w = {"layers.0.enorm.weight": mx.ones(2), "layers.1.block.self_attn.o_proj.weight": mx.ones(2),
         "layers.1.shared_head.norm.weight": mx.ones(2)}
    native = to_native(w, 61)
    assert set(native) == {"model.layers.61.enorm.weight", "model.layers.62.self_attn.o_proj.weight",
                           "model.layers.62.shared_head.norm.weight"}
    assert set(from_native(native, 61, 2)) == set(w)


@pytest.mark.parametrize("mixed", [False, True])
def test_quantized_checkpoint_runs_the_head_quantized(ckpts, tmp_path, mixed):
    q = quantized_copy(ckpts["d1"], tmp_path / "q4", mixed=mixed)
    s = session(q, draft_kind="native_mtp")
    eh = s.drafter.model.layers[0].eh_proj
    assert "scales" in eh and eh.bits == (8 if mixed else 4)  # the head runs quantized, per-layer bits kept
    _, out = run_requests(s, PROMPTS, [16, 16, 16])
    for i, p in enumerate(PROMPTS):
        assert out[str(i)] == reference(s, p, 16)


# -- bad input: one line that says what to do, before any weight is read ------------------
def _error(fn):
    from mtpflow.errors import TargetError

    with pytest.raises(TargetError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_stripped_checkpoint_names_what_is_missing(ckpts):
    msg = _error(lambda: session(ckpts["stripped"], draft_kind="native_mtp"))
    assert "model.layers.2.eh_proj*" in msg and "converter dropped them" in msg and "--draft-model" in msg
    # asked through the alias (the Gemma 4 assistant's kind name): the same reason, no crash
    from mtpflow.engine import LoadError

    with pytest.raises(LoadError) as ei:
        session(ckpts["stripped"], draft_kind="mtp")
    assert "--draft-kind mtp needs --draft-model" in str(ei.value) and "converter dropped them" in str(ei.value)


def test_no_mtp_layers_and_unsupported_family(ckpts, tmp_path, fixtures_dir):
    cfg = json.loads((ckpts["d1"] / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "none" / "model.safetensors").symlink_to(ckpts["d1"] / "model.safetensors")
    msg = _error(lambda: session(tmp_path / "none", draft_kind="native_mtp"))
    assert "carries no MTP head" in msg and "mtpflow train --kind mtp" in msg
    msg = _error(lambda: session(fixtures_dir / "pair_e" / "target", draft_kind="native_mtp"))
    assert "no native-MTP family adapter" in msg and "deepseek_v3" in msg


def test_module_for_another_target_is_refused(ckpts, tmp_path):
    folder = module_folder(ckpts["d1"], tmp_path / "module")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_size"] = 32
    (folder / "config.json").write_text(json.dumps(cfg))
    msg = _error(lambda: session(ckpts["d1"], draft_model=str(folder)))
    assert "hidden_size is 32 but the target's is 64" in msg


def test_bench_has_native_mtp_rows_next_to_another_drafter(tmp_path, fixtures_dir):
    """``mtpflow bench`` on a target carrying a head, with another drafter
    given: rows for the native head come next to that drafter's."""
    import argparse

    from mtpflow.bench import add_bench_arguments, run_bench
    from native_mtp_tiny import DEEPSEEK_V3

    ckpt = make_checkpoint(tmp_path, 5, config=dict(DEEPSEEK_V3, vocab_size=2048), tokenizer=fixtures_dir / "tokenizer")
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    out = tmp_path / "bench"
    args = p.parse_args([str(a) for a in (
        "--target", ckpt, "--draft-kind", "ngram", "--prompts", "tiny", "--num-prompts", "2", "--block-sizes", "1,3",
        "--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0", "--max-tokens", "12", "--out", out,
        "--no-progress", "--no-plots", "--no-baseline")])
    assert run_bench(args) == 0
    res = json.loads((out / "bench.json").read_text())
    rows = {v["name"]: v for v in res["variants"]}
    assert "mtpflow-k3 b1" in rows and "mtpflow-native_mtp-k3 b1" in rows and "mtpflow-native_mtp-k3 b2" in rows
    assert rows["mtpflow-native_mtp-k3 b2"]["kind"] == "native_mtp"
    assert rows["mtpflow-native_mtp-k3 b1"]["rounds"] > 0


@pytest.mark.parametrize("family", ["GLM4_MOE", "GLM4_MOE_LITE", "GLM_MOE_DSA"])
def test_other_families_ragged_and_continuous(tmp_path, family):
    """GLM-4.x MoE (GQA + MoE), GLM-4.7-Flash (MLA) and GLM-5 (MLA + DSA, a
    cache pair per layer): each row equals its own target-only output, also
    when a request joins a running batch."""
    import native_mtp_tiny as tiny
    from mtpflow.engine import make_request

    ckpt = make_checkpoint(tmp_path, 2, config=getattr(tiny, family), residual=0.3, half="embed", mix=0.8, block_scale=2.0)
    s = session(ckpt, block=3, draft_kind="mtp")
    assert s.draft_kind == "native_mtp"
    first = [make_request(s, p, max_tokens=14, request_id=f"a{i}") for i, p in enumerate(PROMPTS[:2])]
    late = [make_request(s, PROMPTS[2], max_tokens=14, request_id="late")]
    out = drive_with_late_joiners(s, first, late, join_after=2)
    for r in first + late:
        assert out[r.id] == reference(s, r.prompt, 14)
    assert s.stats.as_dict()["accepted_tokens"] > 0


@pytest.mark.parametrize("fixture", ["dflash/target", "eagle3/target"])
def test_trained_module_for_any_mlx_lm_target(tmp_path, fixture):
    """The loader contract for modules trained for targets without a head of
    their own (qwen3, llama): built with ``NativeLayout.build``, written with
    ``to_native``, loaded with ``--draft-model``; greedy output is the target's."""
    from pathlib import Path

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mtpflow.drafters.native_mtp.families import NativeLayout
    from mtpflow.drafters.native_mtp.module import to_native

    tpath = Path(__file__).parent / "fixtures" / fixture
    base = session(tpath, draft_kind="none")
    assert base.drafter is None
    cfg = dict(json.loads((tpath / "config.json").read_text()), num_nextn_predict_layers=2)
    head = NativeLayout.build(base.target.model, cfg)
    folder = tmp_path / "module"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        to_native(dict(tree_flatten(head.parameters())), cfg["num_hidden_layers"]))
    s = session(tpath, block=4, draft_model=str(folder))
    assert s.draft_kind == "native_mtp" and s.drafter.depth == 2
    ids = [3, 17, 42, 8, 99]
    _, out = run_requests(s, [ids], [12])
    assert out["0"] == reference(s, ids, 12)

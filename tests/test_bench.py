"""``mtpflow bench`` on the fixture pair: structure and internal consistency of
bench.json (no timing assertions -- CI machines are noisy)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from mtpflow.bench import BenchError, RoundCollector, add_bench_arguments, load_prompt_texts, run_bench, summarize

FIX = Path(__file__).resolve().parent / "fixtures" / "hf_gemma4" / "pair_e"


def parse(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return p.parse_args([str(a) for a in argv])


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = parse(
        "--target", FIX / "target", "--draft-model", FIX / "drafter", "--prompts", "tiny",
        "--block-sizes", "1,3,5", "--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0",
        "--max-tokens", "6", "--out", out, "--no-progress", "--trees", "2,1;dynamic:2:3:2",
    )
    assert run_bench(args) == 0
    return out, json.loads((out / "bench.json").read_text())


def test_variants_present(bench):
    _, res = bench
    names = {v["name"] for v in res["variants"]}
    for b in (1, 2):
        assert {f"mlx_lm b{b}", f"mtpflow-null b{b}", f"mtpflow-k1 b{b}", f"mtpflow-k3 b{b}"} <= names
        d = next(v for v in res["variants"] if v["name"] == f"mtpflow-default b{b}")
        # the default: the adaptive policy from the drafter's recommended block (num_assistant_tokens 4)
        assert d["block_size"] == 5 and sum(d["block_sizes"].values()) == d["rounds"] > 0
        for shape in ("2,1", "dynamic:2:3:2"):
            t = next(v for v in res["variants"] if v["name"] == f"mtpflow-tree{shape} b{b}")
            assert t["kind"] == "tree" and t["tau"] >= 1.0
    assert res["baselines"] == {"1": "mlx_lm b1", "2": "mlx_lm b2"}
    assert not [v for v in res["variants"] if "failed" in v]
    assert res["meta"]["draft_kind"] == "mtp"
    assert res["meta"]["num_prompts"] == 4 and res["meta"]["ignore_eos"] is True


def test_figures_consistent(bench):
    _, res = bench
    by = {v["name"]: v for v in res["variants"]}
    n_prompts = res["meta"]["num_prompts"]
    for v in res["variants"]:
        assert v["tokens"] == n_prompts * 6, v["name"]  # EOS ignored: every variant emits max_tokens
        tps = v["tokens_per_s"]
        assert tps["n"] == 1 and tps["median"] > 0 and tps["min"] <= tps["median"] <= tps["max"]
        for r in v["repeats"]:
            assert math.isclose(r["tokens_per_s"], r["tokens"] / r["wall_s"], rel_tol=1e-4)
        base = by[res["baselines"][str(v["batch_size"])]]
        assert v["baseline"] == base["name"]
        assert math.isclose(v["ratio"], tps["median"] / base["tokens_per_s"]["median"], rel_tol=1e-9)
        assert v["tau"] >= 1.0
        assert v["peak_memory_bytes"] > 0 and v["peak_memory_source"]
        for a in v["acceptance_per_position"] + v["acceptance_conditional"]:
            assert 0.0 <= a <= 1.0
        if v["kind"] in ("target_only", "null") or v["block_size"] == 1:
            assert v["tau"] == 1.0 and v["acceptance_per_position"] == []
    for b in (1, 2):
        assert by[f"mlx_lm b{b}"]["ratio"] == 1.0
        k3 = by[f"mtpflow-k3 b{b}"]
        assert 1.0 <= k3["tau"] <= 3.0
        assert len(k3["acceptance_per_position"]) == 2
        # accepted counts cannot rise with the position (a draft needs its predecessor)
        counts = k3["accepted_counts_per_position"]
        assert counts[1] <= counts[0] <= k3["drafted_per_position"][0]
        assert k3["drafted_per_position"][1] <= k3["drafted_per_position"][0]
        assert 0.0 <= k3["acceptance_rate"] <= 1.0
        split = k3["time_split"]
        assert all(split[k] >= 0 for k in ("draft_s", "verify_s", "host_s", "other_s"))
        assert math.isclose(sum(split["fractions"].values()), 1.0, rel_tol=1e-6)
        assert k3["syncs_per_round"] == 1.0
        # tau = 1 + accepted drafts per row-round
        st = k3["stats_last_repeat"]
        assert math.isclose(k3["tau"], st["tau"], abs_tol=1e-3)
        # tokens verified per row-round: 1 on the null path; a block-3 chain at most 3 (fewer
        # where the budget cuts a round short); a tree at most its nodes + the root
        assert by[f"mtpflow-null b{b}"]["verified_per_round"] == 1.0
        assert 1.0 < k3["verified_per_round"] <= 3.0
        for shape, nodes in (("2,1", 4), ("dynamic:2:3:2", 5)):
            tree = by[f"mtpflow-tree{shape} b{b}"]
            assert 1.0 < tree["verified_per_round"] <= nodes + 1
        assert by[f"mlx_lm b{b}"].get("verified_per_round") is None  # mlx-lm's loop reports no rounds


def test_plots_written(bench):
    out, res = bench
    assert set(res["plots"]) == {"tokens_per_s.png", "acceptance_per_position.png"}
    for name in res["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_sets_and_errors(tmp_path):
    texts, chat = load_prompt_texts("tiny")
    assert len(texts) == 4 and not chat
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n{"turns": ["c d", "e"]}\n')
    texts, chat = load_prompt_texts(str(f))
    assert texts == ["a b", "c d"] and chat
    with pytest.raises(BenchError, match="no such file"):
        load_prompt_texts(str(tmp_path / "missing.txt"))
    with pytest.raises(SystemExit):
        parse("--block-sizes", "0,2")


def test_collector_and_summary():
    c = RoundCollector()
    c.add(3, [0, 3, 1])
    assert c.per_position() == [2 / 3, 1 / 3, 1 / 3]
    assert c.conditional() == [2 / 3, 1 / 2, 1.0]
    s = summarize([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)


def test_collector_counts_the_tokens_each_verify_took():
    from mtpflow.state import RoundRecord

    def rec(drafted, accepted, nodes, tree=None):
        return RoundRecord(round=0, batch_size=len(accepted), block_size=drafted + 1, drafted=drafted,
                           accepted=accepted, emitted=[a + 1 for a in accepted], draft_s=0.0, verify_s=0.0,
                           host_s=0.0, nodes=nodes, tree=tree)

    c = RoundCollector()
    c.mtpflow_emit(session=None, record=rec(2, [1, 0], 2), emitted={})  # a chain of 2 drafts, 2 rows: 3 tokens each
    c.mtpflow_emit(session=None, record=rec(3, [2], 15, "dynamic:8x5x3"), emitted={})  # a 15-node tree of depth 3
    c.mtpflow_emit(session=None, record=rec(0, [0, 0, 0], 0), emitted={})  # a null round, 3 rows
    assert (c.verified, c.row_rounds) == (2 * 3 + 16 + 3 * 1, 6)
    # acceptance per position still counts drafts by depth, not by node
    assert c.proposed == [3, 3, 1] and c.accepted == [2, 1, 0]


def test_sampled_bench_runs_every_engine_at_the_same_settings(tmp_path):
    """--temperature/--top-p/--top-k/--seed reach mtpflow's requests and mlx-lm's
    sampler (generate_step and BatchGenerator), and bad values fail in one line."""
    import mlx.core as mx

    from mtpflow.bench import MLXLMVariant, _config
    from mtpflow.config import ConfigError

    args = parse("--target", FIX / "target", "--draft-model", FIX / "drafter", "--block-sizes", "3",
                 "--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0", "--max-tokens", "4",
                 "--out", tmp_path, "--no-progress", "--no-plots", "--no-default", "--no-null",
                 "--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--seed", "7", "--submit-layers", "on")
    assert run_bench(args) == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["meta"]["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.0, "seed": 7}
    assert res["meta"]["submit_layers"] == {"setting": "on", "on": True}
    assert _config(parse("--submit-layers", "off")).generation.submit_layers == "off"
    assert _config(parse()).generation.submit_layers == "auto"
    assert not [v for v in res["variants"] if "failed" in v]
    assert len(res["variants"]) == 4 and all(v["tokens"] == 4 * 4 for v in res["variants"])
    k3 = next(v for v in res["variants"] if v["name"] == "mtpflow-k3 b1")
    assert k3["stats_last_repeat"]["draft_tokens"] > 0

    sc = _config(args).sampling
    assert (sc.temperature, sc.top_p, sc.top_k, sc.seed) == (0.8, 0.9, 40, 7)
    assert MLXLMVariant("g", 1, 1, "target_only", None, sampling=_config(parse("--top-p", "0.5")).sampling)._sampler() is None
    # mlx-lm's sampler at these settings: top-k 40 of a flat distribution keeps 40 tokens
    sampler = MLXLMVariant("s", 1, 1, "target_only", None, sampling=sc)._sampler()
    draws = {int(sampler(mx.zeros((1, 1000)))[0]) for _ in range(300)}
    assert 20 < len(draws) <= 40
    with pytest.raises(ConfigError, match="top_p"):
        _config(parse("--top-p", "0", "--temperature", "1"))


def test_device_preset_writes_its_figures(tmp_path):
    """``--preset device`` at tiny size: its variants (null and mlx-lm, chains at
    2, 3, 5, one tree, batches 1 and 4 unless told otherwise), the verify-cost
    curve, the dtype that ran, the device profile and the wall time; flags given
    explicitly win over the preset."""
    from mtpflow.bench import PRESETS, VERIFY_LENGTHS

    args = parse("--preset", "device", "--target", FIX / "target", "--draft-model", FIX / "drafter",
                 "--max-tokens", 4, "--repeats", 1, "--batch-sizes", "1,2", "--out", tmp_path, "--no-progress")
    assert run_bench(args) == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    assert not list(tmp_path.glob("*.png"))  # the preset writes no plots
    names = {v["name"] for v in res["variants"]}
    ks = PRESETS["device"]["block_sizes"]
    for b in (1, 2):
        assert {f"mlx_lm b{b}", f"mtpflow-null b{b}", f"mtpflow-treeauto b{b}"} | {f"mtpflow-k{k} b{b}" for k in ks} == {
            n for n in names if n.endswith(f" b{b}")}
    assert not [v for v in res["variants"] if "failed" in v]
    assert all(v["tokens"] == 4 * 4 for v in res["variants"])  # --max-tokens 4 over the preset's 4 prompts
    meta = res["meta"]
    assert meta["preset"] == "device" and meta["repeats"] == 1 and meta["warmup"] == 1 and meta["num_prompts"] == 4
    assert meta["dtype"] == {"setting": "auto", "ran": "float32"}
    assert meta["profile"]["device"] == "cpu" and meta["profile"]["fuse_ops"] is True
    assert meta["warmed_verify_shapes"] == []  # the CPU profile does not bucket verify shapes
    curve = res["verify_cost"]["curve"]
    assert [c["tokens"] for c in curve] == list(VERIFY_LENGTHS) and all(c["ms"] > 0 for c in curve)
    assert curve[0]["ratio"] == 1.0
    assert 0 < res["wall_s"] < 180


def test_a_bucketing_device_warms_every_verify_shape_first(tmp_path, monkeypatch):
    """On a device whose profile buckets verify shapes (the CPU's, patched),
    the bench runs one verify of every bucketed shape its variants can reach
    before its warm-up passes: rows 1, 2 by chains up to 3 tokens (1, 2, 4)
    and the 11-node tree (16)."""
    import attrs

    from mtpflow.backend import profiles

    monkeypatch.setitem(profiles.PROFILES, "cpu", attrs.evolve(profiles.PROFILES["cpu"], bucket_shapes=True))
    args = parse("--target", FIX / "target", "--draft-model", FIX / "drafter", "--max-tokens", 4, "--repeats", 1,
                 "--block-sizes", "3", "--batch-sizes", "1,2", "--trees", "2,2,1", "--no-default", "--no-baseline",
                 "--no-null", "--no-plots", "--out", tmp_path, "--no-progress")
    assert run_bench(args) == 0
    meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
    assert meta["warmed_verify_shapes"] == [[r, n, t] for r in (1, 2) for n, t in ((1, False), (2, False), (4, False), (16, True))]


def test_the_package_keeps_the_old_module_names_and_description():
    """``mtpflow.bench`` is a package: the names code imports from it are still there, and
    ``python -m mtpflow.bench --help`` describes it with its docstring's first line."""
    import mtpflow.bench as bench
    from mtpflow.bench.run import DESCRIPTION

    assert bench.__doc__.split("\n\n")[0] == DESCRIPTION
    for name in ("BenchError", "RoundCollector", "add_bench_arguments", "load_prompt_texts", "run_bench", "summarize",
                 "MLXLMVariant", "MTPFlowVariant", "_config", "PRESETS", "VERIFY_LENGTHS", "encode_prompts",
                 "build_variants", "verify_cost", "main"):
        assert hasattr(bench, name), name
    assert bench.FIXTURES.is_dir()

"""The native-MTP kind on hybrid targets: the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next ``mtp.*`` head."""

import json

import mlx.core as mx
import pytest
from conftest import drive_with_late_joiners, quiet_log, run_requests
from tiny_hybrid import build

from mtpflow.config import load_config
from mtpflow.engine import generate_stream, load_session, make_request, target_only_greedy
from mtpflow.errors import IncompatibleDrafter
from mtpflow.state import SamplingParams

PROMPTS = [[2, 17, 300, 41, 999, 5, 77, 1200, 64, 8, 33], [2, 501, 502], [2, 9, 9, 9, 1500, 23, 7]]
MAX = [20, 14, 17]
#: a target whose next token leans on the current one, and a head that mostly
#: passes the embedding through: about a third of the drafts are accepted
PREDICTABLE = {"residual": 0.1, "mtp_copy": 0.95}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_mtp")
    return {
        "qwen3_5": build(root, "qwen3_5", seed=0, mtp=True, **PREDICTABLE),
        "qwen3_5_moe": build(root, "qwen3_5_moe", seed=1, mtp=True, **PREDICTABLE),
        "qwen3_next": build(root, "qwen3_next", seed=2, mtp=True, **PREDICTABLE),
        "no_head": build(root, "qwen3_5", seed=0, residual=0.1),
        "root": root,
    }


def session(path, block=3, **model):
    ov = {"model": {"model": str(path), **model}, "draft": {"block_size": block, "policy": "fixed"}}
    return load_session(load_config(overrides=ov), log=quiet_log())


def refs(s, prompts, maxes):
    return [target_only_greedy(s.target, p, m, s.target.eos_ids) for p, m in zip(prompts, maxes)]


@pytest.mark.parametrize("family,block", [("qwen3_5", 3), ("qwen3_5", 5), ("qwen3_5_moe", 3), ("qwen3_next", 4)])
def test_greedy_ragged_batch_through_the_native_head_equals_target_only(ckpts, family, block):
    s = session(ckpts[family], block)  # detected: the checkpoint carries mtp.*
    assert s.draft_kind == "native_mtp" and s.drafter.family.__name__ == "QwenLayout"
    _, out = run_requests(s, PROMPTS, MAX)
    assert [out[str(i)] for i in range(3)] == refs(s, PROMPTS, MAX)
    st = s.stats.as_dict()
    if family == "qwen3_5":  # accepted and rejected drafts: the hybrid rollback and the head's own
        assert 0 < st["accepted_tokens"] < st["draft_tokens"]


def test_rows_joining_through_the_native_head(ckpts):
    s = load_session(load_config(overrides={"model": {"model": str(ckpts["qwen3_5"])},
                                            "draft": {"block_size": 3, "policy": "fixed"},
                                            "batch": {"policy": "continuous", "max_batch_size": 8}}), log=quiet_log())
    prompts = PROMPTS + [[2, 44, 45, 46, 47, 48], [2, 1000]]
    maxes = MAX + [12, 15]
    reqs = [make_request(s, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(prompts, maxes))]
    out = drive_with_late_joiners(s, reqs[:3], reqs[3:], join_after=2)
    assert [out[str(i)] for i in range(5)] == refs(s, prompts, maxes)


def test_seeded_sampling_through_the_native_head_equals_target_only(ckpts):
    sps = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_p=0.9, seed=8)]

    def run(s):
        reqs = [make_request(s, p, max_tokens=12, sampling=sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(PROMPTS, sps))]
        out = {r.id: [] for r in reqs}
        for ev in generate_stream(s, reqs):
            out[ev.request_id].extend(ev.tokens)
        return out

    want = run(session(ckpts["qwen3_5"], draft_kind="none"))
    s = session(ckpts["qwen3_5"], 4)
    assert s.draft_kind == "native_mtp"
    assert run(s) == want
    assert s.stats.as_dict()["accepted_tokens"] > 0


def test_zero_centred_norms_convert_unless_the_file_says_mlx(ckpts, tmp_path):
    """``1 + w`` at load; a file whose metadata says ``format: mlx`` is taken as is."""
    src = ckpts["qwen3_5"]
    w = mx.load(str(src / "model.safetensors"))
    stored = w["mtp.pre_fc_norm_embedding.weight"]
    s = session(src)
    assert mx.array_equal(s.drafter.model.layers[0].enorm.weight, stored + 1.0)
    mlx_dir = tmp_path / "mlx_format"
    mlx_dir.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (mlx_dir / f).write_bytes((src / f).read_bytes())
    mx.save_safetensors(str(mlx_dir / "model.safetensors"), w, metadata={"format": "mlx"})
    s2 = session(mlx_dir)
    assert mx.array_equal(s2.drafter.model.layers[0].enorm.weight, stored)


def test_a_stripped_head_is_a_one_line_error_and_no_head_runs_target_only(ckpts, tmp_path):
    cfg = json.loads((ckpts["no_head"] / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1  # the config says a head, the weights lack it
    with pytest.raises(IncompatibleDrafter, match=r"mtp\.fc\.\*.*converter") as e:
        session(ckpts["no_head"], draft_kind="native_mtp")
    assert "\n" not in str(e.value)
    assert session(ckpts["no_head"]).drafter is None  # nothing asked: target-only


def test_the_server_decodes_concurrent_requests_on_a_hybrid(ckpts):
    """``mtpflow serve``'s settings (continuous batching, its default prefix
    cache, turned off for a hybrid with one warning): concurrent completions
    through the native head each equal target-only greedy output."""
    import socket
    import threading
    import time
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    from mtpflow.server import create_app

    cfg = load_config(overrides={"model": {"model": str(ckpts["qwen3_5"])}, "draft": {"block_size": 3},
                                 "batch": {"policy": "continuous", "max_batch_size": 8, "prefix_cache_mb": 256}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        app = create_app(cfg, max_context=256, log=quiet_log())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline and t.is_alive(), "server did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"

        def ask(i):
            body = {"model": ckpts["qwen3_5"].name, "prompt": PROMPTS[i], "max_tokens": MAX[i], "temperature": 0}
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, range(3)))
        s = session(ckpts["qwen3_5"], draft_kind="none")
        want = refs(s, PROMPTS, MAX)
        for g, w in zip(got, want):
            assert g.get("token_ids", None) in (None, w)
        texts = [s.tokenizer.decode(w) for w in want]
        assert [g["text"] for g in got] == texts
    finally:
        srv.should_exit = True
        t.join(20)
        sock.close()
        app.state.scheduler.close()


def _spy_masks(monkeypatch):
    """Record every mask the head's MTP layers get and what they return."""
    from mtpflow.drafters.native_mtp.module import MTPLayer

    seen, call = [], MTPLayer.__call__

    def spy(self, e, h, mask=None, cache=None):
        out = call(self, e, h, mask, cache)
        seen.append((mask, out))
        return out

    monkeypatch.setattr(MTPLayer, "__call__", spy)
    return seen


@pytest.mark.parametrize("depth,block", [(1, 3), (2, 4)])
def test_a_single_row_runs_the_head_without_mask_arrays_and_the_same_as_with_them(ckpts, monkeypatch, depth, block):
    from mtpflow.drafters.native_mtp.qwen import QwenLayout

    prompt, n = PROMPTS[0], 20
    path = ckpts["qwen3_5"] if depth == 1 else build(ckpts["root"], "qwen3_5", seed=0, mtp=True, name="d2", mtp_layers=2,
                                                     **PREDICTABLE)
    runs, seen = {}, _spy_masks(monkeypatch)
    for plain in (False, True):
        monkeypatch.setattr(QwenLayout, "plain_masks", plain)
        seen.clear()
        s = session(path, block)
        assert s.drafter.depth == depth
        outs = []
        for _ in range(2):  # a second generation: the first one's row is dropped, not merged
            s.reset_stats()
            _, out = run_requests(s, [prompt], [n])
            outs.append((out["0"], s.stats.as_dict()["accepted_per_position"]))
        assert outs[0] == outs[1]
        runs[plain] = (outs[0], list(seen))
    (toks, per_pos), masked = runs[False]
    assert toks == refs(session(path, block), [prompt], [n])[0] and sum(per_pos) > 0
    assert runs[True][0] == runs[False][0]  # tokens and acceptance per position
    plain = runs[True][1]
    assert all(isinstance(m, mx.array) for m, _ in masked)
    assert all(m is None or m == "causal" for m, _ in plain) and any(m is None for m, _ in plain)
    assert len(plain) == len(masked)
    for (_, a), (_, b) in zip(masked, plain):
        assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()


def test_padded_and_ragged_rows_still_get_mask_arrays(ckpts, monkeypatch):
    seen = _spy_masks(monkeypatch)
    s = session(ckpts["qwen3_5"], 3)
    assert s.drafter.family.plain_masks
    _, out = run_requests(s, PROMPTS, MAX)
    assert [out[str(i)] for i in range(3)] == refs(s, PROMPTS, MAX)
    assert seen and all(isinstance(m, mx.array) for m, _ in seen)

"""Self-distillation with cached target features (mtpflow.train.features):
the cached hidden states and K/V are the target's own, the cropped query
window gives the same objective as the whole sequence, the cache resumes,
and training from ``distill:`` data lowers the loss."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES

from mtpflow.drafters.mtpflow_assistant.model import GenericAssistantModel
from mtpflow.drafters.mtpflow_assistant.train import drafter_loss, feature_batch, resolve_drafter_config, target_pass
from mtpflow.train.features import collect, generate_features, load_features
from mtpflow.train.run import train
from mtpflow.train.sources import distill_prompts
from mtpflow.train.target import load_tokenizer

PAIR_E = FIXTURES / "pair_e" / "target"
DRAFTER = {"num_hidden_layers": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def prompts(target):
    rng = np.random.default_rng(3)
    return [rng.integers(4, target.vocab_size, size=n).tolist() for n in (5, 11, 8, 3)]


@pytest.fixture(scope="module")
def feats(target, prompts):
    return generate_features(target, prompts, 10, stop_ids=())


def test_features_equal_a_fresh_forward_and_continuation_is_greedy(target, prompts, feats):
    assert [len(e) for e in feats] == [len(p) + 10 for p in prompts]
    for p, e in zip(prompts, feats):
        assert e.tokens[: len(p)].tolist() == p
        assert not e.loss[: len(p)].any() and e.loss[len(p):].all()
        ref = target_pass(target, mx.array(e.tokens[None]))
        H = np.array(ref["hidden"][0])
        scale = np.abs(H).max()
        assert np.abs(H - e.hidden.astype(np.float32)).max() <= 2e-3 * scale  # fp16 storage
        for t, (k, v) in ref["kv"].items():
            for got, want in ((e.kv[t][0], k), (e.kv[t][1], v)):
                want = np.array(want[0])
                assert got.shape == want.shape
                assert np.abs(got.astype(np.float32) - want).max() <= 2e-3 * np.abs(want).max()
        am = np.array(ref["argmax"][0])
        gen = np.arange(len(p) - 1, len(e) - 1)
        assert (am[gen] == e.tokens[gen + 1]).all()  # the continuation is the target's greedy output


def test_a_row_stops_at_its_stop_token(target, prompts, feats):
    stop = int(feats[0].tokens[len(prompts[0]) + 3])  # row 0's 4th generated token
    got = generate_features(target, prompts, 10, stop_ids={stop})
    for p, full, e in zip(prompts, feats, got):
        g = full.tokens[len(p):].tolist()
        n = g.index(stop) + 1 if stop in g else len(g)
        assert e.tokens.tolist() == full.tokens[: len(p) + n].tolist()  # stop token kept, nothing after it
    assert len(got[0]) == len(prompts[0]) + 4


def test_cropped_query_window_gives_the_same_objective(target, feats):
    cfg = resolve_drafter_config(target, DRAFTER)
    mx.random.seed(0)
    model = GenericAssistantModel(cfg, target)
    mx.eval(model.parameters())
    w = mx.array([0.5, 0.3, 0.2])
    idx = [0, 1, 2, 3]
    full, (tk, lm, ln) = feature_batch(feats, idx, target, model)
    crop, (tk2, lm2, ln2) = feature_batch(feats, idx, target, model, unroll=3)
    assert tk2.shape[1] < tk.shape[1]  # the prompt part of the query side was dropped
    a = drafter_loss(model, full, tk, lm, ln, w, 3, "soft")
    b = drafter_loss(model, crop, tk2, lm2, ln2, w, 3, "soft")
    for x, y in zip(a, b):
        assert np.allclose(np.array(x), np.array(y), rtol=1e-4, atol=1e-5), (x, y)
    assert float(a[3].sum()) > 0  # some terms counted
    # and the cached batch is what a live target pass over the same tokens gives
    live = target_pass(target, tk, model)
    c = drafter_loss(model, live, tk, lm, ln, w, 3, "soft")
    for x, y in zip(a, c):
        assert np.allclose(np.array(x), np.array(y), rtol=2e-2, atol=2e-2), (x, y)


def test_collect_resumes_and_refuses_other_settings(target, prompts, tmp_path):
    s1 = collect(target, prompts, tmp_path / "f", max_new=6, batch_size=2, progress=False, stop_ids=())
    assert s1["complete"] and s1["examples"] == 4 and s1["loss_tokens"] == 24
    assert s1["speed"]["tokens_per_s"] > 0 and s1["speed"]["backend"] in ("cpu", "metal", "cuda")
    exs = load_features(tmp_path / "f")
    assert sorted(len(e) for e in exs) == sorted(len(p) + 6 for p in prompts)
    # examples of one shard are views of one array per field, not each a copy of the shard's
    # (per-example copies multiplied the memory by the shard size and ran out of memory)
    a, b = exs[0], exs[1]
    assert a.hidden.base is not None and a.hidden.base is b.hidden.base
    for t in a.kv:
        assert a.kv[t][0].base is b.kv[t][0].base
    s2 = collect(target, prompts, tmp_path / "f", max_new=6, batch_size=2, progress=False, stop_ids=())
    assert s2["examples"] == 0  # every shard was there already
    with pytest.raises(ValueError, match="other settings"):
        collect(target, prompts, tmp_path / "f", max_new=7, batch_size=2, progress=False)
    other = [p[::-1] for p in prompts]  # same count and settings, other prompts: not the cached answers
    with pytest.raises(ValueError, match="other settings or data"):
        collect(target, other, tmp_path / "f", max_new=6, batch_size=2, progress=False, stop_ids=())
    part = collect(target, prompts, tmp_path / "g", max_new=6, batch_size=2, progress=False, max_time_s=0)
    assert not part["complete"] and part["examples"] == 0
    with pytest.raises(FileNotFoundError, match="collect features first"):
        load_features(tmp_path / "nothing")


def test_distill_prompts_use_the_chat_template_or_plain_text(target, tmp_path):
    tok = load_tokenizer(target)
    f = tmp_path / "p.txt"
    f.write_text("beca daka doli bugi base\nbeca daka doli bugi base\nbugi base dana gane bate\n")
    got = distill_prompts(str(f), tok, max_prompt_len=64)
    assert len(got) == 2  # the duplicate line is dropped
    assert all(isinstance(t, int) for t in got[0])
    with pytest.raises(ValueError, match="no prompt"):
        distill_prompts(str(f), tok, max_prompt_len=1)


def _words():
    return (FIXTURES / "prompt_short.txt").read_text().split()


def _prompt_file(path, n: int, rng):
    path.write_text("\n".join(" ".join(rng.choice(_words(), size=6)) for _ in range(n)) + "\n")
    return path


def _first_and_last_loss(out):
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    return np.mean([r["loss"] for r in log[:3]]), np.mean([r["loss"] for r in log[-3:]])


def test_training_on_distilled_features_lowers_the_loss(target, tmp_path):
    f = _prompt_file(tmp_path / "p.txt", 16, np.random.default_rng(0))
    out = tmp_path / "d"
    summary = train(target, DRAFTER, f"distill:{f}", out, steps=24, batch_size=4, unroll=3, warmup=2, lr=3e-3,
                    progress=False, checkpoint_every=100, distill_tokens=16, distill_batch=8, max_len=64)
    assert summary["distill"]["examples"] == 16 and summary["examples"] == 16
    first, last = _first_and_last_loss(out)
    assert last < 0.7 * first, (first, last)
    assert (out / "features" / "meta.json").is_file()


# ------------------------------------------------------------------------------ cache: (teacher-forced)
@pytest.fixture(scope="module")
def texts(target):
    from mtpflow.train.data import Example

    rng = np.random.default_rng(5)
    out = []
    for n, cut in ((12, 4), (7, 2), (16, 9), (5, 1)):
        loss = np.zeros(n, bool)
        loss[cut:] = True
        out.append(Example(rng.integers(4, target.vocab_size, size=n).astype(np.int32), loss))
    return out


@pytest.mark.parametrize("chunk", [None, 4])
def test_text_features_are_a_fresh_forward_with_the_targets_own_argmax(target, texts, chunk):
    from mtpflow.train.features import text_features

    got = text_features(target, texts, chunk)  # rows of different lengths, left-padded together
    for ex, e in zip(texts, got):
        assert e.tokens.tolist() == ex.tokens.tolist() and e.loss.tolist() == ex.loss.tolist()
        ref = target_pass(target, mx.array(ex.tokens[None]))
        H = np.array(ref["hidden"][0])
        assert e.hidden.dtype == np.float16
        assert np.abs(H - e.hidden.astype(np.float32)).max() <= 2e-3 * np.abs(H).max()
        for t, (k, v) in ref["kv"].items():
            want = np.array(k[0])
            assert e.kv[t][0].shape == want.shape
            assert np.abs(e.kv[t][0].astype(np.float32) - want).max() <= 2e-3 * np.abs(want).max()
        # the argmax where the next token carries loss (all the objective reads), -1 elsewhere
        am = np.array(ref["argmax"][0])
        wanted = np.append(ex.loss[1:], False)
        assert e.argmax[wanted].tolist() == am[wanted].tolist() and (e.argmax[~wanted] == -1).all()
        # random text is not the target's greedy output: the stored argmax is not the next token
        assert (am[:-1] != ex.tokens[1:]).any()


def test_chunked_queries_give_the_features_of_one_forward(target, texts):
    from mtpflow.train.features import text_features

    one, chunked = text_features(target, texts, None), text_features(target, texts, 3)
    for a, b in zip(one, chunked):
        assert np.array_equal(a.argmax, b.argmax)
        assert np.abs(a.hidden.astype(np.float32) - b.hidden.astype(np.float32)).max() <= 1e-2
        for t in a.kv:
            assert np.abs(a.kv[t][1].astype(np.float32) - b.kv[t][1].astype(np.float32)).max() <= 1e-2


def test_a_collection_cut_short_and_resumed_gives_the_cache_of_one_run(target, texts, tmp_path, monkeypatch):
    import mtpflow.train.features as fm

    many = [type(e)(np.roll(e.tokens, k), e.loss) for k in range(3) for e in texts]  # 12 examples, 6 shards
    fm.collect_text(target, many, tmp_path / "whole", batch_size=2, progress=False)
    real, calls = fm.text_features_async, []

    def dies_at_the_fourth_batch(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # stopped while the 4th batch is queued (the 3rd, computing, is lost)
        return real(*a, **k)

    monkeypatch.setattr(fm, "text_features_async", dies_at_the_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        fm.collect_text(target, many, tmp_path / "cut", batch_size=2, progress=False)
    monkeypatch.setattr(fm, "text_features_async", real)
    written = sorted(p.name for p in (tmp_path / "cut").glob("shard-*.npz"))
    assert len(written) == 2 and not list((tmp_path / "cut").glob("*.tmp*"))  # finished shards only, whole
    s = fm.collect_text(target, many, tmp_path / "cut", batch_size=2, progress=False)
    assert s["complete"] and s["examples"] == 8  # the other four shards
    names = sorted(p.name for p in (tmp_path / "whole").glob("shard-*.npz"))
    assert sorted(p.name for p in (tmp_path / "cut").glob("shard-*.npz")) == names
    for name in names:
        with np.load(tmp_path / "whole" / name) as a, np.load(tmp_path / "cut" / name) as b:
            assert a.files == b.files
            for k in a.files:
                assert np.array_equal(a[k], b[k]), (name, k)
    # a damaged shard is one line naming it and what to do
    (tmp_path / "cut" / names[0]).write_bytes(b"PK\x03\x04 cut")
    with pytest.raises(ValueError, match=f"{names[0]}: unreadable feature shard.*delete it and rerun"):
        load_features(tmp_path / "cut")


def test_the_collection_benchmark_runs_on_the_tiny_target(capsys):
    from mtpflow.train.features import main

    assert main(["--bench", "--target", str(PAIR_E), "--batch-size", "2", "--max-len", "24", "--batches", "2",
                 "--rounds", "1"]) == 0
    out, err = capsys.readouterr()
    r = json.loads(out)
    assert r["tokens"] == 96 and r["backend"] in ("cpu", "metal", "cuda")
    for k in ("collect", "collect_pipelined", "one_forward", "mlx_lm_forward"):
        assert r[k]["tokens_per_s"] > 0, k
        assert k in err


def test_cached_text_batch_labels_the_targets_argmax_not_the_text(target, texts, tmp_path, capsys):
    from mtpflow.train.features import collect_text

    s = collect_text(target, texts, tmp_path / "c", batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "text features [" in err and "tok/s through the target" in err, err
    assert s["complete"] and s["examples"] == 4 and s["loss_tokens"] == sum(int(e.loss.sum()) for e in texts)
    feats = load_features(tmp_path / "c")
    assert all(f.argmax is not None for f in feats)  # the argmax went through the shard
    cfg = resolve_drafter_config(target, DRAFTER)
    mx.random.seed(0)
    model = GenericAssistantModel(cfg, target)
    mx.eval(model.parameters())
    idx = [0, 1, 2, 3]
    tp, (tk, lm, ln) = feature_batch(feats, idx, target, model, unroll=2)
    # every label position's argmax is the target's (a live pass), crop offset included
    lens, q0, am = np.array(ln), np.array(tp["qpos"])[:, 0], np.array(tp["argmax"])
    for r in range(4):
        f = feats[idx[r]]
        want = np.array(target_pass(target, mx.array(f.tokens[None]))["argmax"])[0, q0[r]:]
        wanted = np.append(f.loss[1:], False)[q0[r]:]
        got = am[r, : lens[r] - q0[r]]
        assert wanted.any() and got[wanted].tolist() == want[wanted].tolist() and (got[~wanted] == -1).all()
    w = mx.array([0.6, 0.4])
    a = drafter_loss(model, tp, tk, lm, ln, w, 2, "hard")
    full, (tk2, lm2, ln2) = feature_batch(feats, idx, target, model)
    c = drafter_loss(model, target_pass(target, tk2, model), tk2, lm2, ln2, w, 2, "hard")
    for x, y in zip(a, c):  # hard targets use the argmax: cached == live
        assert np.allclose(np.array(x), np.array(y), rtol=2e-2, atol=2e-2), (x, y)
    # resumable, and refuses other examples with the same count
    assert collect_text(target, texts, tmp_path / "c", batch_size=2, progress=False)["examples"] == 0
    other = [type(e)(e.tokens[::-1].copy(), e.loss) for e in texts]
    with pytest.raises(ValueError, match="other settings or data"):
        collect_text(target, other, tmp_path / "c", batch_size=2, progress=False)


def test_training_on_distilled_and_cached_data_together(target, tmp_path):
    rng = np.random.default_rng(1)
    f = _prompt_file(tmp_path / "p.txt", 8, rng)
    words = _words()
    g = tmp_path / "chat.jsonl"
    g.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": " ".join(rng.choice(words, size=4))},
                                                    {"role": "assistant", "content": " ".join(rng.choice(words, size=12))}]})
                           for _ in range(8)) + "\n")
    out = tmp_path / "d"
    summary = train(target, DRAFTER, f"distill:{f},cache:{g}", out, steps=24, batch_size=4, unroll=2, warmup=2,
                    lr=3e-3, progress=False, checkpoint_every=100, distill_tokens=12, distill_batch=8, max_len=64)
    assert summary["distill"]["examples"] == 8 and summary["cache"]["examples"] == 8 and summary["examples"] == 16
    assert (out / "features-cache" / "meta.json").is_file() and (out / "features" / "meta.json").is_file()
    first, last = _first_and_last_loss(out)
    assert last < 0.8 * first, (first, last)


def test_feature_data_specs_are_checked(target, tmp_path):
    from mtpflow.train.data import DataError

    with pytest.raises(DataError, match="mixes cached-feature parts"):
        train(target, DRAFTER, "distill:sharegpt:4,sharegpt:4", tmp_path / "x", steps=1, progress=False)
    with pytest.raises(DataError, match="at most one"):
        train(target, DRAFTER, "cache:a.txt,cache:b.txt", tmp_path / "y", steps=1, progress=False)
    g = tmp_path / "chat.jsonl"
    g.write_text(json.dumps({"messages": [{"role": "user", "content": "beca daka"},
                                          {"role": "assistant", "content": "doli bugi base dana"}]}) + "\n")
    with pytest.raises(DataError, match="no features collected yet"):  # a zero time limit on an empty folder
        train(target, DRAFTER, f"cache:{g}", tmp_path / "z", steps=1, progress=False, cache_time_s=0)


# ------------------------------------------------------------------------------ one cache for every kind
E3_TARGET = FIXTURES.parent / "eagle3" / "target"  # a tiny llama every kind trains on
SHARED_KINDS = {"eagle3": {"draft_vocab_size": 256}, "dflash": {"block_size": 4, "num_hidden_layers": 1},
                "mtp": {"depth": 2}}


def _kind_settings(kind, cache_dir, **kw):
    return dict(batch_size=8, lr=3e-3, warmup=2, checkpoint_every=100, progress=False, kind=kind, unroll=2, anchors=4,
                targets="hard", max_len=64, cache_dir=str(cache_dir), **kw)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One ``cache:`` folder collected once with the layers of EAGLE-3 and DFlash
    (the MTP kind reads the hidden state every folder holds)."""
    from mtpflow.train.run import tap_layers
    from mtpflow.train.target import load_target

    target = load_target(E3_TARGET)
    union = sorted({t for k in ("eagle3", "dflash") for t in tap_layers(k, target, SHARED_KINDS[k])})
    root = tmp_path_factory.mktemp("shared")
    s = train(E3_TARGET, SHARED_KINDS["mtp"], "cache:selfgen:16:40", root / "first",
              **_kind_settings("mtp", root / "cache", steps=1, cache_taps=tuple(union)))
    assert s["cache"]["examples"] == 16
    return root / "cache", union, target


def test_kinds_share_one_compact_cache_and_never_run_the_target(shared_cache, tmp_path, monkeypatch):
    import mtpflow.train.features as fm
    import mtpflow.train.target as target_mod
    from mtpflow.train.run import tap_layers

    folder, union, target = shared_cache
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["taps"] == union and meta["kv"] == {}  # only what the kinds read: no store-layer K/V
    with np.load(sorted(folder.glob("shard-*.npz"))[0]) as z:
        assert sorted(k for k in z.files if k.startswith("tap")) == sorted(f"tap_{t}" for t in union)
        assert not [k for k in z.files if k[:2] in ("k_", "v_")]
        assert all(z[k].dtype == np.float16 for k in z.files if k.startswith("tap") or k == "hidden")
    forwards, real = [], target_mod.target_states
    monkeypatch.setattr(target_mod, "target_states", lambda *a, **k: forwards.append(1) / 0)
    monkeypatch.setattr(fm, "text_features_async", lambda *a, **k: forwards.append(1) / 0)
    for kind, opts in SHARED_KINDS.items():
        s = train(E3_TARGET, opts, "cache:selfgen:16:40", tmp_path / kind, **_kind_settings(kind, folder, steps=2))
        assert s["cache"]["examples"] == 0 and s["steps"] == 2, kind  # nothing collected again
    assert forwards == []
    # a kind's subset is the target's own layers, in the kind's order (float16)
    taps = tap_layers("dflash", target, SHARED_KINDS["dflash"])
    f = load_features(folder, taps=taps[::-1], kv=False)[0]
    hidden, got = real(target, mx.array(f.tokens[None].astype(np.int32)), taps[::-1])
    want = np.concatenate([np.array(got[t][0]) for t in taps[::-1]], axis=-1)
    assert f.taps.shape == want.shape and np.abs(f.taps.astype(np.float32) - want).max() <= 2e-3 * np.abs(want).max()
    assert np.abs(f.hidden.astype(np.float32) - np.array(hidden[0])).max() <= 2e-3 * np.abs(np.array(hidden[0])).max()
    # a layer the folder lacks, or K/V it never kept, is refused with what to do
    with pytest.raises(ValueError, match="--cache-taps"):
        load_features(folder, taps=[0])
    with pytest.raises(ValueError, match="without the store-layer K/V"):
        load_features(folder, kv=True)


@pytest.mark.parametrize("kind", sorted(SHARED_KINDS))
def test_a_run_resumed_from_the_cache_equals_an_uninterrupted_one(kind, shared_cache, tmp_path):
    folder, _, _ = shared_cache
    opts = SHARED_KINDS[kind]
    train(E3_TARGET, opts, "cache:selfgen:16:40", tmp_path / "a", **_kind_settings(kind, folder, steps=5))
    train(E3_TARGET, opts, "cache:selfgen:16:40", tmp_path / "b", **_kind_settings(kind, folder, steps=5, stop_at=2))
    train(E3_TARGET, opts, "cache:selfgen:16:40", tmp_path / "b", **_kind_settings(kind, folder, steps=5))
    a, b = ([json.loads(x)["loss"] for x in (tmp_path / d / "train_log.jsonl").read_text().splitlines()] for d in "ab")
    assert len(a) == len(b) == 5 and np.allclose(a, b, rtol=0, atol=1e-6), (a, b)


def test_the_mtp_kind_from_the_cache_trains_as_from_the_target(shared_cache, tmp_path):
    """Cached hidden states (float16) and the cached argmax as hard labels give
    the losses of a run that runs the target per batch (up to float16)."""
    folder, _, _ = shared_cache
    opts = SHARED_KINDS["mtp"]
    train(E3_TARGET, opts, "cache:selfgen:16:40", tmp_path / "c", **_kind_settings("mtp", folder, steps=2))
    train(E3_TARGET, opts, "selfgen:16:40", tmp_path / "t", **_kind_settings("mtp", folder, steps=2))
    c, t = ([json.loads(x)["loss"] for x in (tmp_path / d / "train_log.jsonl").read_text().splitlines()] for d in "ct")
    assert np.allclose(c, t, rtol=1e-2), (c, t)


@pytest.mark.parametrize("targets", ["soft", "hard"])
@pytest.mark.parametrize("vocab", [None, 64])
def test_the_step_terms_equal_a_plain_shifted_reference(target, feats, targets, vocab):
    """``drafter_loss_terms`` reads each step's labels as views ``1 + i`` positions on; written out
    here with plain ops over whole shifted rows: step ``i``'s logits at ``t`` against the target's
    distribution (or greedy token) of ``x_{t+2+i}``, where ``t + 2 + i`` is a loss position, over
    the full vocabulary or a draft vocabulary (hard terms only where the token is in it)."""
    from mtpflow.drafters.mtpflow_assistant.train import drafter_loss_terms, identity_init, unrolled_logits
    from mtpflow.train.objective import shift

    cfg = resolve_drafter_config(target, {**DRAFTER, **({"draft_vocab_size": vocab} if vocab else {})})
    mx.random.seed(1)
    model = GenericAssistantModel(cfg, target)
    identity_init(model)  # a drafter that hits: the accuracy counts are compared on hits, not zeros
    mx.eval(model.parameters())
    tp, (tk, lm, ln) = feature_batch(feats, [0, 1, 2, 3], target, model)
    got = drafter_loss_terms(model, tp, tk, lm, ln, 3, targets)
    B, T = tk.shape
    lab = tp["label_logits"].astype(mx.float32)
    lab = lab - mx.logsumexp(lab, axis=-1, keepdims=True)
    sub = model.draft_vocab if vocab else None
    want = [], [], []
    for i, x in enumerate(unrolled_logits(model, tp, T, 3)):
        logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        valid = (mx.arange(T)[None] + 2 + i < ln[:, None]) & shift(lm, 2 + i)
        tgt = shift(tp["argmax"], 1 + i)
        pred = mx.argmax(x, axis=-1) if sub is None else sub[mx.argmax(x, axis=-1)]
        if targets == "soft":
            q = shift(lab, 1 + i)
            per = (mx.exp(q) * (q - logp)).sum(-1)
        else:
            idx = mx.maximum(tgt, 0) if sub is None else tp["inv"][mx.maximum(tgt, 0)]
            if sub is not None:
                valid = valid & (idx >= 0)
            per = -mx.take_along_axis(logp, mx.maximum(idx, 0)[..., None], axis=-1)[..., 0]
        vf = valid.astype(mx.float32)
        want[0].append((per * vf).sum())
        want[1].append(((pred == tgt) & valid).sum().astype(mx.float32))
        want[2].append(vf.sum())
    for g, w in zip(got, want):
        assert np.allclose(np.array(g), np.array(mx.stack(w)), rtol=1e-4, atol=1e-4), (g, w)
    assert float(got[2].min()) > 0 and float(got[1].sum()) > 0  # terms at every step, and hits

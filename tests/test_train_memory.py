"""The 16 GB recipe at tiny size: training against a quantized frozen target
(``--target-bits``), with gradient accumulation, gradient checkpointing and a
factored optimizer, reports its peak memory and FLOP share, and stays under a
bound computed from the weights and the batch."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpflow.train.run import train
from mtpflow.train.target import load_target
from mtpflow.train.memory import micro_slices, tree_bytes

TGT = Path(__file__).parent / "fixtures" / "eagle3" / "target"
OPTS = {"draft_vocab_size": 256}
B, T, S = 4, 40, 3  # rows, tokens per row (selfgen:8:40), TTT steps
# one lane: two lanes evaluate side by side, and how their activations overlap
# (so the peak) depends on the threads' timing on a busy host
COMMON = dict(kind="eagle3", steps=3, batch_size=B, max_len=T, unroll=S, warmup=0, progress=False,
              checkpoint_every=100, lr=1e-3, lanes=1)


def _run(out, **kw):
    """One run's summary and log; its peak less what the process held when it
    started (an earlier run's arrays, freed only by the cycle collector, would
    otherwise count in the next run's peak)."""
    gc.collect()
    held = mx.get_active_memory()
    s = train(str(TGT), OPTS, "selfgen:8:40", out, **{**COMMON, **kw})
    s["own_peak"] = s["train_speed"]["peak_memory"]["mlx_peak_bytes"] - held
    log = [json.loads(x) for x in (Path(out) / "train_log.jsonl").read_text().splitlines()]
    return s, log


def _bound(target, drafter_bytes, micro_rows):
    """What the run may hold at its peak: the quantized target's weights; the
    drafter's weights, gradients and (at most) two optimizer moments, plus one
    copy in flight; and the activations of one micro-batch -- for each token the
    target's taps and one layer's attention scores, and per TTT step the draft
    logits, the layer's activations and its attention scores -- kept for the
    backward pass (x2), in float32; plus 4 MiB for MLX's allocator rounding."""
    tc = target.config
    H, L, heads = tc["hidden_size"], tc["num_hidden_layers"], tc["num_attention_heads"]
    K = OPTS["draft_vocab_size"]
    per_token = (L + 1) * H + heads * T + S * (K + 8 * H + heads * T * S)
    act = 4 * 2 * micro_rows * T * per_token
    return tree_bytes(target.model.parameters()) + 5 * drafter_bytes + act + 4 * 2**20


def test_quantized_target_training_stays_under_its_memory_bound(tmp_path):
    fp = load_target(TGT)
    q4 = load_target(TGT, 4)
    w_fp, w_q = tree_bytes(fp.model.parameters()), tree_bytes(q4.model.parameters())
    assert w_q < 0.2 * w_fp  # 4-bit weights (+ float32 norms and group scales)
    s_fp, _ = _run(tmp_path / "fp")
    s_q, log_q = _run(tmp_path / "q4", target_bits=4)
    s_b, log_b = _run(tmp_path / "budget", target_bits=4, grad_accum=2, grad_checkpoint=True)
    s_f, log_f = _run(tmp_path / "factored", target_bits=4, grad_accum=2, grad_checkpoint=True, optimizer="adafactor")
    peaks = {k: s["own_peak"] for k, s in
             (("fp", s_fp), ("q4", s_q), ("budget", s_b), ("factored", s_f))}
    for s in (s_fp, s_q, s_b, s_f):  # reported next to the FLOP share of the measured matmul rate
        f = s["train_speed"]["flops"]
        assert f["matmul_rate_gflops"] > 0 and f["share_of_matmul"] > 0 and f["last_step_gflop"]["target_forward"] > 0
        g = f["last_step_gflop"]  # EAGLE-3's head is the target's rows, frozen: backward once
        assert 0 < g["frozen_weight_forward"] < g["drafter_forward"]
        assert abs(g["total"] - (3 * g["drafter_forward"] - g["frozen_weight_forward"] + g["target_forward"])) < 1e-3
        assert s["train_speed"]["peak_memory"]["rss_peak_gb"] > 0
    # the quantized target's weights saving shows in the peak
    assert peaks["fp"] - peaks["q4"] > 0.5 * (w_fp - w_q), peaks
    # accumulation (2 micro-batches) and checkpointing change the memory, not the numbers
    for a, b in zip(log_q, log_b):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * max(1.0, a["grad_norm"]), (a, b)
    assert peaks["budget"] < peaks["q4"], peaks
    # the factored optimizer keeps a fraction of AdamW's state, and trains
    opt_b = (tmp_path / "budget" / "checkpoint" / "optimizer.safetensors").stat().st_size
    opt_f = (tmp_path / "factored" / "checkpoint" / "optimizer.safetensors").stat().st_size
    assert opt_f < 0.1 * opt_b and log_f[-1]["loss"] < log_f[0]["loss"]
    drafter = (tmp_path / "factored" / "checkpoint" / "model.safetensors").stat().st_size
    bound = _bound(q4, drafter, B // 2)
    assert peaks["factored"] <= bound, (peaks, bound)


def test_budget_settings_are_checked():
    with pytest.raises(ValueError, match="adafactor"):
        train(str(TGT), OPTS, "selfgen:8:40", "/nonexistent", optimizer="adam8bit", **COMMON)
    with pytest.raises(ValueError, match="4 or 8"):
        train(str(TGT), OPTS, "selfgen:8:40", "/nonexistent", target_bits=3, **COMMON)
    with pytest.raises(ValueError, match="at most 4"):
        micro_slices(slice(0, 4), 5)
    assert micro_slices(slice(2, 7), 2) == [slice(2, 4), slice(4, 7)]
    import mlx.nn as nn

    from mtpflow.train.memory import checkpoint_layers

    bare = nn.Module()
    bare.layers = [nn.Linear(4, 4)]
    with pytest.raises(ValueError, match="train without --grad-checkpoint"):
        checkpoint_layers(bare)  # nothing to recompute: an error, not a silent no-op


def test_checkpointing_twice_wraps_once():
    """A second ``checkpoint_layers`` call leaves what the first wrapped as it is (one recomputation
    per block, not two nested), for an MLP and for a layer's ``checkpoint_methods``; a user's class
    whose name happens to start with ``Checkpointed`` is still wrapped."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mtpflow.train.memory import checkpoint_layers

    class CheckpointedLookingMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(4, 4)

        def __call__(self, x):
            return self.up(x)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = CheckpointedLookingMLP()

        def __call__(self, x):
            return self.mlp(x)

    class MethodLayer(nn.Module):
        checkpoint_methods = ("finish",)

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def finish(self, x):
            return self.proj(x)

    model = nn.Module()
    model.layers = [Layer(), MethodLayer()]
    assert checkpoint_layers(model) == 2
    mlp_cls, finish = type(model.layers[0].mlp), model.layers[1].finish
    assert mlp_cls is not CheckpointedLookingMLP and issubclass(mlp_cls, CheckpointedLookingMLP)
    assert finish is not MethodLayer.finish
    assert checkpoint_layers(model) == 2
    assert type(model.layers[0].mlp) is mlp_cls and model.layers[1].finish is finish
    x = mx.arange(8, dtype=mx.float32).reshape(2, 4)
    plain, method = model.layers
    for layer, call, inner in ((plain, plain, plain.mlp.up), (method, method.finish, method.proj)):
        assert mx.allclose(call(x), inner(x))  # the layer's own values, and its own gradient

        def loss(params, fn):
            layer.update(params)
            return (fn(x) ** 2).sum()

        g_wrapped = mx.grad(loss)(layer.trainable_parameters(), call)
        g_plain = mx.grad(loss)(layer.trainable_parameters(), inner)
        for (k, a), (_, b) in zip(tree_flatten(g_wrapped), tree_flatten(g_plain)):
            assert mx.allclose(a, b), k


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_the_compiled_update_is_the_plain_one(tmp_path, monkeypatch, optimizer):
    """The clipping and optimiser update run compiled (``_Loop._update_fn``); with ``mx.compile``
    made a no-op the same run logs the same losses and gradient norms, and ends with the same
    weights and optimiser step, to float32 rounding; so does ``--chunked-update`` (one parameter
    array at a time; the schedule advances once a step)."""
    from mlx.utils import tree_flatten

    kw = dict(target_bits=4, optimizer=optimizer, steps=4, lr=1e-2)
    _, log_c = _run(tmp_path / "compiled", **kw)
    _, log_k = _run(tmp_path / "chunked", chunked_update=True, **kw)
    monkeypatch.setattr(mx, "compile", lambda fn, *a, **k: fn)
    _, log_p = _run(tmp_path / "plain", **kw)

    def saved(run):
        ck = tmp_path / run / "checkpoint"
        opt = dict(tree_flatten(mx.load(str(ck / "optimizer.safetensors"))))
        return dict(tree_flatten(mx.load(str(ck / "model.safetensors")))), opt

    w_c, o_c = saved("compiled")
    for run, log in (("plain", log_p), ("chunked", log_k)):
        assert len(log) == len(log_c) == 4
        for a, b in zip(log_c, log):
            assert abs(a["loss"] - b["loss"]) <= 1e-6 * max(1.0, abs(a["loss"])), (run, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * max(1.0, a["grad_norm"]), (run, a, b)
            assert a["lr"] == b["lr"], (run, a, b)
        w, o = saved(run)
        assert w.keys() == w_c.keys() and o.keys() == o_c.keys()
        for k in w_c:
            np.testing.assert_allclose(np.array(w[k]), np.array(w_c[k]), rtol=1e-5, atol=1e-6, err_msg=f"{run} {k}")
        step = [k for k in o if k.endswith("step")]
        assert step and all(int(o[k]) == int(o_c[k]) == 4 for k in step), (run, {k: o[k] for k in step})
    assert log_c[-1]["loss"] != log_c[0]["loss"]  # it trained


def test_the_step_flops_count_a_frozen_weights_backward_once():
    """``count_matmuls`` counts every product built inside; the products by a weight the gradient is
    not taken of (a frozen head) count again in ``frozen``, as their backward has no weight
    gradient, and a training step's total is ``3 x forward - frozen + target``."""
    import mlx.nn as nn

    from mtpflow.train.flops import Throughput, count_matmuls

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 16, bias=False)
            self.head = nn.Linear(16, 32, bias=False)
            self.head.freeze()

        def __call__(self, x):
            return self.head(self.body(x))

    m = Two()
    x = mx.ones((5, 8))
    seen = {}

    def loss(model, x):
        count_matmuls.trained(model.trainable_parameters())
        return model(x).sum()

    with count_matmuls() as c:
        nn.value_and_grad(m, loss)(m, x)
        seen["grad"] = (c.flops, c.frozen)
    with count_matmuls() as plain:  # never told what is trained: all of it
        m(x)
    assert seen["grad"] == (2 * 5 * (8 * 16 + 16 * 32), 2 * 5 * 16 * 32)
    assert plain.flops == seen["grad"][0] and plain.frozen == 0
    t = Throughput(None)
    t.add(c.flops, 100, 1.0, c.frozen)
    assert t.flops == 3 * c.flops - c.frozen + 100
    assert t.summary()["last_step_gflop"]["frozen_weight_forward"] == round(c.frozen / 1e9, 4)
    # checkpointed, the trained body runs on the transform's copies of its weights: still trained,
    # and its recomputation in the backward counts apart, outside the step's total
    from mtpflow.train.memory import checkpointed

    class Checkpointed(Two):
        def __call__(self, x):
            return self.head(checkpointed(self.body, self.body)(x))

    ck_m = Checkpointed()
    with count_matmuls() as ck:
        grads = nn.value_and_grad(ck_m, loss)(ck_m, x)[1]
    assert (ck.flops, ck.frozen, ck.recomputed) == (*seen["grad"], 2 * 5 * 8 * 16)
    assert float(mx.abs(grads["body"]["weight"]).sum()) > 0
    # a weight made while counting (a head's rows taken per batch) never passes for a trained
    # array freed before it: the arrays named trained stay alive while the counter counts
    x4 = mx.ones((1, 4))
    with count_matmuls() as fresh:
        for _ in range(50):
            count_matmuls.trained({"w": mx.zeros((4, 4))})
            rows = nn.Linear(4, 4, bias=False)
            rows(x4)
    assert fresh.frozen == fresh.flops == 50 * 2 * 4 * 4


KIND_OPTS = {"eagle3": OPTS, "dflash": {"block_size": 4, "num_hidden_layers": 1}, "mtp": None,
             "assistant": {"num_hidden_layers": 1}}


@pytest.mark.parametrize("kind", sorted(KIND_OPTS))
def test_gradient_checkpointing_recomputes_in_every_kind(tmp_path, kind):
    """``--grad-checkpoint`` recomputes a part of the drafter's layer in every kind (EAGLE-3's
    training-time-test steps, whose layer training calls through ``finish_ttt``; an MTP layer's
    block), shown by the products the backward builds again (``recomputed_forward``), with the
    same losses and gradient norms, and the same model FLOPs, as without it."""
    kw = dict(COMMON, kind=kind, steps=2, anchors=4)
    runs = {}
    for ck in (False, True):
        s = train(str(TGT), KIND_OPTS[kind], "selfgen:8:40", tmp_path / str(ck), grad_checkpoint=ck, **kw)
        log = [json.loads(x) for x in (tmp_path / str(ck) / "train_log.jsonl").read_text().splitlines()]
        runs[ck] = (s["train_speed"]["flops"]["last_step_gflop"], log)
    (g_off, log_off), (g_on, log_on) = runs[False], runs[True]
    assert g_off["recomputed_forward"] == 0 and g_on["recomputed_forward"] > 0, (g_off, g_on)
    for k in ("drafter_forward", "frozen_weight_forward", "target_forward", "total"):
        assert g_on[k] == g_off[k], (k, g_off, g_on)
    for a, b in zip(log_off, log_on):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * max(1.0, a["grad_norm"]), (a, b)


def test_a_memory_budget_defaults_to_one_lane(tmp_path):
    """With ``--grad-checkpoint`` or ``--chunked-update`` the device's default lanes (``lanes=0``)
    become one (two lanes hold their parts' activations side by side); asked for, two run."""
    kw = dict(COMMON, steps=1, lanes=0)
    got = {}
    for name, extra in (("default", {}), ("ck", {"grad_checkpoint": True}), ("chunked", {"chunked_update": True}),
                        ("asked", {"chunked_update": True, "lanes": 2})):
        s = train(str(TGT), OPTS, "selfgen:8:40", tmp_path / name, **{**kw, **extra})
        got[name] = s["train_speed"]["lanes"]
    from mtpflow.train.lanes import lane_count

    assert got == {"default": lane_count(0, B), "ck": 1, "chunked": 1, "asked": 2}

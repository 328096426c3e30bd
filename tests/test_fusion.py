"""mtpflow.backend.fusion: fused RMSNorm / RoPE and lean linear layers give mlx-lm's values bit for bit, with fewer graph nodes."""

import io
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma4_text
from mlx_lm.models.rope_utils import initialize_rope

from conftest import FIXTURES, prompt
from mtpflow.backend import fusion


def bits(a):
    return np.array(a.astype(mx.float32) if a.dtype != mx.float32 else a).view(np.uint32)


def _dot(*outs) -> str:
    f = io.StringIO()
    mx.export_to_dot(f, *outs)
    return f.getvalue()


def nodes(*outs) -> int:
    return len(re.findall(r'label\s*=\s*"[A-Za-z]+', _dot(*outs)))


def fused_and_stock(module, *args, **kwargs):
    """``(stock output, fused output)`` of one module called on the same inputs."""
    assert fusion.unfuse(module) == 0
    want = module(*args, **kwargs)
    assert fusion.fuse(module) == 1
    try:
        got = module(*args, **kwargs)
    finally:
        assert fusion.unfuse(module) == 1
    mx.eval(want, got)
    return want, got


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 128), (3, 7, 64), (2, 4, 5, 32)])
def test_rms_norm_bits(dtype, shape):
    mx.random.seed(1)
    norm = nn.RMSNorm(shape[-1], eps=1e-6)
    norm.weight = (mx.random.normal((shape[-1],)) * 0.5 + 1).astype(dtype)
    x = (mx.random.normal(shape) * 3).astype(dtype)
    want, got = fused_and_stock(norm, x)
    assert got.dtype == want.dtype
    assert (bits(got) == bits(want)).all()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_gemma_offset_rms_norm_bits(dtype):
    """Gemma 1-3's norms scale by 1 + weight."""
    from mlx_lm.models import gemma3_text

    norm = gemma3_text.RMSNorm(64, eps=1e-6)
    norm.weight = (mx.random.normal((64,), key=mx.random.key(9)) * 0.3).astype(dtype)
    x = (mx.random.normal((2, 5, 64), key=mx.random.key(10)) * 4).astype(dtype)
    want, got = fused_and_stock(norm, x)
    assert got.dtype == want.dtype
    assert (bits(got) == bits(want)).all()


def test_rms_norm_no_scale_bits():
    norm = gemma4_text.RMSNormNoScale(64, eps=1e-6)
    x = mx.random.normal((2, 3, 4, 64), key=mx.random.key(2)) * 5
    want, got = fused_and_stock(norm, x)
    assert (bits(got) == bits(want)).all()


def test_rms_norm_follows_new_weights_and_mixed_dtypes():
    """The fused norm reads the module's weight at each call (no stale constant),
    and a call with another dtype than the weight's runs mlx-lm's code."""
    norm = nn.RMSNorm(16)
    fusion.fuse(norm)
    x = mx.random.normal((1, 2, 16), key=mx.random.key(3))
    a = norm(x)
    norm.update({"weight": mx.full((16,), 2.0)})
    b = norm(x)
    assert mx.allclose(b, 2 * a).item()
    h = norm(x.astype(mx.float16))  # weight float32: result_type float32, as mlx-lm's
    assert h.dtype == mx.float32
    assert mx.allclose(h, mx.fast.rms_norm(x.astype(mx.float16), norm.weight, norm.eps)).item()


@pytest.mark.parametrize("bias", [False, True])
def test_linear_bits_and_new_weights(bias):
    lin = nn.Linear(64, 48, bias=bias)
    x = mx.random.normal((2, 3, 64), key=mx.random.key(7))
    want, got = fused_and_stock(lin, x)
    assert (bits(got) == bits(want)).all()
    fusion.fuse(lin)
    lin(x)
    lin.update({"weight": lin.weight * 2})  # a new weight gets its own transpose
    assert mx.allclose(lin(x), (x @ lin.weight.T) + (lin.bias if bias else 0)).item()


def test_tied_embedding_head_bits():
    emb = nn.Embedding(300, 32)
    h = mx.random.normal((1, 2, 32), key=mx.random.key(8))
    assert fusion.fuse(emb) == 1
    got, ids = emb.as_linear(h), emb(mx.array([[3, 299]]))
    fusion.unfuse(emb)
    want, ids0 = emb.as_linear(h), emb(mx.array([[3, 299]]))
    assert (bits(got) == bits(want)).all() and (bits(ids) == bits(ids0)).all()


ROPES = {
    "default": (64, 10000.0, None),
    "partial": (32, 10000.0, None),
    "llama3": (64, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "yarn": (64, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}),
    "proportional": (64, 1000000.0, {"rope_type": "proportional", "partial_rotary_factor": 0.25}),
    "longrope": (64, 10000.0, {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                               "short_factor": [1.0] * 32, "long_factor": [1.5] * 32}),
}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_bits(kind, traditional, dtype):
    dims, base, scaling = ROPES[kind]
    rope = initialize_rope(dims, base, traditional, scaling, 131072)
    x = (mx.random.normal((2, 4, 3, 64), key=mx.random.key(4)) * 3).astype(dtype)
    # one offset per row (mtpflow's caches), one for every row, and a one-position step
    for offset, q in ((mx.array([5, 9000], dtype=mx.int32), x), (mx.array([77], dtype=mx.int32), x),
                      (mx.array([6, 9001], dtype=mx.int32), x[:, :, :1])):
        want, got = fused_and_stock(rope, q, offset=offset)
        assert got.dtype == want.dtype and (bits(got) == bits(want)).all(), offset
    # the plain kinds went through the shared table
    assert (fusion._rope_spec(rope) in rope_table()) == (kind not in ("yarn", "longrope"))
    # an int offset (mlx-lm's own caches) takes the original code and agrees too
    want, got = fused_and_stock(rope, x, 17)
    assert (bits(got) == bits(want)).all()


def rope_table():
    """This thread's table entries, ``{spec: (offset, T, dtype, stream, cos, sin)}``."""
    return fusion._rope_tables.__dict__.setdefault("by_spec", {})


def test_rope_layers_share_one_table():
    """The layers of a forward (RoPE modules of one spec, one offset array) rotate by one
    cos / sin table: after the first layer's call only the rotation is new; a new offset
    array, another position count or dtype, or another spec computes its own; a thread
    keeps its own tables (training lanes build graphs side by side)."""
    import threading

    ropes = [nn.RoPE(64, base=10000.0) for _ in range(3)] + [nn.RoPE(64, base=500.0)]
    for r in ropes:
        fusion.fuse(r)
    q = mx.random.normal((1, 4, 2, 64), key=mx.random.key(20))
    k = mx.random.normal((1, 2, 2, 64), key=mx.random.key(21))
    mx.eval(q, k)
    off = mx.array([40], dtype=mx.int32)
    first = ropes[0](q, offset=off)
    mx.eval(first)
    entry = rope_table()[fusion._rope_spec(ropes[0])]
    assert entry[0] is off
    later = [ropes[1](k, offset=off), ropes[2](q, offset=off)]
    assert rope_table()[fusion._rope_spec(ropes[0])] is entry  # no new table
    assert all(nodes(o) <= 5 for o in later), [nodes(o) for o in later]  # slices, the rotation, the join
    assert fusion._rope_spec(ropes[3]) != fusion._rope_spec(ropes[0])
    other = ropes[3](q, offset=off)
    assert rope_table()[fusion._rope_spec(ropes[0])] is entry
    for r, x, got in ((ropes[1], k, later[0]), (ropes[2], q, later[1]), (ropes[3], q, other)):
        with fusion.stock(r):
            want = r(x, offset=off)
        assert (bits(got) == bits(want)).all()
    # a new offset array (the next forward), a 1-position input, a float16 input: new tables, right values
    for x, o in ((q, mx.array([41], dtype=mx.int32)), (q[:, :, :1], off), (q.astype(mx.float16), off)):
        got = ropes[1](x, offset=o)
        assert rope_table()[fusion._rope_spec(ropes[0])] is not entry
        with fusion.stock(ropes[1]):
            want = ropes[1](x, offset=o)
        assert (bits(got) == bits(want)).all()
    entry = rope_table()[fusion._rope_spec(ropes[0])]
    seen = {}

    def lane():
        seen["before"] = dict(rope_table())
        out = ropes[0](q, offset=off)
        mx.eval(out)
        seen["out"], seen["after"] = out, dict(rope_table())

    t = threading.Thread(target=lane)
    t.start()
    t.join()
    assert seen["before"] == {} and seen["after"][fusion._rope_spec(ropes[0])] is not entry
    assert (bits(seen["out"]) == bits(first)).all()
    assert rope_table()[fusion._rope_spec(ropes[0])] is entry


def test_rope_table_only_for_plain_ropes():
    """Yarn and SuScaled RoPE scale ``x`` before rotating: their calls run compiled whole, without a shared table."""
    assert fusion._rope_spec(nn.RoPE(64)) is not None
    for kind in ("llama3", "proportional"):
        dims, base, scaling = ROPES[kind]
        assert fusion._rope_spec(initialize_rope(dims, base, False, scaling, 131072)) is not None
    for kind in ("yarn", "longrope"):
        dims, base, scaling = ROPES[kind]
        assert fusion._rope_spec(initialize_rope(dims, base, False, scaling, 131072)) is None


def test_rope_long_inputs_run_the_original_code():
    """A prefill-sized RoPE input (more than 32 positions) is not traced: no
    compiled function is kept for it, and the values agree."""
    rope = nn.RoPE(64)
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(11))
    off = mx.array([3], dtype=mx.int32)
    want, got = fused_and_stock(rope, x, offset=off)
    assert (bits(got) == bits(want)).all()
    fusion.fuse(rope)
    rope(x, offset=off)
    assert "_mtpflow_fused" not in rope.__dict__
    rope(x[:, :, :4], offset=off)
    assert "_mtpflow_fused" in rope.__dict__


def test_stock_keeps_the_compiled_calls():
    """The bench's baseline rows run inside ``stock()``: the fused rows after
    them reuse the traced RoPE call and the kept transpose, and ``unfuse``
    drops both."""
    rope, lin = nn.RoPE(64), nn.Linear(8, 8)
    x, off = mx.random.normal((1, 2, 1, 64), key=mx.random.key(12)), mx.array([4], dtype=mx.int32)
    for m in (rope, lin):
        fusion.fuse(m)
    rope(x, offset=off)
    lin(mx.ones((1, 8)))
    fn, wt = rope.__dict__["_mtpflow_fused"], lin.__dict__["_mtpflow_wt"]
    with fusion.stock(rope, lin):
        assert type(rope) is nn.RoPE and type(lin) is nn.Linear
    assert rope.__dict__["_mtpflow_fused"] is fn and lin.__dict__["_mtpflow_wt"] is wt
    fusion.unfuse(rope)
    fusion.unfuse(lin)
    assert "_mtpflow_fused" not in rope.__dict__ and "_mtpflow_wt" not in lin.__dict__


def test_fewer_nodes():
    """The point of fusing: a norm, a RoPE (a later layer's, whose table the first
    computed) and a batch-1 linear layer submit far fewer graph nodes."""
    norm = nn.RMSNorm(128)
    rope = nn.RoPE(64)
    lin = nn.Linear(128, 128, bias=False)
    x = mx.random.normal((1, 1, 128), key=mx.random.key(5))
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(6))
    mx.eval(x, q, norm.parameters(), lin.parameters())
    off = mx.array([11], dtype=mx.int32)
    stock = nodes(norm(x)), nodes(rope(q, offset=off)), nodes(lin(x))
    for m in (norm, rope, lin):
        fusion.fuse(m)
    mx.eval(lin(x), rope(q, offset=off))  # the first calls compute the kept transpose and the table
    fused = nodes(norm(x)), nodes(rope(q, offset=off)), nodes(lin(x))
    assert fused[0] <= stock[0] // 3, (stock, fused)
    assert fused[1] <= stock[1] // 4, (stock, fused)
    assert fused[2] == 1 and stock[2] == 4, (stock, fused)  # Matmul; stock: Transpose, Flatten, Matmul, Unflatten


@pytest.mark.parametrize("rows", [1, 3])
def test_batch_one_linear_is_one_node(rows):
    """A ``[1, T, K]`` input is multiplied by the kept transpose with a leading axis (one
    ``Matmul``, no ``Flatten`` / ``Unflatten``); wider batches keep the 2-D product.  Same bits."""
    lin = nn.Linear(96, 40, bias=False)
    x = mx.random.normal((rows, 5, 96), key=mx.random.key(22))
    mx.eval(x, lin.parameters())
    want = lin(x)
    fusion.fuse(lin)
    mx.eval(lin(x))
    got = lin(x)
    labels = re.findall(r'label\s*=\s*"([A-Za-z]+)', _dot(got))
    assert labels == (["Matmul"] if rows == 1 else ["Flatten", "Matmul", "Unflatten"]), labels
    assert (bits(got) == bits(want)).all()
    lin.weight = lin.weight * 2  # a new weight: a new transpose (both forms)
    assert (bits(lin(x)) == bits(want * 2)).all()


def test_fuse_keeps_parameters_and_classes():
    from mtpflow.targets.gemma4 import Gemma4Target

    t = Gemma4Target.from_path(FIXTURES / "pair_e" / "target")
    before = {k: v for k, v in tree_flatten(t.model.parameters())}
    n = fusion.fuse(t.model)
    assert n > 0 and fusion.is_fused(t.model)
    assert fusion.fuse(t.model) == 0  # already fused
    after = {k: v for k, v in tree_flatten(t.model.parameters())}
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert isinstance(t.model.model.norm, nn.RMSNorm)
    with fusion.stock(t.model):
        assert not fusion.is_fused(t.model)
        assert type(t.model.model.norm) is nn.RMSNorm
    assert fusion.is_fused(t.model)
    assert fusion.unfuse(t.model) == n and not fusion.is_fused(t.model)


def test_fused_target_forward_bits():
    """A ragged prefill and decode steps of the fixture target: the same bits fused and not."""
    from mtpflow.targets.gemma4 import Gemma4Target

    t = Gemma4Target.from_path(FIXTURES / "pair_e" / "target")
    seqs = [prompt("e", "long"), prompt("e", "short")]

    def run():
        cache, h = t.prefill(seqs)
        outs = [h]
        for i in range(20):  # past the sliding window (16)
            hidden = t.forward(mx.array([[5 + i], [7 + i]]), cache)
            outs.append(t.logits(hidden))
        mx.eval(outs)
        return [bits(o) for o in outs]

    want = run()
    fusion.fuse(t.model)
    got = run()
    assert all((a == b).all() for a, b in zip(want, got))


def test_session_fuses_by_config():
    """``[generation] fuse_ops``: "auto" fuses on a CPU device, "off" leaves mlx-lm's modules."""
    from mtpflow.config import load_config
    from mtpflow.engine import fusable_modules, load_session, on_for_device

    from conftest import quiet_log

    def session(mode):
        cfg = load_config(overrides={"model": {"model": str(FIXTURES / "pair_e" / "target"),
                                               "draft_model": str(FIXTURES / "pair_e" / "drafter")},
                                     "generation": {"fuse_ops": mode}})
        return load_session(cfg, log=quiet_log())

    on = session("on")
    mods = fusable_modules(on.target, on.drafter)
    assert len(mods) == 2 and all(fusion.is_fused(m) for m in mods)  # the target and the assistant
    off = session("off")
    assert not any(fusion.is_fused(m) for m in fusable_modules(off.target, off.drafter))
    assert on_for_device("auto") == (mx.default_device() == mx.cpu)


def test_bench_baseline_runs_stock_modules():
    """The bench's mlx_lm rows run mlx-lm as it ships, even on mtpflow's fused model."""
    from mtpflow.bench import MLXLMVariant

    norm = nn.RMSNorm(8)
    fusion.fuse(norm)
    seen = []

    class Probe(MLXLMVariant):
        def _run(self, prompts, max_tokens, collector):
            seen.append(fusion.is_fused(self.model))
            return {}

    Probe("mlx_lm b1", 1, 1, "target_only", norm).run([], 1, None)
    assert seen == [False] and fusion.is_fused(norm)


def test_decoding_matches_unfused():
    """Greedy decoding through the engine, fused and not: the same tokens."""
    from mtpflow.config import load_config
    from mtpflow.engine import generate, load_session

    from conftest import quiet_log

    out = {}
    for mode in ("on", "off"):
        cfg = load_config(overrides={"model": {"model": str(FIXTURES / "pair_e" / "target"),
                                               "draft_model": str(FIXTURES / "pair_e" / "drafter")},
                                     "generation": {"fuse_ops": mode}})
        s = load_session(cfg, log=quiet_log())
        out[mode] = [generate(s, prompt("e", name), max_tokens=24).tokens for name in ("short", "long")]
    assert out["on"] == out["off"]
    assert [len(t) for t in out["on"]] == [24, 24]

"""mtpflow.backend: the dtype a run uses ("auto": the checkpoint's own on a
GPU, float32 on a CPU), and the per-device tuning profiles."""

import json
import shutil

import mlx.core as mx
import pytest
from conftest import FIXTURES, quiet_log

from mtpflow.backend import dtypes, profiles
from mtpflow.cli import main
from mtpflow.config import load_config
from mtpflow.engine import load_session, on_for_device

E = FIXTURES / "pair_e"


def _floats(module):
    from mlx.utils import tree_flatten

    return {v.dtype for _, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


@pytest.fixture
def on_gpu(monkeypatch):
    """Resolve as on a CUDA device (the arrays still live on the CPU)."""
    monkeypatch.setattr(profiles, "device_kind", lambda: "cuda")


@pytest.fixture
def bf16_pair(tmp_path):
    """pair_e whose target config says bfloat16 (its weights are float32 on disk)."""
    t, d = tmp_path / "target", tmp_path / "drafter"
    shutil.copytree(E / "target", t)
    shutil.copytree(E / "drafter", d)
    cfg = json.loads((t / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.get("text_config", {}).pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    (t / "config.json").write_text(json.dumps(cfg))
    return t, d


def test_checkpoint_dtype_from_config_then_weights(tmp_path):
    assert dtypes.config_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert dtypes.config_dtype({"text_config": {"dtype": "torch.float16"}}) == "float16"
    assert dtypes.config_dtype({"torch_dtype": "int8"}) is None
    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {"a.ids": mx.zeros((2,), mx.int32), "b.weight": mx.zeros((2, 2), mx.float16)})
    assert dtypes.checkpoint_dtype(tmp_path, {}) == "float16"  # the first float tensor's (header only)
    assert dtypes.checkpoint_dtype(E / "target") == "float32"


def test_resolve_dtype_per_device(monkeypatch, tmp_path):
    cfg = {"torch_dtype": "bfloat16"}
    assert dtypes.resolve_dtype("auto", tmp_path, cfg) == "float32"  # this CPU device
    assert dtypes.resolve_dtype("float16", tmp_path, cfg) == "float16"
    monkeypatch.setattr(profiles, "device_kind", lambda: "metal")
    assert dtypes.resolve_dtype("auto", tmp_path, cfg) == "bfloat16"
    assert dtypes.resolve_dtype(None, tmp_path, {}) == "float32"  # names none, no weights: float32
    assert dtypes.resolve_dtype("float32", tmp_path, cfg) == "float32"  # explicit dtypes keep working
    with pytest.raises(ValueError, match="int4"):
        dtypes.resolve_dtype("int4", tmp_path, cfg)


def test_auto_on_a_gpu_runs_target_and_drafter_in_the_checkpoint_dtype(on_gpu, bf16_pair):
    t, d = bf16_pair
    s = load_session(load_config(overrides={"model": {"model": str(t), "draft_model": str(d)}}), log=quiet_log())
    assert s.dtype == "bfloat16"
    assert _floats(s.target.model) == {mx.bfloat16}
    assert _floats(s.drafter.model) == {mx.bfloat16}  # the drafter follows the target
    assert not s.submit_layers  # the CUDA profile


def test_auto_on_the_cpu_is_float32(bf16_pair):
    t, d = bf16_pair
    s = load_session(load_config(overrides={"model": {"model": str(t), "draft_model": str(d)}}), log=quiet_log())
    assert s.dtype == "float32" and _floats(s.target.model) == {mx.float32} and _floats(s.drafter.model) == {mx.float32}


def test_quantized_weights_stay_quantized(on_gpu, tmp_path):
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    s = load_session(load_config(overrides={"model": {"model": str(E / "target")}}), log=quiet_log())
    m = s.target.model
    nn.quantize(m, group_size=32, bits=4, class_predicate=lambda p, x: isinstance(x, nn.Linear) and x.weight.shape[-1] % 32 == 0)
    out = tmp_path / "q4"
    shutil.copytree(E / "target", out)
    (out / "model.safetensors").unlink()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(m.parameters())))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(cfg))
    q = load_session(load_config(overrides={"model": {"model": str(out)}}), log=quiet_log())
    assert any(isinstance(x, nn.QuantizedLinear) for _, x in q.target.model.named_modules())
    assert any(v.dtype == mx.uint32 for _, v in tree_flatten(q.target.model.parameters()))
    assert q.dtype == "4-bit + float32"


def test_the_cli_says_which_dtype_ran(capsys):
    main(["generate", "--model", str(E / "target"), "--max-tokens", "3", "--prompt-ids", "5,6,7", "--json"])
    assert json.loads(capsys.readouterr().out)["stats"]["dtype"] == "float32"
    main(["generate", "--model", str(E / "target"), "--max-tokens", "3", "--prompt-ids", "5,6,7", "--dtype", "bfloat16"])
    assert "bfloat16]" in capsys.readouterr().err  # the stats line


def test_profiles_choose_each_tuning_per_device(monkeypatch):
    for kind, p in profiles.PROFILES.items():
        assert p.device == kind
        assert set(p.why) == {*profiles.TUNINGS, "blas_preload", "power_exp", "blas_rowsum", "train_lanes"}, kind  # every value has its reason
    assert profiles.current().device == "cpu"
    assert on_for_device("auto", "fuse_ops") and on_for_device("auto", "submit_layers")
    assert not on_for_device("off", "fuse_ops") and on_for_device("on", "submit_layers")
    monkeypatch.setattr(profiles, "device_kind", lambda: "metal")
    assert not on_for_device("auto", "fuse_ops") and not on_for_device("auto", "submit_layers")
    assert on_for_device("on", "fuse_ops")
    with pytest.raises(ValueError, match="unknown tuning"):
        profiles.tuning_on("warp_speed")

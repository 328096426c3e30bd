"""Config files and the config classes (mtpflow.config)."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from mtpflow.config import (
    BatchConfig,
    Config,
    ConfigError,
    DraftConfig,
    GenerationConfig,
    ModelConfig,
    SamplingConfig,
    TraceConfig,
    load_config,
    structure,
    unstructure,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CONFIG_FILES = sorted(CONFIGS.glob("*.toml"))

# name -> (target repo id, assistant repo id, block size)
PAIRS = {
    "gemma4-e2b.toml": ("google/gemma-4-E2B-it", "google/gemma-4-E2B-it-assistant", 4),
    "gemma4-e4b.toml": ("google/gemma-4-E4B-it", "google/gemma-4-E4B-it-assistant", 4),
    "gemma4-26b-a4b.toml": ("google/gemma-4-26B-A4B-it", "google/gemma-4-26B-A4B-it-assistant", 6),
    "gemma4-31b.toml": ("google/gemma-4-31B-it", "google/gemma-4-31B-it-assistant", 6),
}


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --------------------------------------------------------------------------------------
# the shipped example files
# --------------------------------------------------------------------------------------
def test_configs_folder_has_every_example():
    names = {p.name for p in CONFIG_FILES}
    assert names >= set(PAIRS) | {"default.toml"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_config_file_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.draft.block_size is None or 1 <= cfg.draft.block_size <= 32


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_pairing_files(name):
    target, assistant, block = PAIRS[name]
    path = CONFIGS / name
    cfg = load_config(path)
    assert cfg.model.model == target
    assert cfg.model.draft_model == assistant
    assert cfg.draft.block_size == block
    assert cfg.model.dtype == "auto"  # bfloat16 on a GPU, float32 on a CPU
    header = [ln for ln in path.read_text().splitlines() if ln.startswith("#")]
    text = "\n".join(header)
    assert target in text and assistant in text  # the header names both repos
    assert "local folder" in text


def test_default_file_equals_the_defaults():
    """default.toml documents every key with its default value."""
    assert load_config(CONFIGS / "default.toml") == Config()
    assert load_config(CONFIGS / "default.toml").model.dtype == "auto"


def test_default_file_mentions_every_key():
    text = (CONFIGS / "default.toml").read_text()
    sections = {
        "model": ModelConfig, "draft": DraftConfig, "sampling": SamplingConfig,
        "batch": BatchConfig, "generation": GenerationConfig, "trace": TraceConfig,
    }
    for section, cls in sections.items():
        assert re.search(rf"^\[{section}\]$", text, re.M), section
        for f in attrs.fields(cls):
            # written as a key, or commented out when its default is "unset"
            assert re.search(rf"^#?\s*{f.name} = ", text, re.M), f"{section}.{f.name}"
    assert re.search(r"^\[plugins\]$", text, re.M) and re.search(r"^load = \[\]$", text, re.M)


# --------------------------------------------------------------------------------------
# overrides and errors
# --------------------------------------------------------------------------------------
def test_overrides_win_over_the_file(tmp_path):
    p = _write(tmp_path, '[model]\nmodel = "a/b"\n[draft]\nblock_size = 6\n[sampling]\ntemperature = 0.7\n')
    cfg = load_config(p, {"draft": {"block_size": 3}, "model": {"model": "c/d", "draft_model": None}})
    assert cfg.draft.block_size == 3
    assert cfg.model.model == "c/d"
    assert cfg.model.draft_model is None
    assert cfg.sampling.temperature == 0.7  # untouched by the overrides
    # None values in overrides leave the file's value alone
    assert load_config(p, {"draft": {"block_size": None}}).draft.block_size == 6


def test_overrides_without_a_file():
    cfg = load_config(None, {"generation": {"max_tokens": 7}, "trace": {"file": "t.jsonl"}})
    assert cfg.generation.max_tokens == 7
    assert cfg.trace.file == "t.jsonl"


def test_override_of_a_non_table_is_an_error(tmp_path):
    p = _write(tmp_path, "draft = 3\n")
    with pytest.raises(ConfigError, match=r"\$\.draft: expected a table"):
        load_config(p, {"draft": {"block_size": 2}})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_bad_toml_names_the_file(tmp_path):
    p = _write(tmp_path, "[draft\nblock_size = \n", name="broken.toml")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg
    assert "TOML" in msg


def test_unknown_key_has_its_path(tmp_path):
    p = _write(tmp_path, "[draft]\nblock_size = 4\nbolck_size = 5\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert "$.draft" in msg and "bolck_size" in msg
    assert str(p) in msg  # errors from a file name the file


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match=r"\$: unknown key\(s\) sampler"):
        structure({"sampler": {}})


def test_block_size_zero(tmp_path):
    p = _write(tmp_path, "[draft]\nblock_size = 0\n")
    with pytest.raises(ConfigError, match=r"\$\.draft\.block_size: must be >= 1 \(got 0\)"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"^\$\.draft\.block_size: must be >= 1"):
        load_config(None, {"draft": {"block_size": 0}})


def test_block_size_too_large():
    with pytest.raises(ConfigError, match=r"\$\.draft\.block_size: must be <= 32"):
        structure({"draft": {"block_size": 33}})


@pytest.mark.parametrize(
    "data, path",
    [
        ({"draft": {"block_size": "four"}}, "$.draft.block_size"),
        ({"sampling": {"temperature": "hot"}}, "$.sampling.temperature"),
        ({"model": {"dtype": "int3"}}, "$.model.dtype"),
        ({"sampling": {"top_p": 0.0}}, "$.sampling.top_p"),
        ({"generation": {"max_tokens": -1}}, "$.generation.max_tokens"),
        ({"draft": 3}, "$.draft"),
    ],
)
def test_wrong_type_or_value_has_its_path(data, path):
    with pytest.raises(ConfigError) as ei:
        structure(data)
    assert str(ei.value).startswith(f"{path}:"), str(ei.value)


@pytest.mark.parametrize(
    "data, path",
    [
        ({"trace": {"sync_timing": "no"}}, "$.trace.sync_timing"),
        ({"plugins": "my_plugin"}, "$.plugins"),
        ({"plugins": {"load": "my_plugin"}}, "$.plugins"),
        ({"plugins": {"fixed_temp": 3}}, "$.plugins.fixed_temp"),
        ({"draft": {"block_size": 2.5}}, "$.draft.block_size"),
    ],
)
def test_lossy_coercions_are_errors(data, path):
    with pytest.raises(ConfigError) as ei:
        structure(data)
    assert str(ei.value).startswith(f"{path}:")


def test_wrong_type_in_file_names_file_and_path(tmp_path):
    p = _write(tmp_path, '[batch]\nmax_batch_size = "many"\n')
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg and "$.batch.max_batch_size" in msg


def test_several_errors_are_all_reported():
    with pytest.raises(ConfigError) as ei:
        structure({"draft": {"block_size": 0}, "generation": {"max_tokens": 0}})
    msg = str(ei.value)
    assert "$.draft.block_size" in msg and "$.generation.max_tokens" in msg


# --------------------------------------------------------------------------------------
# the classes
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "obj, name, value",
    [
        (Config(), "plugins", ["x"]),
        (ModelConfig(), "model", "a/b"),
        (DraftConfig(), "block_size", 2),
        (SamplingConfig(), "temperature", 1.0),
        (BatchConfig(), "policy", "continuous"),
        (GenerationConfig(), "max_tokens", 3),
        (TraceConfig(), "file", "t"),
    ],
)
def test_config_classes_are_frozen(obj, name, value):
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(obj, name, value)


def test_evolve_validates():
    cfg = DraftConfig()
    assert attrs.evolve(cfg, block_size=6).block_size == 6
    with pytest.raises(ValueError, match="block_size"):
        attrs.evolve(cfg, block_size=0)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_unstructure_structure_round_trip(path):
    cfg = load_config(path)
    data = unstructure(cfg)
    assert isinstance(data, dict)
    assert set(data) == {"model", "draft", "sampling", "batch", "generation", "trace", "plugins"}
    assert structure(data) == cfg


def test_round_trip_of_non_defaults():
    cfg = load_config(
        None,
        {
            "model": {"model": "a/b", "draft_model": "c/d", "draft_kind": "mtp", "dtype": "float16"},
            "draft": {"block_size": 7, "position": "bonus-1", "max_block_size": 12},
            "sampling": {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 3},
            "batch": {"policy": "continuous", "max_batch_size": 2},
            "trace": {"file": "t.jsonl", "sync_timing": True},
        },
    )
    data = unstructure(cfg)
    assert data["draft"]["position"] == "bonus-1"
    assert structure(data) == cfg
    assert structure(unstructure(Config(plugins=["x.y"]))) == Config(plugins=["x.y"])

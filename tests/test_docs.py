"""The docs are tested: every hook is documented with its exact signature and has a test of its own,
and every plugin example of docs/plugins.md is a package that installs, loads and runs as the page says."""

import inspect
import re
from pathlib import Path

import pytest

from mtpflow import hookspecs

ROOT = Path(__file__).parent.parent
HOOKS = sorted(n for n in vars(hookspecs) if n.startswith("mtpflow_"))


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_documented_with_exact_signature(hook):
    docs = (ROOT / "docs" / "hooks.md").read_text()
    sig = f"{hook}{inspect.signature(getattr(hookspecs, hook))}"
    assert f"## `{hook}`" in docs
    assert sig in docs, f"docs/hooks.md must show `{sig}`"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_spec_documents_params_return_and_version(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook))
    assert ".. versionadded::" in doc and ":return:" in doc
    for p in inspect.signature(getattr(hookspecs, hook)).parameters:
        assert f":param {p}:" in doc


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook):
    here = Path(__file__).name
    texts = [p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != here]
    assert any(re.search(rf"\b{hook}\b", t) for t in texts), f"no test mentions {hook}"


# --------------------------------------------------------------------------------------
# docs/plugins.md: every example is a package, installed and run as the page says
# --------------------------------------------------------------------------------------
def _plugin_examples() -> tuple[str, dict[str, tuple[str, str]]]:
    """The page's pyproject.toml and ``{title: (module name, code)}`` of its examples."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text.split("## Each kind in a few lines", 1)[1].split("\n## ", 1)[0]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    out = {}
    for title, module, body in re.findall(r"^### (.+?): `(\w+)`\n.*?```python\n(.*?)```", section, re.S | re.M):
        out[title] = (module, body)
    return toml, out


PYPROJECT, EXAMPLES = _plugin_examples()


def _pyproject(module: str) -> str:
    return PYPROJECT.replace("mtpflow_hot", module).replace("mtpflow-hot", module.replace("_", "-")).replace(
        "hot =", f"{module.removeprefix('mtpflow_')} =")


def test_every_kind_has_a_documented_package_and_the_small_ones_fit_in_40_lines():
    import tomllib

    from mtpflow import api

    assert len(EXAMPLES) == len(api.KINDS) == 7
    for title, (module, code) in EXAMPLES.items():
        meta = tomllib.loads(_pyproject(module))
        assert meta["project"]["entry-points"]["mtpflow"] == {module.removeprefix("mtpflow_"): module}, title
        assert meta["tool"]["setuptools"]["py-modules"] == [module]
        assert "class Plugin" not in code and re.search(r"^@hookimpl\ndef mtpflow_register_", code, re.M), title
    for title in ("A sampler with settings", "An LM head"):
        module, code = EXAMPLES[title]
        lines = len(code.strip().splitlines()) + len(_pyproject(module).strip().splitlines())
        assert lines <= 40, f"{title}: {lines} lines of module and pyproject.toml"


@pytest.fixture(scope="module")
def installed_examples(tmp_path_factory):
    """Every example written out and 'installed' as pip would: the module and
    a ``.dist-info`` folder whose ``entry_points.txt`` names it, on sys.path."""
    import sys
    import tomllib

    root = tmp_path_factory.mktemp("site")
    for module, code in EXAMPLES.values():
        (root / f"{module}.py").write_text(code)
        meta = tomllib.loads(_pyproject(module))
        info = root / f"{module}-{meta['project']['version']}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['project']['name']}\nVersion: 0.1.0\n")
        eps = "".join(f"{k} = {v}\n" for k, v in meta["project"]["entry-points"]["mtpflow"].items())
        (info / "entry_points.txt").write_text(f"[mtpflow]\n{eps}")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for module, _ in EXAMPLES.values():
        sys.modules.pop(module, None)


def _loaded(title, monkeypatch):
    """A plugin manager that found the example through its entry point (and no other third-party plugin)."""
    from mtpflow.plugins import make_plugin_manager

    module = EXAMPLES[title][0]
    monkeypatch.setenv("MTPFLOW_PLUGINS", module.removeprefix("mtpflow_"))
    pm = make_plugin_manager(autoload=True)
    assert pm.pm.has_plugin(module.removeprefix("mtpflow_")) and pm.versions[module.removeprefix("mtpflow_")] == "0.1.0"
    return pm


IDS = list(range(5, 30))


def test_documented_sampler_and_processor_work(installed_examples, monkeypatch):
    from conftest import make_session

    from mtpflow.engine import generate
    from mtpflow.state import SamplingParams

    s = make_session("e", block_size=4, plugins=_loaded("A sampler with settings", monkeypatch), sampling={"sampler": "hot"})
    plain = make_session("e", block_size=4)
    want = generate(plain, IDS, max_tokens=16, sampling=SamplingParams(temperature=0.8, seed=4)).tokens
    assert generate(s, IDS, max_tokens=16, sampling=SamplingParams(seed=4)).tokens == want
    pm = _loaded("A logits processor (mlx-lm's form)", monkeypatch)
    a = generate(make_session("e", block_size=1, plugins=pm, sampling={"processors": ["no7"]}), IDS, max_tokens=30).tokens
    b = generate(make_session("e", block_size=4, plugins=pm, sampling={"processors": ["no7"]}), IDS, max_tokens=30).tokens
    assert a == b and 7 not in a


def test_documented_head_drafter_and_policies_work(installed_examples, monkeypatch):
    from conftest import make_session, reference

    from mtpflow.engine import generate, generate_stream, make_request

    ref = reference(make_session("d", block_size=1), IDS, 20)
    s = make_session("d", block_size=4, plugins=_loaded("An LM head", monkeypatch), draft={"head": "sharp"})
    assert generate(s, IDS, max_tokens=20).tokens == ref and s.stats.accepted_tokens > 0
    assert s.selection["head"] == "sharp"
    pm = _loaded("A drafter kind", monkeypatch)
    s = make_session("d", block_size=3, with_drafter=False, plugins=pm, model={"draft_kind": "repeat"})
    assert generate(s, IDS, max_tokens=20).tokens == ref
    s = make_session("d", block_size=3, plugins=_loaded("A block policy", monkeypatch), draft={"policy": "alternate"})
    assert generate(s, IDS, max_tokens=20).tokens == ref and set(s.stats.block_sizes) <= {1, 2, 3}
    assert {2, 3} <= set(s.stats.block_sizes)
    s = make_session("d", block_size=3, plugins=_loaded("A batch policy", monkeypatch), batch={"policy": "pairs"})
    reqs = [make_request(s, IDS[: 8 + i], max_tokens=6, request_id=str(i)) for i in range(5)]
    done = {ev.request_id for ev in generate_stream(s, reqs) if ev.finished}
    assert done == {str(i) for i in range(5)}


def test_documented_target_adapter_loads_and_runs(installed_examples, monkeypatch, tmp_path):
    import json
    import shutil

    from mtpflow.config import load_config
    from mtpflow.engine import generate, load_session

    llama = ROOT / "tests" / "fixtures" / "eagle3" / "target"
    target = tmp_path / "target"
    shutil.copytree(llama, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "model_type": "my_llama"}))
    pm = _loaded("A target adapter", monkeypatch)
    s = load_session(load_config(overrides={"model": {"model": str(target)}}), plugins=pm)
    plain = load_session(load_config(overrides={"model": {"model": str(llama)}}))
    assert type(s.target).__name__ == "MyLlama"
    assert generate(s, IDS, max_tokens=8).tokens == generate(plain, IDS, max_tokens=8).tokens


def test_every_optional_capability_is_documented_with_its_members():
    from mtpflow import api

    text = (ROOT / "docs" / "plugins.md").read_text()
    table = text.split("## Optional capabilities", 1)[1].split("\n## ", 1)[0]
    for kind, protos in api.CAPABILITIES.items():
        for proto in protos:
            row = next((line for line in table.splitlines() if line.startswith(f"| `{proto.__name__}` |")), None)
            assert row is not None, f"docs/plugins.md does not list {proto.__name__}"
            for member in api.protocol_members(proto):
                assert member in row, f"{proto.__name__}: {member} not in its row"

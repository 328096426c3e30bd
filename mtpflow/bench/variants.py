"""What ``mtpflow bench`` compares: mlx-lm's own decoding and mtpflow sessions sharing one target."""

from __future__ import annotations

import time
from pathlib import Path

class Variant:
    engine = ""

    def __init__(self, name: str, batch_size: int, block_size: int, kind: str):
        self.name, self.batch_size, self.block_size, self.kind = name, batch_size, block_size, kind
        self.runs: list[dict] = []
        self.note: str | None = None

    def describe(self) -> dict:
        return {"name": self.name, "engine": self.engine, "kind": self.kind,
                "batch_size": self.batch_size, "block_size": self.block_size}


def _groups(prompts, b):
    return [prompts[i : i + b] for i in range(0, len(prompts), b)]


class MLXLMVariant(Variant):
    """Plain mlx-lm decoding, greedy or sampled (optionally its speculative decoding)."""

    engine = "mlx_lm"

    def __init__(self, name, batch_size, block_size, kind, model, draft_model=None, stop_ids=(), sampling=None):
        super().__init__(name, batch_size, block_size, kind)
        self.model, self.draft_model, self.stop_ids = model, draft_model, set(stop_ids)
        self.batch_mode = "batch_generator" if batch_size > 1 else "generate_step"
        self.sampling = sampling  # a SamplingConfig; None or temperature 0 = greedy

    def _sampler(self):
        """mlx-lm's own sampler for the bench's sampling settings (``None``: greedy).
        mlx-lm filters (top-p, min-p, top-k) at temperature 1 and then samples at
        the temperature, mtpflow filters after the temperature (as transformers):
        the same work per token, slightly different distributions."""
        sc = self.sampling
        if sc is None or sc.temperature <= 0:
            return None
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        if sc.seed is not None:
            mx.random.seed(sc.seed)
        return make_sampler(temp=sc.temperature, top_p=sc.top_p if sc.top_p < 1.0 else 0.0,
                            min_p=sc.min_p, top_k=sc.top_k)

    def run(self, prompts, max_tokens, collector):
        from ..backend import fusion

        with fusion.stock(self.model, self.draft_model):  # mlx-lm as it ships, whatever mtpflow fused
            return self._run(prompts, max_tokens, collector)

    def _run(self, prompts, max_tokens, collector):
        tokens = rounds = 0
        t_first = []
        t0 = time.perf_counter()
        for grp in _groups(prompts, self.batch_size):
            if self.batch_size == 1 or len(grp) == 1:
                n, r, tf = self._one(grp[0], max_tokens, collector)
                tokens, rounds = tokens + n, rounds + r
                t_first.append(tf)
            else:
                n, r = self._batch(grp, max_tokens)
                tokens, rounds = tokens + n, rounds + r
        wall = time.perf_counter() - t0
        return {"tokens": tokens, "wall_s": wall, "rounds": rounds, "row_rounds": rounds}

    def _one(self, prompt, max_tokens, collector):
        import mlx.core as mx
        from mlx_lm.generate import generate_step, speculative_generate_step

        arr = mx.array(prompt, dtype=mx.uint32)
        t0 = time.perf_counter()
        tfirst = None
        n = rounds = run = 0
        k = self.block_size - 1
        sampler = self._sampler()
        if self.draft_model is None:
            gen = generate_step(arr, self.model, max_tokens=max_tokens, sampler=sampler)
            for tok, _ in gen:
                tfirst = tfirst or time.perf_counter() - t0
                tok = int(tok)
                if tok in self.stop_ids:
                    break
                n += 1
                rounds += 1
            gen.close()
        else:
            gen = speculative_generate_step(arr, self.model, self.draft_model, num_draft_tokens=k, max_tokens=max_tokens,
                                            sampler=sampler)
            for tok, _, from_draft in gen:
                tfirst = tfirst or time.perf_counter() - t0
                tok = int(tok)
                if tok in self.stop_ids:
                    break
                n += 1
                if from_draft:
                    run += 1
                else:  # a round ends with the target's own token
                    rounds += 1
                    collector.add(k, [run])
                    run = 0
            gen.close()
            if run:  # budget cut the last round short
                rounds += 1
                collector.add(k, [run])
        return n, rounds, tfirst

    def _batch(self, grp, max_tokens):
        from mlx_lm.generate import BatchGenerator

        stops = [[t] for t in sorted(self.stop_ids)] or None
        gen = BatchGenerator(self.model, stop_tokens=stops, max_tokens=max_tokens, sampler=self._sampler(),
                             prefill_batch_size=len(grp), completion_batch_size=len(grp))
        try:
            gen.insert(grp, [max_tokens] * len(grp))
            n = steps = 0
            while responses := gen.next_generated():
                steps += len(responses)
                n += sum(1 for r in responses if r.finish_reason != "stop")
        finally:
            gen.close()
        return n, steps


class MTPFlowVariant(Variant):
    engine = "mtpflow"

    def __init__(self, name, batch_size, block_size, kind, session, ignore_eos):
        super().__init__(name, batch_size, block_size, kind)
        self.session, self.ignore_eos = session, ignore_eos
        self.stats: list[dict] = []

    def run(self, prompts, max_tokens, collector):
        import attrs

        from ..engine import generate_stream
        from ..prompts import make_request
        from ..metrics import SpecDecodingStats

        s = self.session
        s.stats = SpecDecodingStats()
        # a fresh block policy per run (the adaptive one learns)
        s.block_policy = s.plugins.block_policies.get(s.config.draft.policy)(s.config)
        tokens = 0
        pm = s.plugins.pm
        pm.register(collector, name=f"mtpflow-bench-rounds-{id(collector)}")  # its mtpflow_emit counts acceptance
        try:
            t0 = time.perf_counter()
            for gi, grp in enumerate(_groups(prompts, self.batch_size)):
                reqs = [make_request(s, p, max_tokens=max_tokens, request_id=f"{gi}-{i}") for i, p in enumerate(grp)]
                if self.ignore_eos:
                    reqs = [attrs.evolve(r, stop_ids=frozenset()) for r in reqs]
                for ev in generate_stream(s, reqs):
                    tokens += len(ev.tokens)
            wall = time.perf_counter() - t0
        finally:
            pm.unregister(collector)
        st = s.stats.as_dict()
        return {"tokens": tokens, "wall_s": wall, "rounds": st["rounds"], "row_rounds": s.stats.row_rounds, "stats": st}


def _session_variant(base, block_size: int, policy: str, with_drafter: bool, max_batch: int, sync_timing: bool,
                     max_block_size: int | None = None, tree: str = "off"):
    """A Session sharing ``base``'s target/drafter with its own config, sampler and policies.
    ``max_block_size``: the adaptive policy's ceiling (default: ``block_size``)."""
    import attrs

    from ..metrics import SpecDecodingStats

    cfg = base.config
    ceiling = max_block_size or (block_size if policy == "adaptive" else max(cfg.draft.max_block_size, block_size))
    draft = attrs.evolve(cfg.draft, block_size=block_size, policy=policy, max_block_size=ceiling, tree=tree)
    cfg = attrs.evolve(cfg, draft=draft, batch=attrs.evolve(cfg.batch, max_batch_size=max_batch),
                       trace=attrs.evolve(cfg.trace, sync_timing=sync_timing, file=None))
    sc = cfg.sampling
    sampler_name = sc.sampler if sc.sampler != "auto" else "rejection"
    p = base.plugins
    return attrs.evolve(
        base, config=cfg,
        drafter=base.drafter if with_drafter else None,
        draft_kind=base.draft_kind if with_drafter else None,
        sampler=p.samplers.get(sampler_name)(cfg),
        block_policy=p.block_policies.get(policy)(cfg),
        batch_policy=p.batch_policies.get(cfg.batch.policy)(cfg),
        stats=SpecDecodingStats(),
    )


def _load_mlx_lm_draft(name: str, dtype: str):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from ..resolve import resolve_model

    path = resolve_model(name, "float32" if dtype == "auto" else dtype)
    model, cfg = load_model(Path(path))
    if dtype == "auto":
        from ..backend.dtypes import resolve_dtype

        dtype = resolve_dtype(dtype, path, cfg)
    if dtype and not (cfg.get("quantization") or cfg.get("quantization_config")):
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def _in_target_sessions(session) -> list[tuple]:
    """``(kind, session)`` for every drafter kind whose drafter ships inside
    the target checkpoint (``in_target``, e.g. a native MTP head) other than
    the session's own: bench rows for it come next to the given drafter's."""
    import attrs

    from ..api import InTargetDrafter, has
    from ..session import DrafterOptions

    out = []
    t = session.target
    for name, cls in session.plugins.drafters.items():
        if name == session.draft_kind or not has(cls, InTargetDrafter) or not cls.in_target(t.config, t.path):
            continue
        opts = DrafterOptions(plugins=session.plugins, dtype=session.dtype.split(" + ")[-1], config=session.config,
                              settings=session.plugins.settings_for(name, cls, session.config))
        out.append((name, attrs.evolve(session, drafter=cls.load(None, t, opts), draft_kind=name)))
    return out


def build_variants(args, session, prompts) -> list[Variant]:
    variants: list[Variant] = []
    eos = () if not args.stop_at_eos else sorted(session.target.eos_ids)
    ignore_eos = not args.stop_at_eos
    max_batch = max(args.batch_sizes)
    mlx_draft = _load_mlx_lm_draft(args.mlx_lm_draft_model, session.dtype.split(" + ")[-1]) if args.mlx_lm_draft_model else None
    in_target = _in_target_sessions(session)
    for b in args.batch_sizes:
        if not args.no_baseline:
            variants.append(MLXLMVariant(f"mlx_lm b{b}", b, 1, "target_only", session.target.model, stop_ids=eos,
                                         sampling=session.config.sampling))
        if not args.no_null:
            s = _session_variant(session, 1, "fixed", False, max_batch, args.sync_timing)
            variants.append(MTPFlowVariant(f"mtpflow-null b{b}", b, 1, "null", s, ignore_eos))
        if session.drafter is not None and not args.no_default:
            # what `mtpflow generate` runs when [draft] is left alone: the
            # adaptive policy from the drafter's recommended block size
            d = session.default_draft
            s = _session_variant(session, d.block_size, d.policy, True, max_batch, args.sync_timing,
                                 max_block_size=d.max_block_size)
            variants.append(MTPFlowVariant(f"mtpflow-default b{b}", b, d.block_size, session.draft_kind, s, ignore_eos))
        if session.drafter is not None:
            for k in args.block_sizes:
                s = _session_variant(session, k, args.policy, True, max_batch, args.sync_timing)
                tag = "kmax" if args.policy == "adaptive" else "k"
                variants.append(MTPFlowVariant(f"mtpflow-{tag}{k} b{b}", b, k, session.draft_kind, s, ignore_eos))
        if session.drafter is not None:
            for shape in [t.strip() for t in args.trees.split(";") if t.strip()]:
                s = _session_variant(session, max(args.block_sizes), "fixed", True, max_batch, args.sync_timing, tree=shape)
                variants.append(MTPFlowVariant(f"mtpflow-tree{shape} b{b}", b, max(args.block_sizes), "tree", s, ignore_eos))
        for kind, base in in_target:  # the target checkpoint's own drafter (its native MTP head)
            for k in args.block_sizes:
                if k > 1:
                    s = _session_variant(base, k, args.policy, True, max_batch, args.sync_timing)
                    variants.append(MTPFlowVariant(f"mtpflow-{kind}-k{k} b{b}", b, k, kind, s, ignore_eos))
        if mlx_draft is not None and b == 1:
            for k in args.block_sizes:
                if k > 1:
                    variants.append(MLXLMVariant(f"mlx_lm-spec-k{k} b{b}", b, k, "mlx_lm_speculative",
                                                 session.target.model, draft_model=mlx_draft, stop_ids=eos,
                                                 sampling=session.config.sampling))
    return variants

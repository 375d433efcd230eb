"""The safetensors file format itself: a validating lazy reader and an atomic streaming writer.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON
(``{"__metadata__": {str: str}, key: {"dtype", "shape", "data_offsets": [begin, end]}}``, possibly
padded with spaces) and the tensor bytes, back to back, offsets relative to the end of the header.

:class:`SafetensorsFile` parses and checks the whole header before any tensor is read, then reads
one tensor at a time with a positioned read into a fresh buffer. Opening costs no memory and each
read exactly one tensor; the file's pages sit in the OS page cache, not in the process (a memory
map of the whole file would count every page touched in the process's RSS until unmapped), so a
converter streaming a 20 GB file stays at a few tensors of RSS.

:class:`SafetensorsWriter` takes tensors one at a time and writes them straight to a temp file in
the destination directory (leaving room for the header, which is written last), then fsyncs it and
moves it into place; it never replaces an existing file unless asked to and removes its temp file
on any error. It starts the tensor data at a 64-byte file offset and writes tensors whose size is not
a multiple of 64 bytes last, so every other tensor of a memory-mapped file is 64-byte aligned, like
freshly allocated memory (see ``_DATA_ALIGN``). Nothing here knows about quantization.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .errors import CheckpointFormatError, LowBitError, OutputExistsError

log = logging.getLogger(__name__)

#: safetensors dtype names, as ``safetensors.torch`` maps them
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

MAX_HEADER_BYTES = 100_000_000  # what the safetensors library accepts
METADATA_KEY = "__metadata__"
_ALIGN = 8  # keep every tensor's offset a multiple of its element size
#: the writer starts the tensor data, and every tensor whose size is a multiple of this, at a multiple of
#: 64 bytes in the file: the alignment PyTorch's CPU allocator gives. A reader that maps the file (stock
#: ComfyUI's loader on the CPU) computes with views into it, and CPU matmul kernels round differently on
#: operands off that alignment, so an 8-aligned float weight sampled other last bits than the same weight
#: in freshly allocated memory (a model quantized in memory vs the file saved from it).
_DATA_ALIGN = 64
_DEFER_LIMIT = 64 << 20  # bytes of odd-sized tensors held back to the end to keep that alignment
_COPY_CHUNK = 16 << 20

# (magic bytes, what the file is, what to do): files people commonly pass by mistake
_NOT_SAFETENSORS = (
    (b"PK\x03\x04", "a zip archive (a PyTorch .pt/.pth/.ckpt/.bin saved by torch.save)",
     "convert it to .safetensors first, or use its .safetensors release"),
    (b"\x80\x02", "a Python pickle (a legacy .ckpt/.pt/.bin)", "convert it to .safetensors first"),
    (b"\x80\x03", "a Python pickle (a legacy .ckpt/.pt/.bin)", "convert it to .safetensors first"),
    (b"\x80\x04", "a Python pickle (a legacy .ckpt/.pt/.bin)", "convert it to .safetensors first"),
    (b"\x80\x05", "a Python pickle (a legacy .ckpt/.pt/.bin)", "convert it to .safetensors first"),
    (b"GGUF", "a GGUF file", "use a GGUF loader, or the model's .safetensors release"),
    (b"version https://git-lfs", "a Git LFS pointer, not the model itself", "fetch the real file (git lfs pull)"),
    (b"<", "an HTML/XML page (a failed download?)", "download the file again"),
    (b"\x89HDF", "an HDF5 file (.h5)", "convert it to .safetensors first"),
)


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: where a tensor's bytes are and what they hold."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section (after the header)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """A safetensors file opened for lazy reading. Use as a context manager, or call :meth:`close`.

    Opening parses and validates the header (raising :class:`CheckpointFormatError` for anything
    that is not a complete, well-formed safetensors file) and reads no tensor. :meth:`read` returns
    a fresh CPU tensor per call; concurrent reads from several threads are serialised.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = _open_for_reading(self.path)
        self._lock = threading.Lock()
        try:
            self.file_size = os.fstat(self._file.fileno()).st_size
            self.header_bytes, self.metadata, infos = _parse_header(self.path, self._file, self.file_size)
        except BaseException:
            self._file.close()
            raise
        self.data_start = 8 + self.header_bytes
        self.tensors: dict[str, TensorInfo] = {info.key: info for info in infos}  # in file order

    # ---- what is in the file (header only) ----------------------------------------------------
    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: info.shape for key, info in self.tensors.items()}

    def dtypes(self) -> dict[str, torch.dtype]:
        return {key: info.dtype for key, info in self.tensors.items()}

    def nbytes(self, key: str) -> int:
        return self._info(key).nbytes

    # ---- tensor data ---------------------------------------------------------------------------
    def read(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key``, as a new CPU tensor (bit-exact, any dtype, 0-d included)."""
        info = self._info(key)
        buffer = torch.empty(info.nbytes, dtype=torch.uint8)
        if info.nbytes:
            view = memoryview(buffer.numpy())
            with self._lock:
                self._file.seek(self.data_start + info.begin)
                got = 0
                while got < info.nbytes:
                    n = self._file.readinto(view[got:])
                    if not n:
                        raise CheckpointFormatError(
                            f"{self.path}: tensor {key!r} ends at byte {self.data_start + info.end} but the file "
                            f"now stops at byte {self.data_start + info.begin + got}; it was truncated or changed "
                            f"while open. Copy or download it again.")
                    got += n
        return buffer.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {key!r}") from None


def _open_for_reading(path: Path):
    try:
        return open(path, "rb", buffering=0)
    except IsADirectoryError:
        raise CheckpointFormatError(f"{path} is a directory, expected a .safetensors file "
                                    f"(for a sharded model, pass one file or merge the shards)") from None
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint not found: {path}") from None


def _parse_header(path: Path, f, file_size: int) -> tuple[int, dict[str, str], list[TensorInfo]]:
    head = f.read(min(file_size, 64))
    header_len = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else None
    looks_right = header_len is not None and header_len <= MAX_HEADER_BYTES and head[8:9] in (b"{", b"")
    if not looks_right:
        for magic, what, fix in _NOT_SAFETENSORS:
            if head.startswith(magic):
                raise CheckpointFormatError(f"{path} is not a safetensors file: it looks like {what}. Fix: {fix}.")
    if header_len is None:
        raise CheckpointFormatError(
            f"{path} is truncated: {file_size} bytes, but a safetensors file starts with an 8-byte header length. "
            f"Copy or download it again.")
    if not looks_right:
        raise CheckpointFormatError(
            f"{path} is not a safetensors file: expected an 8-byte header length then a JSON header starting "
            f"with '{{', found length field {header_len} and bytes {head[8:16]!r}. Make sure it is a .safetensors "
            f"file and not a .ckpt/.pt/.bin renamed.")
    if 8 + header_len > file_size:
        raise CheckpointFormatError(
            f"{path} is truncated: its header claims {header_len} bytes but only {file_size - 8} follow the "
            f"length field. Copy or download it again.")
    f.seek(8)
    raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, _DuplicateKey) as err:
        raise CheckpointFormatError(
            f"{path} is not a valid safetensors file: its header is not UTF-8 JSON ({err}). "
            f"The file is corrupt; copy or download it again.") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: the safetensors header must be a JSON object, found {type(header).__name__}")
    metadata = header.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(f"{path}: header {METADATA_KEY!r} must map strings to strings, found {metadata!r:.200}")
    infos = [_entry(path, key, value) for key, value in header.items()]
    infos.sort(key=lambda info: (info.begin, info.end))
    data_size = file_size - 8 - header_len
    position = 0
    for info in infos:
        if info.begin != position:
            raise CheckpointFormatError(
                f"{path}: tensor {info.key!r} starts at data byte {info.begin}, expected {position} (tensors "
                f"must be stored back to back without gaps or overlaps); the file is corrupt.")
        position = info.end
    if position > data_size:
        last = max(infos, key=lambda info: info.end)
        raise CheckpointFormatError(
            f"{path} is truncated: the header says the tensor data is {position} bytes (up to {last.key!r}), "
            f"but only {data_size} bytes follow the header (the whole file should be {8 + header_len + position} "
            f"bytes, it is {file_size}). Copy or download it again.")
    if position < data_size:
        raise CheckpointFormatError(
            f"{path}: {data_size - position} bytes follow the last tensor; the header does not describe them. "
            f"The file is corrupt or was appended to; copy or download it again.")
    return header_len, dict(metadata), infos


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key {key!r} appears twice")
        out[key] = value
    return out


def _entry(path: Path, key: str, value) -> TensorInfo:
    def bad(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{path}: header entry {key!r} is malformed: {why}; the file is corrupt.")

    if not isinstance(value, dict):
        raise bad(f"expected an object with dtype, shape and data_offsets, found {value!r:.100}")
    dtype_name, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype_name not in DTYPES:
        raise CheckpointFormatError(
            f"{path}: tensor {key!r} has dtype {dtype_name!r}, which this reader does not support "
            f"(supported: {', '.join(DTYPES)}). Re-save it in a supported dtype, or upgrade torch.")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"shape must be a list of non-negative integers, found {shape!r:.100}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end, found {offsets!r:.100}")
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != expected:
        raise bad(f"{dtype_name} {shape} needs {expected} bytes but data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return TensorInfo(key, dtype, tuple(shape), offsets[0], offsets[1])


# ---- writing ------------------------------------------------------------------------------------

def header_size_bound(entries: Iterable[tuple[str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None) -> int:
    """An upper bound on the header bytes of a file holding ``entries`` (key, shape) and ``metadata``."""
    total = len(json.dumps({METADATA_KEY: dict(metadata or {})})) + 2
    for key, shape in entries:
        entry = {"dtype": "F8_E4M3FNUZ", "shape": list(shape), "data_offsets": [10 ** 19, 10 ** 19]}
        total += len(json.dumps(key)) + 2 + len(json.dumps(entry, separators=(",", ":")))
    return _round_up(total, _ALIGN)


def check_metadata(metadata: Mapping | None) -> dict[str, str]:
    """``metadata`` as the ``{str: str}`` dict safetensors stores, or a ``ValueError`` naming the bad entry."""
    out = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise LowBitError(
                f"safetensors metadata maps strings to strings; entry {key!r} has a {type(value).__name__} value "
                f"{value!r:.80}. Encode it first, e.g. json.dumps(value).")
        out[key] = value
    return out


class SafetensorsWriter:
    """Write a safetensors file one tensor at a time, atomically.

    Tensors go straight to a temp file next to ``path`` (so peak memory is the tensor being added);
    :meth:`commit` writes the header, fsyncs and moves the file into place. Used as a context
    manager it commits on success and, on any exception, removes the temp file and leaves ``path``
    untouched.

    * ``overwrite=False``: an existing ``path`` raises :class:`OutputExistsError` (checked now and
      again, atomically, at commit).
    * ``protect``: paths that must never be written (the input of a conversion), even with overwrite.
    * ``header_reserve``: bytes kept free for the header in front of the data. A bound from
      :func:`header_size_bound` avoids any copy; if the header turns out larger, commit rewrites
      the file once.
    """

    def __init__(self, path: str | os.PathLike, *, metadata: Mapping[str, str] | None = None,
                 overwrite: bool = False, protect: Iterable[str | os.PathLike] = (), header_reserve: int = 64 << 10):
        self.path = Path(path)
        self.metadata = check_metadata(metadata)
        self.overwrite = overwrite
        check_output_path(self.path, overwrite=overwrite, protect=protect)
        self._reserve = _header_room(max(int(header_reserve), 0))
        self._entries: dict[str, dict] = {}
        self._keys: set[str] = set()
        self._deferred: list[tuple[str, torch.Tensor]] = []
        self._deferred_bytes = 0
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        self._offset = 0  # bytes of tensor data written so far
        self._done = False
        try:
            _give_default_permissions(self._file.fileno())
            self._file.seek(8 + self._reserve)
        except BaseException:
            self.abort()
            raise

    @property
    def temp_path(self) -> Path:
        return self._tmp

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Append one tensor (any device; written from CPU, bit-exact)."""
        if self._done:
            raise RuntimeError(f"writer for {self.path} is already closed")
        if not isinstance(key, str) or not key or key == METADATA_KEY:
            raise LowBitError(f"tensor key must be a non-empty string other than {METADATA_KEY!r}, got {key!r}")
        if key in self._keys:
            raise LowBitError(f"tensor {key!r} was already written to {self.path}; keys must be unique")
        if tensor.dtype not in DTYPE_NAMES:
            raise LowBitError(f"tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot store "
                              f"(storable: {', '.join(str(d).replace('torch.', '') for d in DTYPE_NAMES)})")
        self._keys.add(key)
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes % _DATA_ALIGN and self._deferred_bytes + nbytes <= _DEFER_LIMIT:
            # an odd size would shift every later tensor off its alignment: write it at the end
            self._deferred.append((key, tensor.clone()))
            self._deferred_bytes += nbytes
            return
        self._write(key, tensor)

    def update(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            self.add(key, tensor)

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            self._file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        self._entries[key] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}
        self._offset += nbytes

    def commit(self) -> Path:
        """Finish the file and move it to ``path``. On failure nothing is left behind."""
        if self._done:
            raise RuntimeError(f"writer for {self.path} is already closed")
        try:
            for key, tensor in sorted(self._deferred, key=lambda kt: -kt[1].element_size()):
                self._write(key, tensor)
            self._deferred.clear()
            body = {METADATA_KEY: self.metadata, **self._entries} if self.metadata else self._entries
            header = json.dumps(body, separators=(",", ":")).encode("utf-8")
            if len(header) <= self._reserve:
                self._file.seek(0)
                self._file.write(struct.pack("<Q", self._reserve) + header.ljust(self._reserve, b" "))
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
            else:
                self._rewrite_with_header(header)
            _publish(self._tmp, self.path, overwrite=self.overwrite)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self.path

    def _rewrite_with_header(self, header: bytes) -> None:
        """The header outgrew its reserve: copy the data once behind a header of the right size."""
        log.info("safetensors header (%d bytes) outgrew its reserve (%d); rewriting %s once",
                 len(header), self._reserve, self.path)
        self._file.flush()
        self._file.close()
        fd, new_tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        old_tmp, self._tmp = self._tmp, Path(new_tmp)
        try:
            padded = header.ljust(_header_room(len(header)), b" ")
            with os.fdopen(fd, "wb") as out, open(old_tmp, "rb") as src:
                out.write(struct.pack("<Q", len(padded)) + padded)
                src.seek(8 + self._reserve)
                shutil.copyfileobj(src, out, _COPY_CHUNK)
                out.flush()
                os.fsync(out.fileno())
        finally:
            old_tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        """Drop everything written so far (idempotent)."""
        self._done = True
        self._deferred.clear()
        try:
            self._file.close()
        except OSError:  # a failed flush (disk full...): the file is dropped anyway
            pass
        self._tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        elif not self._done:
            self.abort()


def check_output_path(path: Path, *, overwrite: bool, protect: Iterable[str | os.PathLike] = ()) -> None:
    """Raise when ``path`` may not be written: an input file, an existing file without overwrite, no folder."""
    for source in protect:
        if _same_file(path, Path(source)):
            raise OutputExistsError(
                f"output path {path} is the input file {source}; writing it would destroy the input. "
                f"Choose another output name.")
    if path.is_dir():
        raise OutputExistsError(f"output path {path} is a directory; give a file name ending in .safetensors")
    if path.exists() and not overwrite:
        raise OutputExistsError(
            f"output file {path} already exists and was left unchanged. Pass overwrite=True (--overwrite on the "
            f"command line) to replace it, or choose another name.")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output folder {path.parent} does not exist; create it first")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return os.path.abspath(a) == os.path.abspath(b)


def _publish(tmp: Path, path: Path, *, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
    else:
        try:
            os.link(tmp, path)  # atomic and refuses to replace a file created meanwhile
        except FileExistsError:
            raise OutputExistsError(
                f"output file {path} appeared while it was being written and was left unchanged. Pass "
                f"overwrite=True (--overwrite) to replace it, or choose another name.") from None
        except OSError:  # file system without hard links
            if path.exists():
                raise OutputExistsError(f"output file {path} already exists and was left unchanged. Pass "
                                        f"overwrite=True (--overwrite) to replace it, or choose another name.") from None
            os.replace(tmp, path)
        else:
            tmp.unlink()
    _fsync_dir(path.parent)


def _give_default_permissions(fd: int) -> None:
    """mkstemp makes owner-only files; give the output the mode a plain ``open()`` would (0666 & ~umask)."""
    if not hasattr(os, "fchmod"):
        return
    umask = 0o022
    try:  # read without os.umask(), which would briefly change it for every thread
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    os.fchmod(fd, 0o666 & ~umask)


def _fsync_dir(folder: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _header_room(header_bytes: int) -> int:
    """The padded header length (at least ``header_bytes``) that starts the data at a multiple of
    ``_DATA_ALIGN`` bytes in the file (the header follows the 8-byte length)."""
    return _round_up(8 + header_bytes, _DATA_ALIGN) - 8

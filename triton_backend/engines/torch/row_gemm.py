"""Row-invariant float32 CPU kernels for the slot engine: ``y = x W^T (+ b)`` and attention, each
output computed the same way whatever the number of rows and wherever its row sits.

Why: MKL picks a different kernel by the number of rows (a GEMV for one row, other GEMMs for
2-3 and for >= 4 rows), and torch's attention products change with the number of query tokens,
so a sequence decoded alone, the same sequence in a batch, and the same positions in a verify
pass differ in the last bits: greedy tokens can flip at near-ties. MKL's small-M GEMMs are also
slow: a pass over 2-8 rows cost ~1.7 one-row steps, while the weights (the memory traffic that
bounds a decode step) are the same for every row.

The matmul (AVX2 + FMA) runs on a copy of the weight packed once into panels of 32
output columns, each stored k-major (``K`` groups of 32 floats), so a pass streams every weight
once, in order, and multiplies it into several input rows per sweep while it sits in cache
(up to 3 rows with AVX2's 16 registers, up to 12 with AVX-512's 32: an 8-row pass or a 9-token
verify chain streams each panel once), and a one-row step is cheaper than MKL's GEMV (measured:
scripts/analysis/matmul_rows.py). A tile of 3+ rows prefetches the next panel while it multiplies
(without it the memory stream idled during the FMAs: on an AVX-512 EPYC 8 rows cost ~1.5 one-row
passes, ~1.2 with it), and more rows than a tile holds split into near-equal tiles (13: 7 + 6, not
12 + 1). Element ``(m, j)`` is always ONE fused multiply-add chain
over ``k`` ascending (a vector lane), then the bias. Tile shapes (how many rows share a sweep)
change with ``M`` but never that order, so results are bit-identical for any
``M`` and any row position. With :meth:`RowGemm.set_threads` (``RuntimeConfig.kernel_threads``;
process-wide, the last engine loaded sets it) each call's panels are split among the caller and
helper threads, a panel computed by one thread with the same code: the bits do not depend on the
thread count. On this 2-core EPYC a one-row pass of SmolLM2-135M's weights takes ~13 ms on two
threads against ~15.5 alone, and a 13-row verify ~17 against ~25 (its FMAs, not the memory
stream, bound it), so speculation's wider passes cost little more than a decode step
(``benchmarks/results/pass-cost-cpu.md``). The attention computes every query token alone over its visible
positions in ascending order (scores, max, exponentials, sum, weighted values), so a position
gives the same bits in a decode step, a verify chain or a tree pass whose path is kept
(tests/test_row_gemm_engine.py and tests/test_llama_engine.py check both).

The C++ source, ``row_gemm.cpp`` beside this module, is compiled once per machine with the system C++ compiler into
``$SPECBUILD_CACHE_DIR/kernels/`` and called through ``ctypes`` (no torch headers: a build
takes about a second). Where it cannot be built (no compiler, no AVX2/FMA, not x86-64),
:func:`load_row_gemm` returns ``None`` and callers keep torch's kernels (logged).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# the kernels' C++ (beside this file; built by :func:`_build`, its text hashed into the library's name)
_SOURCE_FILE = Path(__file__).with_name("row_gemm.cpp")
_SOURCE = _SOURCE_FILE.read_text()

PANEL = 32  # output columns per packed panel (the C source's P)
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c++14", "-pthread"]
_ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx2", "-mfma", "-mavx512f"]}
_lock = threading.Lock()
_loaded: dict[str, tuple[Callable, Callable, Callable, Callable] | None] = {}
_threads = {"threads": 1, "min_rows": 1}  # the process's matmul threads (the library's pool is per process)
_pool_address: dict[str, int | None] = {}  # specbuild_pool_run's address per ISA build (weight_gemm shares the pool)

def cpu_isa() -> str | None:
    """``"avx512"``, ``"avx2"`` or ``None`` (no kernel): what this CPU runs, as torch detects it.
    ``SPECBUILD_ROW_KERNEL_ISA=avx2`` forces the AVX2 build on an AVX-512 CPU (measurements)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    isa = "avx512" if capability.startswith("AVX512") else "avx2" if capability.startswith("AVX2") else None
    forced = os.environ.get("SPECBUILD_ROW_KERNEL_ISA")
    if forced == "avx2" and isa is not None:
        return "avx2"
    return isa


def _kernel_dir() -> Path:
    from triton_backend.core.reference_model import cache_dir

    return cache_dir() / "kernels"


def _build(target: Path, flags: list[str], source_file: Path = _SOURCE_FILE) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.parent.stat().st_uid == os.getuid():  # a folder others may write is not trusted (verify_library)
        os.chmod(target.parent, target.parent.stat().st_mode & ~0o022)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *flags, str(source_file), "-o", str(out)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.chmod(out, 0o755)
        digest = Path(tmp) / "digest"
        digest.write_text(_file_sha256(out) + "\n")
        os.chmod(digest, 0o644)
        os.replace(digest, _digest_path(target))  # the hash first: a library never lacks its record
        os.replace(out, target)  # atomic: a concurrent loader sees the whole library or none


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify_library(library: Path) -> str | None:
    """Why the cached ``library`` must not be loaded (``None``: it may): it and its recorded hash
    belong to this user (or root) and are writable by no one else, its folder too, and its
    contents still have the hash recorded when it was built."""
    record = _digest_path(library)
    for path in (library.parent, library, record):
        try:
            st = path.stat()
        except OSError:
            return f"{path.name} is missing"
        if st.st_uid not in (os.getuid(), 0):
            return f"{path} belongs to uid {st.st_uid}, not to this user"
        if st.st_mode & 0o022:
            return f"{path} is writable by others (mode {st.st_mode & 0o777:o})"
    if record.read_text().strip() != _file_sha256(library):
        return f"{library.name} does not match the hash recorded when it was built"
    return None


def build_flags(isa: str) -> list[str]:
    """The compiler flags of an ``isa`` build (no fast-math, no FP contraction; the ISA's vector extensions)."""
    return _FLAGS + _ISA_FLAGS[isa]


def kernel_digest(isa: str) -> str:
    """The hash of the source and flags an ``isa`` build compiles (its library's file name)."""
    return hashlib.sha256((_SOURCE + " ".join(_FLAGS + _ISA_FLAGS[isa])).encode()).hexdigest()[:16]


def compiled_library(stem: str, source_file: Path, flags: list[str], digest: str) -> ctypes.CDLL:
    """The library built from ``source_file`` with ``flags`` (``$SPECBUILD_CACHE_DIR/kernels/<stem>-<digest>.so``),
    built on first use and hash-checked before it is opened (:func:`verify_library`). Raises
    ``OSError``, ``RuntimeError`` or ``subprocess.SubprocessError`` where it cannot be built or trusted."""
    target = _kernel_dir() / f"{stem}-{digest}.so"
    problem = verify_library(target) if target.is_file() else "not built yet"
    if problem is not None:
        if target.is_file():
            logger.warning("rebuilding %s: %s", target.name, problem)
        _build(target, flags, source_file)
        logger.info("built the CPU kernel library %s", target)
        problem = verify_library(target)
        if problem is not None:
            raise RuntimeError(f"{target.name} cannot be loaded safely: {problem}")
    return ctypes.CDLL(str(target))


def _load(isa: str) -> tuple[Callable, ...] | None:
    try:
        lib = compiled_library(f"row_gemm-{isa}", _SOURCE_FILE, _FLAGS + _ISA_FLAGS[isa], kernel_digest(isa))
        fn, pack, attention = lib.specbuild_panel_gemm, lib.specbuild_pack_panels, lib.specbuild_row_attention
        threads = lib.specbuild_set_threads
        norm, rope, rope_store = lib.specbuild_rms_norm, lib.specbuild_rope, lib.specbuild_rope_store
        _pool_address[isa] = ctypes.cast(lib.specbuild_pool_run, ctypes.c_void_p).value
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("row-invariant CPU matmul kernel unavailable (%s): torch kernels used", exc)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p]
    fn.restype = None
    pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    pack.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    attention.argtypes = [p, i64, i64, i64, i64, p, p, i64, i64, p, ctypes.c_float, p, p]
    attention.restype = None
    threads.argtypes = [ctypes.c_int, ctypes.c_int64]
    threads.restype = ctypes.c_int
    norm.argtypes = [p, i64, i64, p, ctypes.c_float, p]
    norm.restype = None
    rope.argtypes = [p, i64, i64, i64, p, p]
    rope.restype = None
    rope_store.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p, i64, i64]
    rope_store.restype = None
    return fn, pack, attention, threads, norm, rope, rope_store


def kernel_input(x: torch.Tensor, k: int, kernel: str) -> torch.Tensor:
    """``x`` ``[M, k]`` float32 on CPU, contiguous: the few checks that keep a kernel inside its
    buffers, in their cheapest form (~200 calls a decode step)."""
    shape = x.shape
    if len(shape) != 2 or shape[1] != k or x.dtype is not torch.float32 or not x.is_cpu:
        raise ValueError(f"{kernel} needs x [M, {k}] float32 on CPU, got {tuple(shape)} {x.dtype} {x.device}")
    return x if x.is_contiguous() else x.contiguous()


def _plain_floats(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is contiguous float32 on the CPU: what a kernel reading raw pointers needs."""
    return all(t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)


class BoundGemm:
    """One linear layer on the row kernel: ``x [M, K] -> x weight^T + bias [M, N]``. Holds the
    packed weight and the bias, whose memory the kernel reads through raw pointers."""

    def __init__(self, fn: Any, packed: torch.Tensor, bias: torch.Tensor | None, n: int, k: int) -> None:
        self.packed, self.bias, self.n, self.k = packed, bias, n, k
        self._fn = fn
        self._w, self._b = packed.data_ptr(), None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = kernel_input(x, self.k, "row_gemm")
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m:
            self._fn(x.data_ptr(), m, self.k, self._w, self._b, self.n, y.data_ptr())
        return y


class RowGemm:
    """The loaded kernel: ``row_gemm(x [M, K], weight [N, K], bias [N] | None) -> [M, N]``
    (float32 CPU), and :meth:`bind` for a layer whose weight is checked once."""

    def __init__(self, fn: Callable, pack: Callable, attention: Callable, set_threads: Callable, norm: Callable,
                 rope: Callable, rope_store: Callable, isa: str) -> None:
        self._base_name = f"row_gemm-{isa}-{kernel_digest(isa)}"
        self._fn = fn
        self._pack = pack
        self._attention = attention
        self._set_threads = set_threads
        self._norm = norm
        self._rope = rope
        self._rope_store = rope_store
        self.isa = isa

    @property
    def name(self) -> str:
        """Names the exact kernel and its thread count (caches of its timings)."""
        threads = _threads["threads"]
        return self._base_name if threads == 1 else f"{self._base_name}-t{threads}x{_threads['min_rows']}"

    @property
    def threads(self) -> int:
        return _threads["threads"]

    def set_threads(self, threads: int, min_rows: int = 1) -> int:
        """Share every matmul of ``>= min_rows`` rows among ``threads`` threads of this process (the
        caller's and ``threads - 1`` helpers; 1: none). Each thread computes whole panels with the
        same code, so results have the same bits for any thread count. Returns the count in use."""
        if threads < 1 or min_rows < 1:
            raise ValueError(f"row kernel threads and min_rows must be >= 1, got {threads}, {min_rows}")
        with _lock:
            used = int(self._set_threads(int(threads), int(min_rows)))
            _threads.update(threads=used, min_rows=int(min_rows))
        return used

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.bind(weight, bias)(x)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "BoundGemm":
        """``x -> x weight^T + bias`` with the weight's checks done here, once (the per-call
        checks are the few that keep the kernel inside its buffers)."""
        if weight.dim() != 2 or any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu")
                                    for t in (weight, bias)):
            raise ValueError("row_gemm runs float32 CPU tensors only: weight [N, K], bias [N]")
        if not weight.is_contiguous() or (bias is not None and (not bias.is_contiguous() or bias.shape != weight.shape[:1])):
            raise ValueError("row_gemm needs a contiguous weight (and bias [N])")
        n, k = weight.shape
        packed = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.float32)  # the weight in panels, once
        self._pack(weight.data_ptr(), n, k, packed.data_ptr())
        return BoundGemm(self._fn, packed, bias, n, k)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMS norm of ``x`` ``[M, K]`` (float32 CPU) with ``weight`` ``[K]``, each row alone in one
        fixed order (see the C source): one call where torch's norm is several dispatches."""
        m, k = x.shape
        x = kernel_input(x, k, "row rms_norm")
        if weight.shape != (k,) or weight.dtype is not torch.float32 or not weight.is_contiguous():
            raise ValueError(f"row rms_norm needs a contiguous float32 weight [{k}], got {tuple(weight.shape)}")
        out = torch.empty(m, k, dtype=torch.float32)
        self._norm(x.data_ptr(), m, k, weight.data_ptr(), float(eps), out.data_ptr())
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """RoPE in place on ``x`` ``[T, heads, d]`` with ``cos``/``sin_signed`` ``[T, 1, d]`` (or ``[T, d]``):
        the same bits as :func:`~triton_backend.engines.torch.llama_forward.rotate_signed`."""
        t, heads, d = x.shape
        if not _plain_floats(x, cos, sin_signed) or d % 2:
            raise ValueError("row rope runs contiguous float32 CPU tensors with an even head size only")
        if cos.numel() != t * d or sin_signed.numel() != t * d:
            raise ValueError(f"row rope: cos/sin hold {cos.numel()}/{sin_signed.numel()} values, want {t} x {d}")
        self._rope(x.data_ptr(), t, heads, d, cos.data_ptr(), sin_signed.data_ptr())
        return x

    def rope_store(self, y: torch.Tensor, q: torch.Tensor, offset: int, n: int, cos: torch.Tensor, sin_signed: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Tokens ``offset .. offset + n - 1`` of a fused q/k/v output ``y`` ``[T, (heads + 2 kv_heads) d]``
        (one slot's, at positions ``start ..``): q rotated into ``q`` ``[T, heads, d]``, k rotated and v
        copied into the slot's ``keys``/``values`` ``[kv_heads, S, d]``; ``cos``/``sin_signed`` hold ``T x d``
        values. The bits of :meth:`rope_` and the cache's write."""
        t, heads, d = q.shape
        kv_heads, positions = keys.shape[0], keys.shape[1]
        if not _plain_floats(y, q, cos, sin_signed, keys, values) or d % 2:
            raise ValueError("row rope_store runs contiguous float32 CPU tensors with an even head size only")
        if (y.shape != (t, (heads + 2 * kv_heads) * d) or keys.shape != values.shape or keys.shape[2] != d
                or cos.numel() != t * d or sin_signed.numel() != t * d or offset < 0 or n < 0 or offset + n > t
                or start < 0 or start + n > positions):
            raise ValueError(f"row rope_store: inconsistent shapes y {tuple(y.shape)}, q {tuple(q.shape)}, keys "
                             f"{tuple(keys.shape)}, tokens {offset}+{n}, start {start}")
        row, qrow = y.shape[1], heads * d
        self._rope_store(y.data_ptr() + 4 * offset * row, n, heads, kv_heads, d, cos.data_ptr() + 4 * offset * d,
                         sin_signed.data_ptr() + 4 * offset * d, q.data_ptr() + 4 * offset * qrow, keys.data_ptr(),
                         values.data_ptr(), positions, start)

    def layer_calls(self, keys: torch.Tensor, values: torch.Tensor, t: int, heads: int, cos: torch.Tensor,
                    sin_signed: torch.Tensor, rows: list, scale: float, scratch: torch.Tensor) -> LayerCalls:
        """A pass's :class:`LayerCalls` over the whole cache ``keys``/``values`` ``[layers, slots, kv_heads, S, d]``."""
        return LayerCalls(self, keys, values, t, heads, cos, sin_signed, rows, scale, scratch)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                  visible: torch.Tensor | None, scale: float, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """One slot's attention for ``n`` query tokens into ``out``, each query computed alone in
        one fixed order (see the C source). ``q``/``out`` ``[n, heads, d]``; ``keys``/``values``
        the slot's ``[kv_heads, S, d]``; ``visible`` ``[n, start + n]`` uint8 (a tree mask) or
        ``None`` (causal: query ``i`` sees ``0 .. start + i``); ``scratch`` >= ``start + n`` floats."""
        n, heads, d = q.shape
        kv_heads, positions = keys.shape[0], keys.shape[1]
        if not _plain_floats(q, keys, values, out, scratch):
            raise ValueError("row attention runs contiguous float32 CPU tensors only")
        if (keys.shape != values.shape or keys.shape[2] != d or out.shape != q.shape or heads % kv_heads
                or start + n > positions or scratch.numel() < start + n):
            raise ValueError(f"row attention: inconsistent shapes q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                             f"start {start}, scratch {scratch.numel()}")
        if visible is not None and (visible.dtype != torch.uint8 or visible.shape != (n, start + n)
                                    or not visible.is_contiguous()):
            raise ValueError("row attention: the visibility mask is a contiguous uint8 [n, start + n]")
        self._attention(q.data_ptr(), n, heads, kv_heads, d, keys.data_ptr(), values.data_ptr(), positions, start,
                        None if visible is None else visible.data_ptr(), scale, out.data_ptr(), scratch.data_ptr())


class LayerCalls:
    """One pass's q/k/v rotation, cache stores and attention on the row kernel, every layer's: the
    tensors' checks done once for the pass (:meth:`RowGemm.layer_calls`), then each layer's calls are
    the C functions on raw addresses (the calls :meth:`RowGemm.rope_store` and
    :meth:`RowGemm.attention` make: the same bits), with one ``q`` and one output buffer for all layers.
    ``rows``: ``(slot, start, offset, n, visible)`` per row, ``visible`` a uint8 tree mask or None."""

    def __init__(self, kernel: "RowGemm", keys: torch.Tensor, values: torch.Tensor, t: int, heads: int,
                 cos: torch.Tensor, sin_signed: torch.Tensor, rows: list, scale: float, scratch: torch.Tensor) -> None:
        layers, slots, kv_heads, positions, d = keys.shape
        if not _plain_floats(keys, values, cos, sin_signed, scratch) or keys.shape != values.shape or d % 2 or heads % kv_heads:
            raise ValueError("row layer calls run contiguous float32 CPU tensors with an even head size only")
        if cos.numel() != t * d or sin_signed.numel() != t * d:
            raise ValueError(f"row layer calls: cos/sin hold {cos.numel()}/{sin_signed.numel()} values, want {t} x {d}")
        self.q = torch.empty(t, heads, d, dtype=torch.float32)
        self.out = torch.empty(t, heads, d, dtype=torch.float32)
        self.width = (heads + 2 * kv_heads) * d
        self._rope_store, self._attention, self._norm = kernel._rope_store, kernel._attention, kernel._norm
        self._normed: torch.Tensor | None = None  # rms_norm's output, one for all layers (each read at once)
        self._dims = (heads, kv_heads, d)
        self._positions, self._scale, self._scratch = positions, float(scale), scratch.data_ptr()
        self._layer = 4 * keys.stride(0)  # bytes between layers; slots are keys.stride(1) floats apart
        self._q, self._out, self._cos, self._sin = self.q.data_ptr(), self.out.data_ptr(), cos.data_ptr(), sin_signed.data_ptr()
        self._rows = []  # (offset, n, start, its cos/sin byte offset, its q/out byte offset, its slot's keys, values, mask)
        for slot, start, offset, n, visible in rows:
            if not (0 <= slot < slots and 0 <= offset and offset + n <= t and 0 <= start and start + n <= positions):
                raise ValueError(f"row layer calls: row slot {slot}, tokens {offset}+{n} at {start} outside the pass "
                                 f"({t} tokens) or the cache ({slots} slots x {positions} positions)")
            if scratch.numel() < start + n:
                raise ValueError(f"row layer calls: scratch holds {scratch.numel()} floats, want {start + n}")
            if visible is not None and (visible.dtype != torch.uint8 or visible.shape != (n, start + n)
                                        or not visible.is_contiguous()):
                raise ValueError("row layer calls: a visibility mask is a contiguous uint8 [n, start + n]")
            slot_at = 4 * slot * keys.stride(1)
            self._rows.append((offset, n, start, 4 * offset * d, 4 * offset * heads * d,
                               keys.data_ptr() + slot_at, values.data_ptr() + slot_at,
                               None if visible is None else visible.data_ptr()))
        self._keep = (keys, values, cos, sin_signed, scratch, [r[4] for r in rows])  # the memory the addresses point into

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """:meth:`RowGemm.rms_norm` of the pass's stream ``x`` ``[T, K]`` into one buffer for all layers
        (the same bits): each result must be read before the next call overwrites it."""
        t, k = x.shape
        if t != self.q.shape[0] or weight.numel() != k or not _plain_floats(x, weight):
            raise ValueError(f"row layer calls: rms_norm of {tuple(x.shape)} {x.dtype} with weight {tuple(weight.shape)}, "
                             f"want contiguous float32 [{self.q.shape[0]}, K] and [K]")
        if self._normed is None or self._normed.shape[1] != k:
            self._normed = torch.empty(t, k, dtype=torch.float32)
        self._norm(x.data_ptr(), t, k, weight.data_ptr(), float(eps), self._normed.data_ptr())
        return self._normed

    def rope_store(self, layer: int, y: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s fused q/k/v output ``y`` ``[T, width]``: q rotated into :attr:`q`, k rotated
        and v stored in each row's slot; returns :attr:`q`."""
        if y.shape != (self.q.shape[0], self.width) or not _plain_floats(y):
            raise ValueError(f"row layer calls: q/k/v output {tuple(y.shape)}, want contiguous float32 "
                             f"[{self.q.shape[0]}, {self.width}]")
        heads, kv_heads, d = self._dims
        base, at = y.data_ptr(), layer * self._layer
        for offset, n, start, cs, qs, keys, values, _ in self._rows:
            self._rope_store(base + 4 * offset * self.width, n, heads, kv_heads, d, self._cos + cs, self._sin + cs,
                             self._q + qs, keys + at, values + at, self._positions, start)
        return self.q

    def attention(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s attention of :attr:`q` for every row into :attr:`out` (returned)."""
        heads, kv_heads, d = self._dims
        at = layer * self._layer
        for _, n, start, _, qs, keys, values, visible in self._rows:
            self._attention(self._q + qs, n, heads, kv_heads, d, keys + at, values + at, self._positions, start, visible,
                            self._scale, self._out + qs, self._scratch)
        return self.out


def _functions(isa: str) -> tuple[Callable, ...] | None:
    """The ``isa`` build's functions, loaded (and built) on first use; None where it cannot be."""
    with _lock:
        if isa not in _loaded:
            _loaded[isa] = _load(isa)
    return _loaded[isa]


def pool_address(isa: str) -> int | None:
    """The address of the ``isa`` build's ``specbuild_pool_run`` (its helper threads, which the
    compact-weight kernel shares); None where that build is unavailable."""
    return _pool_address.get(isa) if _functions(isa) is not None else None


def load_row_gemm() -> "RowGemm | None":
    """The row-invariant matmul, built on first use; ``None`` where it cannot run here."""
    isa = cpu_isa()
    if isa is None:
        logger.info("row-invariant CPU matmul unavailable (needs x86-64 with AVX2 + FMA): torch kernels used")
        return None
    fns = _functions(isa)
    return None if fns is None else RowGemm(*fns, isa)


__all__ = ["BoundGemm", "LayerCalls", "RowGemm", "build_flags", "compiled_library", "cpu_isa", "kernel_digest", "kernel_input", "load_row_gemm",
           "pool_address"]

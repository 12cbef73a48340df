"""Row-invariant float32 CPU kernels for the slot engine: ``y = x W^T (+ b)`` and attention, each
output computed the same way whatever the number of rows and wherever its row sits.

Why: MKL picks a different kernel by the number of rows (a GEMV for one row, other GEMMs for
2-3 and for >= 4 rows), and torch's attention products change with the number of query tokens,
so a sequence decoded alone, the same sequence in a batch, and the same positions in a verify
pass differ in the last bits: greedy tokens can flip at near-ties. MKL's small-M GEMMs are also
slow: a pass over 2-8 rows cost ~1.7 one-row steps, while the weights (the memory traffic that
bounds a decode step) are the same for every row.

The matmul (AVX2 + FMA; one thread) runs on a copy of the weight packed once into panels of 32
output columns, each stored k-major (``K`` groups of 32 floats), so a pass streams every weight
once, in order, and multiplies it into several input rows per sweep while it sits in cache
(up to 3 rows with AVX2's 16 registers, up to 12 with AVX-512's 32: an 8-row pass or a 9-token
verify chain streams each panel once): 2-8 row passes cost little more than one row, and a
one-row step is cheaper than MKL's GEMV (measured: scripts/matmul_rows.py). Element ``(m, j)`` is always ONE fused multiply-add chain
over ``k`` ascending (a vector lane), then the bias. Tile shapes (how many rows share a sweep)
change with ``M`` but never that order, so results are bit-identical for any
``M`` and any row position. The attention computes every query token alone over its visible
positions in ascending order (scores, max, exponentials, sum, weighted values), so a position
gives the same bits in a decode step, a verify chain or a tree pass whose path is kept
(tests/test_row_gemm_engine.py and tests/test_llama_engine.py check both).

The C++ source below is compiled once per machine with the system C++ compiler into
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

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
/* the attention's vectors: 16 lanes (the matmul's panels are 8-lane AVX2 on every CPU) */
typedef __m512 vec;
#define LANES 16
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
#define vstore _mm512_storeu_ps
#define vmax _mm512_max_ps
#define vmul _mm512_mul_ps
#define vsub _mm512_sub_ps
#define vround(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vpow2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
static inline float hsum(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#else
/* the attention's vectors: 8 lanes */
typedef __m256 vec;
#define LANES 8
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define vstore _mm256_storeu_ps
#define vmax _mm256_max_ps
#define vmul _mm256_mul_ps
#define vsub _mm256_sub_ps
#define vround(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vpow2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* The scalar remainder k in [k0, K) of a dot product: one function, never inlined, so every call rounds it alike. */
__attribute__((noinline)) static float tail_dot(const float* x, const float* w, int64_t k, int64_t K) {
    float s = 0.0f;
    for (; k < K; ++k) s = __builtin_fmaf(x[k], w[k], s);
    return s;
}

/* Weights are packed once into panels of P = 32 output columns: panel q holds
   w[q*P .. q*P+31][0 .. K-1] as K consecutive groups of 32 floats (zero padded past N). */
enum { P = 32 };

extern "C" void specbuild_pack_panels(const float* w, int64_t N, int64_t K, float* p) {
    const int64_t panels = (N + P - 1) / P;
    memset(p, 0, sizeof(float) * panels * K * P);
    for (int64_t n = 0; n < N; ++n) {
        float* dst = p + (n / P) * K * P + (n % P);
        const float* src = w + n * K;
        for (int64_t k = 0; k < K; ++k) dst[k * P] = src[k];
    }
}

#if defined(__AVX512F__)
/* With 32 vector registers a tile holds up to 12 rows (24 accumulators: two 16-lane vectors per
   row, the panel's 32 columns), so an 8-row pass or a 9-token verify chain streams each panel once. */
enum { MAX_TILE_ROWS = 12 };

/* R input rows x one panel: every output is ONE fused multiply-add chain over k = 0 .. K-1
   in order (a lane of an accumulator), whatever R is, and the same chain as the 8-lane build's. */
template <int R>
static inline void panel_tile(const float* x, int64_t K, const float* pp, float* out) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = pp + k * P;
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        for (int r = 0; r < R; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(out + r * P, acc[r][0]);
        _mm512_storeu_ps(out + r * P + 16, acc[r][1]);
    }
}

static inline void tile(int64_t r, const float* x, int64_t K, const float* pp, float* buf) {
    switch (r) {
        case 12: panel_tile<12>(x, K, pp, buf); break;
        case 11: panel_tile<11>(x, K, pp, buf); break;
        case 10: panel_tile<10>(x, K, pp, buf); break;
        case 9: panel_tile<9>(x, K, pp, buf); break;
        case 8: panel_tile<8>(x, K, pp, buf); break;
        case 7: panel_tile<7>(x, K, pp, buf); break;
        case 6: panel_tile<6>(x, K, pp, buf); break;
        case 5: panel_tile<5>(x, K, pp, buf); break;
        case 4: panel_tile<4>(x, K, pp, buf); break;
        case 3: panel_tile<3>(x, K, pp, buf); break;
        case 2: panel_tile<2>(x, K, pp, buf); break;
        default: panel_tile<1>(x, K, pp, buf); break;
    }
}
#else
enum { MAX_TILE_ROWS = 3 };

/* R input rows x one panel: every output is ONE fused multiply-add chain over k = 0 .. K-1
   in order (a lane of an accumulator), whatever R is. */
template <int R>
static inline void panel_tile(const float* x, int64_t K, const float* pp, float* out) {
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = pp + k * P;
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        const __m256 w2 = _mm256_loadu_ps(wk + 16), w3 = _mm256_loadu_ps(wk + 24);
        for (int r = 0; r < R; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(xv, w3, acc[r][3]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + r * P + 8 * j, acc[r][j]);
}

static inline void tile(int64_t r, const float* x, int64_t K, const float* pp, float* buf) {
    if (r == 3) panel_tile<3>(x, K, pp, buf);
    else if (r == 2) panel_tile<2>(x, K, pp, buf);
    else panel_tile<1>(x, K, pp, buf);
}
#endif

/* y[M][N] = x[M][K] w[N][K]^T (+ b[N]) on the packed panels; row-major, contiguous. */
extern "C" void specbuild_panel_gemm(const float* x, int64_t M, int64_t K, const float* p, const float* b,
                                     int64_t N, float* y) {
    const int64_t panels = (N + P - 1) / P;
    float buf[MAX_TILE_ROWS * P];
    for (int64_t q = 0; q < panels; ++q) {
        const float* pp = p + q * K * P;
        const int64_t n0 = q * P, nn = N - n0 < P ? N - n0 : P;
        for (int64_t m = 0; m < M;) {
            const int64_t r = M - m >= MAX_TILE_ROWS ? MAX_TILE_ROWS : M - m;
            tile(r, x + m * K, K, pp, buf);
            for (int64_t i = 0; i < r; ++i) {
                float* yr = y + (m + i) * N + n0;
                const float* br = buf + i * P;
                if (b) for (int64_t j = 0; j < nn; ++j) yr[j] = br[j] + b[n0 + j];
                else memcpy(yr, br, sizeof(float) * nn);
            }
            m += r;
        }
    }
}
/* exp(v - top), lane-wise (a value gives the same bits in any lane or call): 2^n * p(r) with
   n = round((v - top) / ln 2), r by a two-part ln 2, p a degree-7 Taylor polynomial (|r| <= ln2 / 2:
   error < 1e-8 relative); arguments below -87 give ~1e-38, not 0 (negligible in a softmax sum). */
static inline vec exp_lanes(vec x) {
    x = vmax(x, vset1(-87.0f));
    const vec n = vround(vmul(x, vset1(1.44269504088896341f)));
    vec r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vec p = vset1(1.0f / 5040.0f);
    p = vfma(p, r, vset1(1.0f / 720.0f));
    p = vfma(p, r, vset1(1.0f / 120.0f));
    p = vfma(p, r, vset1(1.0f / 24.0f));
    p = vfma(p, r, vset1(1.0f / 6.0f));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.0f));
    p = vfma(p, r, vset1(1.0f));
    return vmul(p, vpow2(n));
}

static void exp_shifted(float* v, int64_t count, float top) {
    const vec shift = vset1(top);
    int64_t l = 0;
    for (; l + LANES <= count; l += LANES) vstore(v + l, exp_lanes(vsub(vload(v + l), shift)));
    if (l < count) {  /* the remainder through the same lanes, padded */
        float buf[LANES];
        for (int c = 0; c < LANES; ++c) buf[c] = l + c < count ? v[l + c] : top;
        vstore(buf, exp_lanes(vsub(vload(buf), shift)));
        for (int c = 0; l + c < count; ++c) v[l + c] = buf[c];
    }
}

static inline float dot(const float* a, const float* b, int64_t d) {
    vec acc = vzero();
    const int64_t DV = d - d % LANES;
    for (int64_t c = 0; c < DV; c += LANES) acc = vfma(vload(a + c), vload(b + c), acc);
    float s = hsum(acc);
    if (DV < d) s += tail_dot(a, b, DV, d);
    return s;
}

/* One slot's attention for n query tokens; each query computed alone, in one fixed order.
   q, out [n][heads][d]; keys, values [kv_heads][S][d] (the slot's cache, S positions).
   Query i sees the positions l <= start + i (vis NULL: causal) or those with vis[i * (start + n) + l]
   (a tree mask); scores, max, exponentials, their sum and the weighted values all run over the visible
   positions in ascending order, so a query gives the same bits in a pass of any size (a decode step, a
   verify chain, a tree whose accepted path later sits at consecutive positions). scratch: >= start + n floats. */
extern "C" void specbuild_row_attention(const float* q, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                                        const float* keys, const float* values, int64_t S, int64_t start,
                                        const unsigned char* vis, float scale, float* out, float* scratch) {
    const int64_t L = start + n, g = heads / kv_heads;
    for (int64_t i = 0; i < n; ++i) {
        const unsigned char* seen = vis ? vis + i * L : 0;
        const int64_t last = vis ? L - 1 : start + i;
        for (int64_t h = 0; h < heads; ++h) {
            const float* qh = q + (i * heads + h) * d;
            const float* kh = keys + (h / g) * S * d;
            const float* vh = values + (h / g) * S * d;
            float* o = out + (i * heads + h) * d;
            float top = -__builtin_inff();
            for (int64_t l = 0; l <= last; ++l) {
                if (seen && !seen[l]) continue;
                const float sc = dot(qh, kh + l * d, d) * scale;
                scratch[l] = sc;
                top = sc > top ? sc : top;
            }
            if (seen)
                for (int64_t l = 0; l <= last; ++l) if (!seen[l]) scratch[l] = top;  /* finite; skipped below */
            exp_shifted(scratch, last + 1, top);
            float total = 0.0f;
            for (int64_t l = 0; l <= last; ++l) {
                if (seen && !seen[l]) continue;
                total += scratch[l];
            }
            for (int64_t c = 0; c < d; ++c) o[c] = 0.0f;
            const int64_t DV = d - d % LANES;
            for (int64_t l = 0; l <= last; ++l) {
                if (seen && !seen[l]) continue;
                const float p = scratch[l] / total;
                const float* vl = vh + l * d;
                const vec pv = vset1(p);  /* lane-wise FMA: the same bits as the scalar loop */
                for (int64_t c = 0; c < DV; c += LANES) vstore(o + c, vfma(pv, vload(vl + c), vload(o + c)));
                for (int64_t c = DV; c < d; ++c) o[c] = __builtin_fmaf(p, vl[c], o[c]);
            }
        }
    }
}
"""

PANEL = 32  # output columns per packed panel (the C source's P)
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c++14"]
_ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"], "avx512": ["-mavx2", "-mfma", "-mavx512f"]}
_lock = threading.Lock()
_loaded: dict[str, tuple[Callable, Callable, Callable] | None] = {}

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


def _build(target: Path, flags: list[str]) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.parent.stat().st_uid == os.getuid():  # a folder others may write is not trusted (verify_library)
        os.chmod(target.parent, target.parent.stat().st_mode & ~0o022)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "row_gemm.cpp"
        src.write_text(_SOURCE)
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *flags, str(src), "-o", str(out)], capture_output=True, text=True, timeout=120)
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


def kernel_digest(isa: str) -> str:
    """The hash of the source and flags an ``isa`` build compiles (its library's file name)."""
    return hashlib.sha256((_SOURCE + " ".join(_FLAGS + _ISA_FLAGS[isa])).encode()).hexdigest()[:16]


def _load(isa: str) -> tuple[Callable, Callable, Callable] | None:
    flags = _FLAGS + _ISA_FLAGS[isa]
    target = _kernel_dir() / f"row_gemm-{isa}-{kernel_digest(isa)}.so"
    try:
        problem = verify_library(target) if target.is_file() else "not built yet"
        if problem is not None:
            if target.is_file():
                logger.warning("rebuilding the row kernel: %s", problem)
            _build(target, flags)
            logger.info("built the row-invariant CPU matmul kernel: %s", target)
            problem = verify_library(target)
            if problem is not None:
                raise RuntimeError(f"the row kernel cannot be loaded safely: {problem}")
        lib = ctypes.CDLL(str(target))
        fn, pack, attention = lib.specbuild_panel_gemm, lib.specbuild_pack_panels, lib.specbuild_row_attention
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
    return fn, pack, attention


class BoundGemm:
    """One linear layer on the row kernel: ``x [M, K] -> x weight^T + bias [M, N]``. Holds the
    packed weight and the bias, whose memory the kernel reads through raw pointers."""

    def __init__(self, fn: Any, packed: torch.Tensor, bias: torch.Tensor | None, n: int, k: int) -> None:
        self.packed, self.bias, self.n, self.k = packed, bias, n, k
        self._fn = fn
        self._w, self._b = packed.data_ptr(), None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.k, self.n
        if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"row_gemm needs x [M, {k}] float32 on CPU, got {tuple(x.shape)} {x.dtype} {x.device}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        if x.shape[0]:
            self._fn(x.data_ptr(), x.shape[0], k, self._w, self._b, n, y.data_ptr())
        return y


class RowGemm:
    """The loaded kernel: ``row_gemm(x [M, K], weight [N, K], bias [N] | None) -> [M, N]``
    (float32 CPU), and :meth:`bind` for a layer whose weight is checked once."""

    def __init__(self, fn: Callable, pack: Callable, attention: Callable, isa: str) -> None:
        self.name = f"row_gemm-{isa}-{kernel_digest(isa)}"  # names the exact kernel (caches of its timings)
        self._fn = fn
        self._pack = pack
        self._attention = attention
        self.isa = isa

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

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                  visible: torch.Tensor | None, scale: float, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """One slot's attention for ``n`` query tokens into ``out``, each query computed alone in
        one fixed order (see the C source). ``q``/``out`` ``[n, heads, d]``; ``keys``/``values``
        the slot's ``[kv_heads, S, d]``; ``visible`` ``[n, start + n]`` uint8 (a tree mask) or
        ``None`` (causal: query ``i`` sees ``0 .. start + i``); ``scratch`` >= ``start + n`` floats."""
        n, heads, d = q.shape
        kv_heads, positions = keys.shape[0], keys.shape[1]
        tensors = (q, keys, values, out, scratch)
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
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


def load_row_gemm() -> "RowGemm | None":
    """The row-invariant matmul, built on first use; ``None`` where it cannot run here."""
    isa = cpu_isa()
    if isa is None:
        logger.info("row-invariant CPU matmul unavailable (needs x86-64 with AVX2 + FMA): torch kernels used")
        return None
    with _lock:
        if isa not in _loaded:
            _loaded[isa] = _load(isa)
    fns = _loaded[isa]
    return None if fns is None else RowGemm(*fns, isa)


__all__ = ["BoundGemm", "RowGemm", "cpu_isa", "kernel_digest", "load_row_gemm"]

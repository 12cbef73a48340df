// Row-invariant CPU matmuls on compact weights: int8 and fp8 e4m3 (a float32 scale per output channel),
// int4 (a float32 scale per group of input channels; or a scale and a minimum per group, unsigned nibbles:
// GGUF Q4_1), int8 with a scale per group (GGUF Q8_0, Q6_K's values), float16 and bfloat16 (fp8's decoding:
// weight_gemm_fp8.h). Loaded by weight_gemm.py beside
// this file, built like row_gemm.cpp (same flags, plus -mf16c): -O3 -ffp-contract=off -fno-fast-math.
//
// Weights sit in the row kernel's panels of P = 32 output columns, k-major, in their compact type:
//   int8   [K][32] signed bytes                     (column j at byte j)
//   fp8    [K][32] e4m3 bytes                       (column j at byte j)
//   int4   [K][16] bytes, two signed nibbles each   (column j in byte j's low nibble, j + 16 in its high one;
//          int4 with minimums: unsigned nibbles 0 .. 15, same places)
//   f16/bf16 [K][32] 16-bit values
// Group scales (int4, int8 grouped): [K / G][32] floats per panel, minimums (int4 with minimums) likewise.
// int8 and fp8 channel scales: [N] floats.
//
// Every output is two fused multiply-add chains, over the even and over the odd k in ascending order,
// of x[k] times the weight decoded in registers (int4, int8 grouped: float(q) * scale, one rounding; int4
// with minimums: float(q) * scale + minimum, a multiply then an add, as GGUF's float dequantization does;
// int8, fp8, f16, bf16: exact in float32), then their sum; int8 and fp8 then multiply it by the channel scale, then the bias
// is added. Tile shapes change with the number of rows, never that order: results are bit-identical
// for any M and row position, and equal (bit for bit) the float32 row kernel run on the even and on
// the odd columns of the decoded weights, summed.
#include <immintrin.h>

#include <atomic>
#include <stdint.h>
#include <string.h>

#include "weight_gemm_fp8.h"

static const int64_t P = 32;
enum Format { FMT_INT8 = 1, FMT_INT4 = 2, FMT_F16 = 3, FMT_BF16 = 4, FMT_FP8 = 5, FMT_INT4_MIN = 6, FMT_INT8_GROUP = 7 };

static inline bool is_int4(int fmt) { return fmt == FMT_INT4 || fmt == FMT_INT4_MIN; }
/* weights decoded with a scale per group of input channels (then, int4 with minimums, plus its minimum) */
static inline bool grouped(int fmt) { return is_int4(fmt) || fmt == FMT_INT8_GROUP; }
/* bytes of one k-row of a panel */
static inline int64_t row_bytes(int fmt) {
    return is_int4(fmt) ? 16 : fmt == FMT_INT8 || fmt == FMT_INT8_GROUP || fmt == FMT_FP8 ? 32 : 64;
}

#if defined(__AVX512F__)
static const int64_t MAX_TILE_ROWS = 8;  /* 2 chains x 2 vectors x 8 rows: 32 accumulators (a few spill) */
static const int NV = 2;  // vectors per panel row
typedef __m512 V;
#define V_ZERO _mm512_setzero_ps
#define V_FMA _mm512_fmadd_ps
#define V_MUL _mm512_mul_ps
#define V_ADD _mm512_add_ps
#define V_SET1 _mm512_set1_ps
#define V_LOAD _mm512_loadu_ps
#define V_STORE _mm512_storeu_ps

template <int FMT>
static inline void decode(const uint8_t* row, V w[NV]) {
    if (FMT == FMT_FP8) {
        decode_fp8(row, w);
    } else if (FMT == FMT_INT8 || FMT == FMT_INT8_GROUP) {
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)row)));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + 16))));
    } else if (FMT == FMT_INT4) {  /* a nibble indexes the 16 values -8 .. 7 (vpermps reads an index's low 4 bits) */
        const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)row));
        w[0] = _mm512_permutexvar_ps(v, values);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
    } else if (FMT == FMT_INT4_MIN) {  /* unsigned nibbles 0 .. 15 */
        const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)row));
        w[0] = _mm512_permutexvar_ps(v, values);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
    } else if (FMT == FMT_F16) {
        w[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)row));
        w[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(row + 32)));
    } else {
        w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)row)), 16));
        w[1] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 32))), 16));
    }
}
#else
static const int64_t MAX_TILE_ROWS = 2;
static const int NV = 4;
typedef __m256 V;
#define V_ZERO _mm256_setzero_ps
#define V_FMA _mm256_fmadd_ps
#define V_MUL _mm256_mul_ps
#define V_ADD _mm256_add_ps
#define V_SET1 _mm256_set1_ps
#define V_LOAD _mm256_loadu_ps
#define V_STORE _mm256_storeu_ps

static inline __m256i bytes8(const uint8_t* p, bool is_signed) {
    const __m128i b = _mm_loadl_epi64((const __m128i*)p);
    return is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}

template <int FMT>
static inline void decode(const uint8_t* row, V w[NV]) {
    if (FMT == FMT_FP8) {
        decode_fp8(row, w);
    } else if (FMT == FMT_INT8 || FMT == FMT_INT8_GROUP) {
        for (int j = 0; j < 4; ++j) w[j] = _mm256_cvtepi32_ps(bytes8(row + 8 * j, true));
    } else if (FMT == FMT_INT4) {
        for (int j = 0; j < 2; ++j) {  /* bytes 8j .. 8j+7: columns 8j.. (low nibbles) and 16 + 8j.. (high) */
            const __m256i v = bytes8(row + 8 * j, false);
            w[j] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 28), 28));
            w[2 + j] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 28));
        }
    } else if (FMT == FMT_INT4_MIN) {  /* unsigned nibbles 0 .. 15 */
        for (int j = 0; j < 2; ++j) {
            const __m256i v = bytes8(row + 8 * j, false);
            w[j] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
            w[2 + j] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        }
    } else if (FMT == FMT_F16) {
        for (int j = 0; j < 4; ++j) w[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + 16 * j)));
    } else {
        for (int j = 0; j < 4; ++j)
            w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * j))), 16));
    }
}
#endif

static const int LANES = P / NV;

/* R input rows x one panel; scales (grouped formats only): this panel's [K / G][32] group scales, mins
   (int4 with minimums only) its [K / G][32] group minimums.
   Two fused multiply-add chains per output, one over the even k and one over the odd k (each in
   ascending order), added at the end: the same two chains whatever R is. Two chains, not one, because
   at one row a single chain's FMA latency, not the compact weights' memory traffic, bounded the step. */
template <int R, int FMT>
static inline void panel_tile(const float* x, int64_t K, const uint8_t* pp, const float* scales, const float* mins,
                              int64_t G, float* out) {
    V even[R][NV], odd[R][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) even[r][j] = odd[r][j] = V_ZERO();
    const int64_t rb = row_bytes(FMT);
    const int64_t step = grouped(FMT) ? G : K;  /* G is even: a pair of k never straddles two groups */
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        V s[NV], mn[NV];
        if (grouped(FMT))
            for (int j = 0; j < NV; ++j) s[j] = V_LOAD(scales + (k0 / G) * P + LANES * j);
        if (FMT == FMT_INT4_MIN)
            for (int j = 0; j < NV; ++j) mn[j] = V_LOAD(mins + (k0 / G) * P + LANES * j);
        int64_t k = k0;
        for (; k + 1 < k0 + step; k += 2) {
            V w0[NV], w1[NV];
            decode<FMT>(pp + k * rb, w0);
            decode<FMT>(pp + (k + 1) * rb, w1);
            if (FMT == FMT_INT4_MIN)
                for (int j = 0; j < NV; ++j)
                    w0[j] = V_ADD(V_MUL(w0[j], s[j]), mn[j]), w1[j] = V_ADD(V_MUL(w1[j], s[j]), mn[j]);
            else if (grouped(FMT))
                for (int j = 0; j < NV; ++j) w0[j] = V_MUL(w0[j], s[j]), w1[j] = V_MUL(w1[j], s[j]);
            for (int r = 0; r < R; ++r) {
                const V x0 = V_SET1(x[r * K + k]), x1 = V_SET1(x[r * K + k + 1]);
                for (int j = 0; j < NV; ++j) even[r][j] = V_FMA(x0, w0[j], even[r][j]);
                for (int j = 0; j < NV; ++j) odd[r][j] = V_FMA(x1, w1[j], odd[r][j]);
            }
        }
        if (k < k0 + step) {  /* K odd (never grouped): its last k is even */
            V w0[NV];
            decode<FMT>(pp + k * rb, w0);
            for (int r = 0; r < R; ++r) {
                const V x0 = V_SET1(x[r * K + k]);
                for (int j = 0; j < NV; ++j) even[r][j] = V_FMA(x0, w0[j], even[r][j]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) V_STORE(out + r * P + LANES * j, V_ADD(even[r][j], odd[r][j]));
}

template <int FMT>
static void tile(int64_t r, const float* x, int64_t K, const uint8_t* pp, const float* sp, const float* mp, int64_t G,
                 float* buf) {
    switch (r) {
#if defined(__AVX512F__)
        case 8: panel_tile<8, FMT>(x, K, pp, sp, mp, G, buf); break;
        case 7: panel_tile<7, FMT>(x, K, pp, sp, mp, G, buf); break;
        case 6: panel_tile<6, FMT>(x, K, pp, sp, mp, G, buf); break;
        case 5: panel_tile<5, FMT>(x, K, pp, sp, mp, G, buf); break;
        case 4: panel_tile<4, FMT>(x, K, pp, sp, mp, G, buf); break;
        case 3: panel_tile<3, FMT>(x, K, pp, sp, mp, G, buf); break;
#endif
        case 2: panel_tile<2, FMT>(x, K, pp, sp, mp, G, buf); break;
        default: panel_tile<1, FMT>(x, K, pp, sp, mp, G, buf); break;
    }
}

template <int FMT>
static void gemm(const float* x, int64_t M, int64_t K, const uint8_t* p, const float* scales, const float* mins,
                 int64_t G, const float* b, int64_t N, float* y, int64_t q0, int64_t q1) {
    const int64_t panel_bytes = K * row_bytes(FMT);
    float buf[MAX_TILE_ROWS * P];
    for (int64_t q = q0; q < q1; ++q) {
        const uint8_t* pp = p + q * panel_bytes;
        const float* sp = grouped(FMT) ? scales + q * (K / G) * P : 0;
        const float* mp = FMT == FMT_INT4_MIN ? mins + q * (K / G) * P : 0;
        const int64_t n0 = q * P, nn = N - n0 < P ? N - n0 : P;
        for (int64_t m = 0; m < M;) {
            const int64_t r = M - m >= MAX_TILE_ROWS ? MAX_TILE_ROWS : M - m;
            tile<FMT>(r, x + m * K, K, pp, sp, mp, G, buf);
            for (int64_t i = 0; i < r; ++i) {
                float* yr = y + (m + i) * N + n0;
                const float* br = buf + i * P;
                if (FMT == FMT_INT8 || FMT == FMT_FP8) {  /* the chain times its channel scale, then the bias (two roundings) */
                    for (int64_t j = 0; j < nn; ++j) {
                        const float v = br[j] * scales[n0 + j];
                        yr[j] = b ? v + b[n0 + j] : v;
                    }
                } else if (b) {
                    for (int64_t j = 0; j < nn; ++j) yr[j] = br[j] + b[n0 + j];
                } else {
                    memcpy(yr, br, sizeof(float) * nn);
                }
            }
            m += r;
        }
    }
}

/* The row kernel's thread pool (row_gemm.cpp's specbuild_pool_run, its address handed over by
   specbuild_weight_set_pool): a call's panels split among its threads, each panel computed by one
   thread with the code above (the same bits for any thread count). Unset: the caller's thread alone. */
typedef void (*range_fn)(const void* args, int64_t lo, int64_t hi, int shared);
typedef void (*pool_fn)(range_fn fn, const void* args, int64_t count);
static std::atomic<pool_fn> pool_run{0};

extern "C" void specbuild_weight_set_pool(void* run) { pool_run.store((pool_fn)run); }

namespace {
struct GemmArgs {
    int fmt;
    const float* x;
    int64_t M, K;
    const uint8_t* p;
    const float* scales;
    const float* mins;
    int64_t G;
    const float* b;
    int64_t N;
    float* y;
};

void gemm_range(const void* a, int64_t q0, int64_t q1, int) {
    const GemmArgs& g = *(const GemmArgs*)a;
    switch (g.fmt) {
        case FMT_INT8: gemm<FMT_INT8>(g.x, g.M, g.K, g.p, g.scales, 0, 0, g.b, g.N, g.y, q0, q1); break;
        case FMT_INT4: gemm<FMT_INT4>(g.x, g.M, g.K, g.p, g.scales, 0, g.G, g.b, g.N, g.y, q0, q1); break;
        case FMT_INT4_MIN: gemm<FMT_INT4_MIN>(g.x, g.M, g.K, g.p, g.scales, g.mins, g.G, g.b, g.N, g.y, q0, q1); break;
        case FMT_INT8_GROUP: gemm<FMT_INT8_GROUP>(g.x, g.M, g.K, g.p, g.scales, 0, g.G, g.b, g.N, g.y, q0, q1); break;
        case FMT_F16: gemm<FMT_F16>(g.x, g.M, g.K, g.p, g.scales, 0, 0, g.b, g.N, g.y, q0, q1); break;
        case FMT_BF16: gemm<FMT_BF16>(g.x, g.M, g.K, g.p, g.scales, 0, 0, g.b, g.N, g.y, q0, q1); break;
        default: gemm<FMT_FP8>(g.x, g.M, g.K, g.p, g.scales, 0, 0, g.b, g.N, g.y, q0, q1); break;
    }
}
}  // namespace

/* y[M][N] = x[M][K] W[N][K]^T (+ b[N]) for W in format fmt, packed as above. Returns 0, or -1 for
   arguments the kernel cannot run (unknown format; a grouped format with an odd G or K not a multiple of G). */
extern "C" int specbuild_weight_gemm(int fmt, const float* x, int64_t M, int64_t K, const void* p,
                                     const float* scales, const float* mins, int64_t G, const float* b, int64_t N,
                                     float* y) {
    if (fmt < FMT_INT8 || fmt > FMT_INT8_GROUP) return -1;
    if (grouped(fmt) && (G <= 0 || G % 2 || K % G)) return -1;
    const GemmArgs args{fmt, x, M, K, (const uint8_t*)p, scales, mins, G, b, N, y};
    const int64_t panels = (N + P - 1) / P;
    const pool_fn run = pool_run.load(std::memory_order_relaxed);
    if (run) run(gemm_range, &args, panels);
    else gemm_range(&args, 0, panels, 0);
    return 0;
}

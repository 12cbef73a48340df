// Row-invariant CPU matmuls on compact weights. Loaded by weight_gemm.py beside this file, built like
// row_gemm.cpp (same flags, plus -mf16c): -O3 -ffp-contract=off -fno-fast-math.
//
// Float formats: fp8 e4m3 (a float32 scale per output channel; its decoding: weight_gemm_fp8.h), float16
// and bfloat16. Weights sit in the row kernel's panels of P = 32 output columns, k-major:
//   fp8    [K][32] e4m3 bytes      (column j at byte j)
//   f16/bf16 [K][32] 16-bit values
// Every output is two fused multiply-add chains, over the even and over the odd k in ascending order, of
// x[k] times the weight decoded in registers (exact in float32), then their sum; fp8 then multiplies it by
// the channel scale; then the bias is added. Tile shapes change with the number of rows, never that
// order: results are bit-identical for any M and row position, and equal (bit for bit) the float32 row
// kernel run on the even and on the odd columns of the decoded weights, summed.
//
// Integer formats (int8 with a scale per output channel or per group of input channels: GGUF Q8_0; int4
// with a scale per group, or a scale and a minimum per group: GGUF Q4_0 / Q4_1): 16-bit activations and
// integer dot products, described above int_gemm below.
#include <immintrin.h>

#include <atomic>
#include <vector>
#include <stdint.h>
#include <string.h>

#include "weight_gemm_fp8.h"

static const int64_t P = 32;
enum Format { FMT_INT8 = 1, FMT_INT4 = 2, FMT_F16 = 3, FMT_BF16 = 4, FMT_FP8 = 5, FMT_INT4_MIN = 6, FMT_INT8_GROUP = 7,
              FMT_HALF = 16 /* or'ed into a grouped format: its scales (and minimums) are float16 */ };

static inline bool is_int4(int fmt) { return fmt == FMT_INT4 || fmt == FMT_INT4_MIN; }
/* weights decoded with a scale per group of input channels (then, int4 with minimums, plus its minimum) */
static inline bool grouped(int fmt) { return is_int4(fmt) || fmt == FMT_INT8_GROUP; }
/* bytes of one k-row of a float format's panel */
static inline int64_t row_bytes(int fmt) { return fmt == FMT_FP8 ? 32 : 64; }

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

template <int FMT>
static inline void decode(const uint8_t* row, V w[NV]) {
    if (FMT == FMT_FP8) {
        decode_fp8(row, w);
    } else if (FMT == FMT_F16) {
        for (int j = 0; j < 4; ++j) w[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + 16 * j)));
    } else {
        for (int j = 0; j < 4; ++j)
            w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(row + 16 * j))), 16));
    }
}
#endif

static const int LANES = P / NV;

/* R input rows x one panel of a float format.
   Two fused multiply-add chains per output, one over the even k and one over the odd k (each in
   ascending order), added at the end: the same two chains whatever R is. Two chains, not one, because
   at one row a single chain's FMA latency, not the compact weights' memory traffic, bounded the step. */
template <int R, int FMT>
static inline void panel_tile(const float* x, int64_t K, const uint8_t* pp, float* out) {
    V even[R][NV], odd[R][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) even[r][j] = odd[r][j] = V_ZERO();
    const int64_t rb = row_bytes(FMT);
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
        V w0[NV], w1[NV];
        decode<FMT>(pp + k * rb, w0);
        decode<FMT>(pp + (k + 1) * rb, w1);
        for (int r = 0; r < R; ++r) {
            const V x0 = V_SET1(x[r * K + k]), x1 = V_SET1(x[r * K + k + 1]);
            for (int j = 0; j < NV; ++j) even[r][j] = V_FMA(x0, w0[j], even[r][j]);
            for (int j = 0; j < NV; ++j) odd[r][j] = V_FMA(x1, w1[j], odd[r][j]);
        }
    }
    if (k < K) {  /* K odd: its last k is even */
        V w0[NV];
        decode<FMT>(pp + k * rb, w0);
        for (int r = 0; r < R; ++r) {
            const V x0 = V_SET1(x[r * K + k]);
            for (int j = 0; j < NV; ++j) even[r][j] = V_FMA(x0, w0[j], even[r][j]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) V_STORE(out + r * P + LANES * j, V_ADD(even[r][j], odd[r][j]));
}

template <int FMT>
static void tile(int64_t r, const float* x, int64_t K, const uint8_t* pp, float* buf) {
    switch (r) {
#if defined(__AVX512F__)
        case 8: panel_tile<8, FMT>(x, K, pp, buf); break;
        case 7: panel_tile<7, FMT>(x, K, pp, buf); break;
        case 6: panel_tile<6, FMT>(x, K, pp, buf); break;
        case 5: panel_tile<5, FMT>(x, K, pp, buf); break;
        case 4: panel_tile<4, FMT>(x, K, pp, buf); break;
        case 3: panel_tile<3, FMT>(x, K, pp, buf); break;
#endif
        case 2: panel_tile<2, FMT>(x, K, pp, buf); break;
        default: panel_tile<1, FMT>(x, K, pp, buf); break;
    }
}

template <int FMT>
static void gemm(const float* x, int64_t M, int64_t K, const uint8_t* p, const float* scales, const float* b,
                 int64_t N, float* y, int64_t q0, int64_t q1) {
    const int64_t panel_bytes = K * row_bytes(FMT);
    float buf[MAX_TILE_ROWS * P];
    for (int64_t q = q0; q < q1; ++q) {
        const uint8_t* pp = p + q * panel_bytes;
        const int64_t n0 = q * P, nn = N - n0 < P ? N - n0 : P;
        for (int64_t m = 0; m < M;) {
            const int64_t r = M - m >= MAX_TILE_ROWS ? MAX_TILE_ROWS : M - m;
            tile<FMT>(r, x + m * K, K, pp, buf);
            for (int64_t i = 0; i < r; ++i) {
                float* yr = y + (m + i) * N + n0;
                const float* br = buf + i * P;
                if (FMT == FMT_FP8) {  /* the chain times its channel scale, then the bias (two roundings) */
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

/* ---- Integer formats (int8, int8 grouped, int4, int4 with minimums): 16-bit activations, integer dot products.
   Each row's x is quantized once per call, per block of AB input channels (AB = the group G of a grouped
   format, else 32; the last block may be short): amax = max |x| over the block, q = rint(x * (32767 / amax)),
   dx = amax / 32767 (float32 operations, round to nearest even; an all-zero block has q = 0, dx = 0), and
   sx = the sum of the block's q. A block's dot product with a weight column is then exact in int32
   (vpmaddwd over pairs of k: |q| <= 32767 times a nibble or a byte, at most 4368 k), and the column's
   float32 sum runs over the blocks in ascending order with a multiply and an add each (no fused ops):
     int4            acc += (float(isum - 8 sx) * dx) * scale      (nibbles stored as q + 8)
     int4 + minimum  acc += (float(isum) * dx) * scale;  acc += min * (dx * float(sx))
     int8 grouped    acc += (float(isum) * dx) * scale
     int8            acc += float(isum) * dx;   then y = acc * channel scale
   then the bias is added. Nothing depends on the other rows: rows are bit-identical batched or alone, and
   both ISA builds run this same 256-bit code (weight_gemm.py's emulate() is the same arithmetic in torch).
   Group scales and minimums are float32, or float16 where the format code has FMT_HALF (GGUF's own: exact).
   Panels: 4 chunks of 8 output columns each, chunk-major. int4: [K / 8][32 bytes] per chunk, the 16-bit
   lane 2c + t of k-octet o holding, in its nibbles i = 0..3, column c's weights at k = 8o + 2i + t. int8:
   [K' / 2][16 bytes] per chunk (K' = K rounded up to even, a zero weight past K), byte 2c + t of pair p
   holding column c's weight at k = 2p + t. Group scales (and minimums): [4][K / G][8] floats per panel. */
static const int64_t ACT_BLOCK = 32;
static const int64_t MAX_INT_ROWS = 4;

struct QuantRows {  /* the activations of M rows: K8 = K rounded up to a multiple of 8, NB blocks of AB */
    int16_t* q;     /* [M][K8] */
    float* dx;      /* [M][NB] */
    int32_t* sx;    /* [M][NB] */
    float* dxs;     /* [M][NB]: dx * float(sx) */
    int64_t K8, NB, AB;
};

static void quantize_rows(const float* x, int64_t M, int64_t K, QuantRows& a) {
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        int16_t* qr = a.q + m * a.K8;
        for (int64_t b = 0; b < a.NB; ++b) {
            const int64_t k0 = b * a.AB, k1 = k0 + a.AB < K ? k0 + a.AB : K;
            float amax = 0.0f;
            for (int64_t k = k0; k < k1; ++k) {
                const float v = xr[k] < 0 ? -xr[k] : xr[k];
                amax = v > amax ? v : amax;
            }
            const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
            int32_t sum = 0;
            for (int64_t k = k0; k < k1; ++k) {
                const int32_t v = (int32_t)__builtin_rintf(xr[k] * inv);
                const int32_t c = v > 32767 ? 32767 : v < -32767 ? -32767 : v;
                qr[k] = (int16_t)c;
                sum += c;
            }
            a.dx[m * a.NB + b] = amax / 32767.0f;
            a.sx[m * a.NB + b] = sum;
            a.dxs[m * a.NB + b] = (amax / 32767.0f) * (float)sum;
        }
        for (int64_t k = K; k < a.K8; ++k) qr[k] = 0;
    }
}

static inline __m256i pair_of(const int16_t* q) {  /* q[0], q[1] as one 32-bit value in every lane */
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

/* 8 group scales or minimums: float32, or (H: the format code's FMT_HALF bit) float16, widened exactly */
template <bool H>
static inline __m256 group_values(const void* p, int64_t i) {
    return H ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i)))
             : _mm256_loadu_ps((const float*)p + i);
}

/* R rows x one chunk (8 columns) of a panel: out[r][0..8). wp: the chunk's weights, sp / mp: its [K / G][8]
   scales / minimums (grouped formats). */
template <int R, int FMT, bool H>
static inline void int_chunk(const QuantRows& a, int64_t m0, int64_t K, const uint8_t* wp, const void* sp,
                             const void* mp, float* out, int64_t out_stride) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t Kp = is_int4(FMT) ? K : K + (K & 1);
    for (int64_t b = 0; b < a.NB; ++b) {
        const int64_t k0 = b * a.AB, k1 = k0 + a.AB < Kp ? k0 + a.AB : Kp;
        __m256i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
        if (is_int4(FMT)) {
            const __m256i nib = _mm256_set1_epi16(0xF);
            const uint8_t* wk = wp + (k0 >> 3) * 32;
            for (int64_t k = k0; k < k1; k += 8, wk += 32) {
                const __m256i L = _mm256_loadu_si256((const __m256i*)wk);
                const __m256i v0 = _mm256_and_si256(L, nib);
                const __m256i v1 = _mm256_and_si256(_mm256_srli_epi16(L, 4), nib);
                const __m256i v2 = _mm256_and_si256(_mm256_srli_epi16(L, 8), nib);
                const __m256i v3 = _mm256_srli_epi16(L, 12);
                for (int r = 0; r < R; ++r) {
                    const int16_t* q = a.q + (m0 + r) * a.K8 + k;
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(v0, pair_of(q)));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(v1, pair_of(q + 2)));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(v2, pair_of(q + 4)));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(v3, pair_of(q + 6)));
                }
            }
        } else {
            const uint8_t* wk = wp + (k0 >> 1) * 16;
            for (int64_t k = k0; k < k1; k += 2, wk += 16) {
                const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wk));
                for (int r = 0; r < R; ++r)
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(w, pair_of(a.q + (m0 + r) * a.K8 + k)));
            }
        }
        for (int r = 0; r < R; ++r) {
            const int64_t at = (m0 + r) * a.NB + b;
            const __m256 dx = _mm256_set1_ps(a.dx[at]);
            if (FMT == FMT_INT8) {
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(isum[r]), dx));
                continue;
            }
            __m256i i = isum[r];
            if (FMT == FMT_INT4) i = _mm256_sub_epi32(i, _mm256_set1_epi32(8 * a.sx[at]));
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(i), dx);
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(t, group_values<H>(sp, b * 8)));
            if (FMT == FMT_INT4_MIN)
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(group_values<H>(mp, b * 8), _mm256_set1_ps(a.dxs[at])));
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride, acc[r]);
}

/* One row x a whole panel (its 4 chunks together): the same arithmetic, column by column, as int_chunk<1>,
   with each activation pair loaded once for the 4 chunks and 4 independent sums in flight (a one-row
   decode step). cb: bytes per chunk of weights, gb: values per chunk of scales / minimums. */
template <int FMT, bool H>
static inline void int_panel_row(const QuantRows& a, int64_t m0, int64_t K, const uint8_t* wp, int64_t cb,
                                 const void* sp, const void* mp, int64_t gb, float* out) {
    __m256 acc[4];
    for (int c = 0; c < 4; ++c) acc[c] = _mm256_setzero_ps();
    const int64_t Kp = is_int4(FMT) ? K : K + (K & 1);
    const int16_t* qrow = a.q + m0 * a.K8;
    const int64_t vb = H ? 2 : 4;
    for (int64_t b = 0; b < a.NB; ++b) {
        const int64_t k0 = b * a.AB, k1 = k0 + a.AB < Kp ? k0 + a.AB : Kp;
        __m256i isum[4];
        for (int c = 0; c < 4; ++c) isum[c] = _mm256_setzero_si256();
        if (is_int4(FMT)) {
            const __m256i nib = _mm256_set1_epi16(0xF);
            const uint8_t* wk = wp + (k0 >> 3) * 32;
            for (int64_t k = k0; k < k1; k += 8, wk += 32) {
                const __m256i x0 = pair_of(qrow + k), x1 = pair_of(qrow + k + 2);
                const __m256i x2 = pair_of(qrow + k + 4), x3 = pair_of(qrow + k + 6);
                for (int c = 0; c < 4; ++c) {
                    const __m256i L = _mm256_loadu_si256((const __m256i*)(wk + c * cb));
                    const __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(L, nib), x0),
                                                        _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(L, 4), nib), x1));
                    const __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(L, 8), nib), x2),
                                                        _mm256_madd_epi16(_mm256_srli_epi16(L, 12), x3));
                    isum[c] = _mm256_add_epi32(isum[c], _mm256_add_epi32(s0, s1));
                }
            }
        } else {
            const uint8_t* wk = wp + (k0 >> 1) * 16;
            for (int64_t k = k0; k < k1; k += 2, wk += 16) {
                const __m256i x0 = pair_of(qrow + k);
                for (int c = 0; c < 4; ++c)
                    isum[c] = _mm256_add_epi32(
                        isum[c], _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wk + c * cb))), x0));
            }
        }
        const int64_t at = m0 * a.NB + b;
        const __m256 dx = _mm256_set1_ps(a.dx[at]);
        for (int c = 0; c < 4; ++c) {
            if (FMT == FMT_INT8) {
                acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(_mm256_cvtepi32_ps(isum[c]), dx));
                continue;
            }
            __m256i i = isum[c];
            if (FMT == FMT_INT4) i = _mm256_sub_epi32(i, _mm256_set1_epi32(8 * a.sx[at]));
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(i), dx);
            const void* sc = (const char*)sp + c * gb * vb;
            acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(t, group_values<H>(sc, b * 8)));
            if (FMT == FMT_INT4_MIN) {
                const void* mc = (const char*)mp + c * gb * vb;
                acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(group_values<H>(mc, b * 8), _mm256_set1_ps(a.dxs[at])));
            }
        }
    }
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + c * 8, acc[c]);
}

template <int FMT, bool H>
static void int_tile(int64_t r, const QuantRows& a, int64_t m0, int64_t K, const uint8_t* wp, const void* sp,
                     const void* mp, float* out, int64_t stride) {
    switch (r) {
        case 4: int_chunk<4, FMT, H>(a, m0, K, wp, sp, mp, out, stride); break;
        case 3: int_chunk<3, FMT, H>(a, m0, K, wp, sp, mp, out, stride); break;
        case 2: int_chunk<2, FMT, H>(a, m0, K, wp, sp, mp, out, stride); break;
        default: int_chunk<1, FMT, H>(a, m0, K, wp, sp, mp, out, stride); break;
    }
}

template <int FMT, bool H>
static void int_gemm(const QuantRows& a, int64_t M, int64_t K, const uint8_t* p, const void* scales,
                     const void* mins, int64_t G, const float* b, int64_t N, float* y, int64_t q0, int64_t q1) {
    const int64_t value_bytes = H ? 2 : 4;
    const int64_t chunk_bytes = is_int4(FMT) ? K / 8 * 32 : (K + (K & 1)) / 2 * 16;
    const int64_t groups = G > 0 ? K / G : 0;
    float buf[MAX_INT_ROWS * P];
    for (int64_t q = q0; q < q1; ++q) {
        const uint8_t* pp = p + q * 4 * chunk_bytes;
        const int64_t n0 = q * P, nn = N - n0 < P ? N - n0 : P;
        for (int64_t m = 0; m < M;) {
            const int64_t r = M - m >= MAX_INT_ROWS ? MAX_INT_ROWS : M - m;
            if (r == 1 && !is_int4(FMT)) {  /* int8, one row: the panel at once (int4: measured no faster) */
                const int64_t gb = groups * 8;
                int_panel_row<FMT, H>(a, m, K, pp, chunk_bytes, FMT == FMT_INT8 ? 0 : (const char*)scales + q * 4 * gb * value_bytes,
                                      FMT == FMT_INT4_MIN ? (const char*)mins + q * 4 * gb * value_bytes : 0, gb, buf);
            } else for (int c = 0; c < 4; ++c) {
                const int64_t at = (q * 4 + c) * groups * 8 * value_bytes;
                const void* sp = FMT == FMT_INT8 ? 0 : (const char*)scales + at;
                const void* mp = FMT == FMT_INT4_MIN ? (const char*)mins + at : 0;
                int_tile<FMT, H>(r, a, m, K, pp + c * chunk_bytes, sp, mp, buf + c * 8, P);
            }
            for (int64_t i = 0; i < r; ++i) {
                float* yr = y + (m + i) * N + n0;
                const float* br = buf + i * P;
                if (FMT == FMT_INT8) {  /* the sum times its channel scale, then the bias (two roundings) */
                    for (int64_t j = 0; j < nn; ++j) {
                        const float v = br[j] * ((const float*)scales)[n0 + j];
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
    const void* scales;  /* float32, or float16 for a grouped format with FMT_HALF */
    const void* mins;
    int64_t G;
    const float* b;
    int64_t N;
    float* y;
    const QuantRows* act;  /* the integer formats' quantized rows */
};

void gemm_range(const void* a, int64_t q0, int64_t q1, int) {
    const GemmArgs& g = *(const GemmArgs*)a;
    const bool half = g.fmt & FMT_HALF;  /* grouped formats: float16 group scales (and minimums) */
    switch (g.fmt & ~FMT_HALF) {
        case FMT_INT8: int_gemm<FMT_INT8, false>(*g.act, g.M, g.K, g.p, g.scales, 0, 0, g.b, g.N, g.y, q0, q1); break;
        case FMT_INT4:
            if (half) int_gemm<FMT_INT4, true>(*g.act, g.M, g.K, g.p, g.scales, 0, g.G, g.b, g.N, g.y, q0, q1);
            else int_gemm<FMT_INT4, false>(*g.act, g.M, g.K, g.p, g.scales, 0, g.G, g.b, g.N, g.y, q0, q1);
            break;
        case FMT_INT4_MIN:
            if (half) int_gemm<FMT_INT4_MIN, true>(*g.act, g.M, g.K, g.p, g.scales, g.mins, g.G, g.b, g.N, g.y, q0, q1);
            else int_gemm<FMT_INT4_MIN, false>(*g.act, g.M, g.K, g.p, g.scales, g.mins, g.G, g.b, g.N, g.y, q0, q1);
            break;
        case FMT_INT8_GROUP:
            if (half) int_gemm<FMT_INT8_GROUP, true>(*g.act, g.M, g.K, g.p, g.scales, 0, g.G, g.b, g.N, g.y, q0, q1);
            else int_gemm<FMT_INT8_GROUP, false>(*g.act, g.M, g.K, g.p, g.scales, 0, g.G, g.b, g.N, g.y, q0, q1);
            break;
        case FMT_F16: gemm<FMT_F16>(g.x, g.M, g.K, g.p, (const float*)g.scales, g.b, g.N, g.y, q0, q1); break;
        case FMT_BF16: gemm<FMT_BF16>(g.x, g.M, g.K, g.p, (const float*)g.scales, g.b, g.N, g.y, q0, q1); break;
        default: gemm<FMT_FP8>(g.x, g.M, g.K, g.p, (const float*)g.scales, g.b, g.N, g.y, q0, q1); break;
    }
}
}  // namespace

/* y[M][N] = x[M][K] W[N][K]^T (+ b[N]) for W in format fmt, packed as above. Returns 0, or -1 for
   arguments the kernel cannot run (unknown format; a grouped format with an odd G or K not a multiple of G). */
extern "C" int specbuild_weight_gemm(int fmt, const float* x, int64_t M, int64_t K, const void* p,
                                     const void* scales, const void* mins, int64_t G, const float* b, int64_t N,
                                     float* y) {
    const int base = fmt & ~FMT_HALF;
    if (base < FMT_INT8 || base > FMT_INT8_GROUP || ((fmt & FMT_HALF) && !grouped(base))) return -1;
    if (grouped(base) && (G <= 0 || G % 2 || K % G || (is_int4(base) && G % 8))) return -1;
    const bool integer = base == FMT_INT8 || base == FMT_INT8_GROUP || is_int4(base);
    QuantRows act{0, 0, 0, 0, 0, 0, 0};
    std::vector<char> store;
    if (integer) {
        act.AB = grouped(base) ? G : ACT_BLOCK;
        act.NB = (K + act.AB - 1) / act.AB;
        act.K8 = (K + 7) / 8 * 8;
        store.resize((size_t)(M * act.K8 * 2 + M * act.NB * 12 + 64));
        char* at = store.data();
        act.q = (int16_t*)at;
        act.dx = (float*)(at + ((M * act.K8 * 2 + 15) / 16) * 16);
        act.sx = (int32_t*)(act.dx + M * act.NB);
        act.dxs = (float*)(act.sx + M * act.NB);
        quantize_rows(x, M, K, act);
    }
    const GemmArgs args{fmt, x, M, K, (const uint8_t*)p, scales, mins, G, b, N, y, &act};
    const int64_t panels = (N + P - 1) / P;
    const pool_fn run = pool_run.load(std::memory_order_relaxed);
    if (run) run(gemm_range, &args, panels);
    else gemm_range(&args, 0, panels, 0);
    return 0;
}

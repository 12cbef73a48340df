// Row-invariant float32 CPU kernels of the slot engine: the panel matmul and one slot's attention.
// Loaded by row_gemm.py beside this file (see its docstring for the design): compiled once per
// machine with the system compiler, flags in row_gemm.py (-O3 -ffp-contract=off -fno-fast-math,
// -mavx2 -mfma [-mavx512f]), called through ctypes; the hash of this text names the library.
// No fast-math, no FP contraction: every output is one fixed-order fused multiply-add chain.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

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
static const int64_t P = 32;

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
static const int64_t MAX_TILE_ROWS = 12;

/* R input rows x one panel: every output is ONE fused multiply-add chain over k = 0 .. K-1
   in order (a lane of an accumulator), whatever R is, and the same chain as the 8-lane build's.
   With PREFETCH, the next panel (`next`) is requested as this one is multiplied: a tile of 3+ rows
   spends long enough on its FMAs that the memory stream otherwise idles between its loads
   (measured on an AVX-512 EPYC: 8 rows cost ~1.5 one-row passes without it, ~1.2 with it). */
template <int R, bool PREFETCH>
static void panel_tile(const float* x, int64_t K, const float* pp, const float* next, float* out) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = pp + k * P;
        if (PREFETCH) {
            _mm_prefetch((const char*)(next + k * P), _MM_HINT_T0);
            _mm_prefetch((const char*)(next + k * P + 16), _MM_HINT_T0);
        }
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

/* alone, one- and two-row tiles keep the memory busy without help (prefetching there measured no
   faster); with helper threads sharing the stream (`shared`) every tile prefetches (one row: 13 ms a
   pass of SmolLM2-135M's weights on two threads against 15-16 ms alone, measured on an AVX-512 EPYC) */
template <int R>
static inline void tile_rows(const float* x, int64_t K, const float* pp, const float* next, float* buf, bool shared) {
    if (next && (R >= 3 || shared)) panel_tile<R, true>(x, K, pp, next, buf);
    else panel_tile<R, false>(x, K, pp, next, buf);
}

static inline void tile(int64_t r, const float* x, int64_t K, const float* pp, const float* next, float* buf,
                        bool shared) {
    switch (r) {
        case 12: tile_rows<12>(x, K, pp, next, buf, shared); break;
        case 11: tile_rows<11>(x, K, pp, next, buf, shared); break;
        case 10: tile_rows<10>(x, K, pp, next, buf, shared); break;
        case 9: tile_rows<9>(x, K, pp, next, buf, shared); break;
        case 8: tile_rows<8>(x, K, pp, next, buf, shared); break;
        case 7: tile_rows<7>(x, K, pp, next, buf, shared); break;
        case 6: tile_rows<6>(x, K, pp, next, buf, shared); break;
        case 5: tile_rows<5>(x, K, pp, next, buf, shared); break;
        case 4: tile_rows<4>(x, K, pp, next, buf, shared); break;
        case 3: tile_rows<3>(x, K, pp, next, buf, shared); break;
        case 2: tile_rows<2>(x, K, pp, next, buf, shared); break;
        default: tile_rows<1>(x, K, pp, next, buf, shared); break;
    }
}
#else
static const int64_t MAX_TILE_ROWS = 3;

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

/* (no prefetch: `next` unused; the AVX2 build measured no faster with it, run on an AVX-512 host) */
static inline void tile(int64_t r, const float* x, int64_t K, const float* pp, const float*, float* buf, bool) {
    if (r == 3) panel_tile<3>(x, K, pp, buf);
    else if (r == 2) panel_tile<2>(x, K, pp, buf);
    else panel_tile<1>(x, K, pp, buf);
}
#endif

/* Panels [q0, q1) of y[M][N] = x[M][K] w[N][K]^T (+ b[N]) on the packed panels; row-major, contiguous.
   The rows go in ceil(M / MAX_TILE_ROWS) tiles of near-equal size (13 rows: 7 + 6, not 12 + 1, whose
   one-row tile would wait on its FMA latency): the tiles change with M, each output's chain does not. */
static void gemm_panels(const float* x, int64_t M, int64_t K, const float* p, const float* b, int64_t N, float* y,
                        int64_t q0, int64_t q1, bool shared) {
    const int64_t tiles = (M + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;
    float buf[MAX_TILE_ROWS * P];
    for (int64_t q = q0; q < q1; ++q) {
        const float* pp = p + q * K * P;
        const float* next = q + 1 < q1 ? pp + K * P : 0;
        const int64_t n0 = q * P, nn = N - n0 < P ? N - n0 : P;
        for (int64_t m = 0, t = 0; m < M; ++t) {
            const int64_t r = (M - m + (tiles - t) - 1) / (tiles - t);
            tile(r, x + m * K, K, pp, next, buf, shared);
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

/* Helper threads (specbuild_set_threads). specbuild_pool_run(fn, args, count) splits [0, count) into
   near-equal ranges, one per thread (the caller takes the first), and returns when all are done: the
   matmul splits its panels, the attention its (query, kv head) groups or (query, head) pairs, the compact-weight kernel
   (weight_gemm.cpp, given this function's address) its panels. Each unit is computed by one thread
   with the code it runs alone, so results have the same bits whatever the thread count. Helpers wait
   for work spinning (a pass's calls follow each other within microseconds), yielding after YIELD_US,
   and sleep on a condition variable after SPIN_US without work. One pooled call at a time (a second
   caller runs its call alone); a forked child (no helpers there) runs alone. The pool lives on the
   heap and its threads are detached: nothing is torn down at exit. */
typedef void (*range_fn)(const void* args, int64_t lo, int64_t hi, int shared);

namespace {
const int MAX_THREADS = 16;
const int64_t SPIN_US = 2000, YIELD_US = 200;

struct Job {
    range_fn fn;
    const void* args;
    int64_t lo, hi;
};

struct Pool {
    std::mutex call;                  /* one pooled call at a time */
    std::mutex mu;                    /* with cv: sleeping helpers */
    std::condition_variable cv;
    std::atomic<uint64_t> generation{0};
    std::atomic<int> done{0};
    std::atomic<int> sleepers{0};
    std::atomic<bool> stop{false};
    Job jobs[MAX_THREADS];
    int helpers = 0;
    std::atomic<int64_t> min_rows{1};
    pid_t owner = 0;
};

std::atomic<Pool*> pool{0};
std::mutex pool_mu;

void helper(Pool* pl, int id, uint64_t seen) {
    for (;;) {
        uint64_t g;
        int spins = 0;
        auto since = std::chrono::steady_clock::now();
        while ((g = pl->generation.load(std::memory_order_acquire)) == seen) {
            _mm_pause();
            if ((++spins & 255) != 0) continue;
            const auto idle = std::chrono::steady_clock::now() - since;
            if (idle > std::chrono::microseconds(YIELD_US)) sched_yield();  /* a busy machine's other threads first */
            if (idle > std::chrono::microseconds(SPIN_US)) {
                std::unique_lock<std::mutex> lock(pl->mu);
                pl->sleepers.fetch_add(1);
                pl->cv.wait(lock, [&] { return pl->generation.load() != seen; });
                pl->sleepers.fetch_sub(1);
                since = std::chrono::steady_clock::now();
            }
        }
        seen = g;
        if (pl->stop.load()) return;
        const Job& j = pl->jobs[id];
        j.fn(j.args, j.lo, j.hi, 1);
        pl->done.fetch_add(1, std::memory_order_release);
    }
}

void wake(Pool* pl) {
    pl->generation.fetch_add(1);
    if (pl->sleepers.load() > 0) {
        std::lock_guard<std::mutex> lock(pl->mu);
        pl->cv.notify_all();
    }
}
}  // namespace

/* threads (1 .. MAX_THREADS) share each matmul of >= min_rows rows; 1: no helpers. Returns the thread count in use. */
extern "C" int specbuild_set_threads(int threads, int64_t min_rows) {
    std::lock_guard<std::mutex> guard(pool_mu);
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    Pool* old = pool.load();
    if (old && old->owner == getpid() && old->helpers == threads - 1) {
        old->min_rows = min_rows < 1 ? 1 : min_rows;
        return threads;
    }
    if (old && old->owner == getpid()) {  /* retire the old helpers (they return on stop); the pool stays allocated */
        std::lock_guard<std::mutex> call(old->call);
        old->stop.store(true);
        wake(old);
    }
    pool.store(0);  /* (a forked child's copy has no helpers and may hold a locked mutex: left as it is) */
    if (threads == 1) return 1;
    Pool* pl = new Pool();
    pl->helpers = threads - 1;
    pl->min_rows = min_rows < 1 ? 1 : min_rows;
    pl->owner = getpid();
    for (int i = 0; i < pl->helpers; ++i) std::thread(helper, pl, i, uint64_t(0)).detach();
    pool.store(pl);
    return threads;
}

/* fn over [0, count): shared among the pool's threads where it has helpers and count > helpers, else
   on the caller's thread alone (shared = 0). */
extern "C" void specbuild_pool_run(range_fn fn, const void* args, int64_t count) {
    Pool* pl = pool.load(std::memory_order_acquire);
    if (pl && count > pl->helpers && pl->owner == getpid() && pl->call.try_lock()) {
        if (pl->stop.load()) {  /* retired while this call looked: alone */
            pl->call.unlock();
            fn(args, 0, count, 0);
            return;
        }
        const int64_t parts = pl->helpers + 1;
        for (int i = 1; i < parts; ++i) pl->jobs[i - 1] = Job{fn, args, count * i / parts, count * (i + 1) / parts};
        pl->done.store(0);
        wake(pl);
        fn(args, 0, count / parts, 1);
        for (int spins = 1; pl->done.load(std::memory_order_acquire) < pl->helpers; ++spins) {
            _mm_pause();
            if ((spins & 4095) == 0) sched_yield();  /* a helper descheduled on a busy machine */
        }
        pl->call.unlock();
        return;
    }
    fn(args, 0, count, 0);
}

namespace {
struct GemmArgs {
    const float *x, *p, *b;
    int64_t M, K, N;
    float* y;
};

void gemm_range(const void* a, int64_t q0, int64_t q1, int shared) {
    const GemmArgs& g = *(const GemmArgs*)a;
    gemm_panels(g.x, g.M, g.K, g.p, g.b, g.N, g.y, q0, q1, shared != 0);
}
}  // namespace

extern "C" void specbuild_panel_gemm(const float* x, int64_t M, int64_t K, const float* p, const float* b,
                                     int64_t N, float* y) {
    const int64_t panels = (N + P - 1) / P;
    Pool* pl = pool.load(std::memory_order_relaxed);
    if (!pl || M < pl->min_rows) {
        gemm_panels(x, M, K, p, b, N, y, 0, panels, false);
        return;
    }
    const GemmArgs args{x, p, b, M, K, N, y};
    specbuild_pool_run(gemm_range, &args, panels);
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

namespace {
struct AttentionArgs {
    const float* q;
    int64_t n, heads, kv_heads, d;
    const float *keys, *values;
    int64_t S, start;
    const unsigned char* vis;
    float scale;
    float* out;
};

/* Scores of the visible positions into scratch (dot product: NC lane-wise FMAs over d = NC * LANES,
   then hsum, then the scale; nc = 0: any d, through dot()); returns their maximum. */
template <int NC>
static float scores(const float* qh, const float* kh, int64_t d, int64_t last, const unsigned char* seen,
                    float scale, float* scratch) {
    float top = -__builtin_inff();
    vec q[NC > 0 ? NC : 1];
    for (int c = 0; c < NC; ++c) q[c] = vload(qh + c * LANES);
    for (int64_t l = 0; l <= last; ++l) {
        if (seen && !seen[l]) continue;
        float sc;
        if (NC > 0) {  /* the same FMAs as dot(), the query held in registers */
            const float* kl = kh + l * d;
            vec acc = vzero();
            for (int c = 0; c < NC; ++c) acc = vfma(q[c], vload(kl + c * LANES), acc);
            sc = hsum(acc) * scale;
        } else {
            sc = dot(qh, kh + l * d, d) * scale;
        }
        scratch[l] = sc;
        top = sc > top ? sc : top;
    }
    return top;
}

/* scratch = exp(score - max) over the visible positions (the hidden ones set finite: skipped after) */
template <int NC>
static void shifted_exps(const float* qh, const float* kh, int64_t d, int64_t last, const unsigned char* seen,
                         float scale, float* scratch) {
    const float top = scores<NC>(qh, kh, d, last, seen, scale, scratch);
    if (seen)
        for (int64_t l = 0; l <= last; ++l) if (!seen[l]) scratch[l] = top;
    exp_shifted(scratch, last + 1, top);
}

/* o = the visible positions' values weighted by scratch[l] / total, accumulated in ascending l (lane-wise
   FMAs from zero: the same bits as the scalar loop); NC > 0: d = NC * LANES, held in registers. */
template <int NC>
static void weighted_values(const float* scratch, float total, const float* vh, int64_t d, int64_t last,
                            const unsigned char* seen, float* o) {
    if (NC > 0) {
        vec acc[NC > 0 ? NC : 1];
        for (int c = 0; c < NC; ++c) acc[c] = vzero();
        for (int64_t l = 0; l <= last; ++l) {
            if (seen && !seen[l]) continue;
            const vec pv = vset1(scratch[l] / total);
            const float* vl = vh + l * d;
            for (int c = 0; c < NC; ++c) acc[c] = vfma(pv, vload(vl + c * LANES), acc[c]);
        }
        for (int c = 0; c < NC; ++c) vstore(o + c * LANES, acc[c]);
        return;
    }
    for (int64_t c = 0; c < d; ++c) o[c] = 0.0f;
    const int64_t DV = d - d % LANES;
    for (int64_t l = 0; l <= last; ++l) {
        if (seen && !seen[l]) continue;
        const float p = scratch[l] / total;
        const float* vl = vh + l * d;
        const vec pv = vset1(p);
        for (int64_t c = 0; c < DV; c += LANES) vstore(o + c, vfma(pv, vload(vl + c), vload(o + c)));
        for (int64_t c = DV; c < d; ++c) o[c] = __builtin_fmaf(p, vl[c], o[c]);
    }
}

/* pairs [lo, hi) of (query i, head h) = i * heads + h; scratch of this thread's own */
template <int NC>
void attention_pairs(const AttentionArgs& t, int64_t lo, int64_t hi) {
    const int64_t L = t.start + t.n, g = t.heads / t.kv_heads, d = t.d, S = t.S;
    thread_local std::vector<float> buffer;
    if ((int64_t)buffer.size() < L) buffer.resize(L);
    float* scratch = buffer.data();
    for (int64_t pair = lo; pair < hi; ++pair) {
        const int64_t i = pair / t.heads, h = pair % t.heads;
        const unsigned char* seen = t.vis ? t.vis + i * L : 0;
        const int64_t last = t.vis ? L - 1 : t.start + i;
        const float* qh = t.q + (i * t.heads + h) * d;
        const float* kh = t.keys + (h / g) * S * d;
        const float* vh = t.values + (h / g) * S * d;
        shifted_exps<NC>(qh, kh, d, last, seen, t.scale, scratch);
        float total = 0.0f;
        for (int64_t l = 0; l <= last; ++l) {
            if (seen && !seen[l]) continue;
            total += scratch[l];
        }
        weighted_values<NC>(scratch, total, vh, d, last, seen, t.out + (i * t.heads + h) * d);
    }
}

/* units [lo, hi) of (query i, kv head k) = i * kv_heads + k: the G query heads reading kv head k, each
   computed as attention_pairs computes it (the same operations in the same order), their sums and
   weighted values interleaved (G independent chains: the adds' and FMAs' latency hidden) and each
   value row read once for the G heads; d = NC * LANES, G * NC vectors held in registers */
template <int NC, int G>
void attention_groups(const AttentionArgs& t, int64_t lo, int64_t hi) {
    const int64_t L = t.start + t.n, d = t.d, S = t.S;
    thread_local std::vector<float> buffer;
    if ((int64_t)buffer.size() < G * L) buffer.resize(G * L);
    float* scratch = buffer.data();
    for (int64_t unit = lo; unit < hi; ++unit) {
        const int64_t i = unit / t.kv_heads, k = unit % t.kv_heads;
        const unsigned char* seen = t.vis ? t.vis + i * L : 0;
        const int64_t last = t.vis ? L - 1 : t.start + i;
        const float* kh = t.keys + k * S * d;
        const float* vh = t.values + k * S * d;
        float total[G];
        for (int h = 0; h < G; ++h) {
            shifted_exps<NC>(t.q + (i * t.heads + k * G + h) * d, kh, d, last, seen, t.scale, scratch + h * L);
            total[h] = 0.0f;
        }
        for (int64_t l = 0; l <= last; ++l) {
            if (seen && !seen[l]) continue;
            for (int h = 0; h < G; ++h) total[h] += scratch[h * L + l];
        }
        vec acc[G][NC];
        for (int h = 0; h < G; ++h)
            for (int c = 0; c < NC; ++c) acc[h][c] = vzero();
        for (int64_t l = 0; l <= last; ++l) {
            if (seen && !seen[l]) continue;
            const float* vl = vh + l * d;
            vec v[NC];
            for (int c = 0; c < NC; ++c) v[c] = vload(vl + c * LANES);
            for (int h = 0; h < G; ++h) {
                const vec pv = vset1(scratch[h * L + l] / total[h]);
                for (int c = 0; c < NC; ++c) acc[h][c] = vfma(pv, v[c], acc[h][c]);
            }
        }
        for (int h = 0; h < G; ++h)
            for (int c = 0; c < NC; ++c) vstore(t.out + (i * t.heads + k * G + h) * d + c * LANES, acc[h][c]);
    }
}

/* d in vectors where the register paths take it (2, 4 or 8 vectors), else 0 */
static int vectors_of(int64_t d) { return d == 2 * LANES ? 2 : d == 4 * LANES ? 4 : d == 8 * LANES ? 8 : 0; }

/* the grouped kernel for this shape (G * NC <= 16 vectors of accumulators), or 0 */
typedef void (*units_fn)(const AttentionArgs&, int64_t, int64_t);
static units_fn grouped_kernel(int64_t d, int64_t g) {
    const int nc = vectors_of(d);
    if (nc == 2) {
        static const units_fn k2[] = {attention_groups<2, 1>, attention_groups<2, 2>, attention_groups<2, 3>,
                                      attention_groups<2, 4>, attention_groups<2, 5>, attention_groups<2, 6>,
                                      attention_groups<2, 7>, attention_groups<2, 8>};
        return g >= 1 && g <= 8 ? k2[g - 1] : 0;
    }
    if (nc == 4) {
        static const units_fn k4[] = {attention_groups<4, 1>, attention_groups<4, 2>, attention_groups<4, 3>,
                                      attention_groups<4, 4>};
        return g >= 1 && g <= 4 ? k4[g - 1] : 0;
    }
    if (nc == 8) {
        static const units_fn k8[] = {attention_groups<8, 1>, attention_groups<8, 2>};
        return g >= 1 && g <= 2 ? k8[g - 1] : 0;
    }
    return 0;
}

void attention_range(const void* a, int64_t lo, int64_t hi, int) {
    const AttentionArgs& t = *(const AttentionArgs*)a;
    units_fn grouped = grouped_kernel(t.d, t.heads / t.kv_heads);
    if (grouped) {
        grouped(t, lo, hi);
        return;
    }
    switch (vectors_of(t.d)) {
        case 2: attention_pairs<2>(t, lo, hi); break;
        case 4: attention_pairs<4>(t, lo, hi); break;
        case 8: attention_pairs<8>(t, lo, hi); break;
        default: attention_pairs<0>(t, lo, hi);
    }
}
}  // namespace

/* One slot's attention for n query tokens; each (query, head) computed alone, in one fixed order, by
   one thread (the pool's, where it has helpers). q, out [n][heads][d]; keys, values [kv_heads][S][d]
   (the slot's cache, S positions). Query i sees the positions l <= start + i (vis NULL: causal) or
   those with vis[i * (start + n) + l] (a tree mask); scores, max, exponentials, their sum and the
   weighted values all run over the visible positions in ascending order, so a query gives the same
   bits in a pass of any size (a decode step, a verify chain, a tree whose accepted path later sits at
   consecutive positions). scratch: unused (each thread keeps its own). */
extern "C" void specbuild_row_attention(const float* q, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                                        const float* keys, const float* values, int64_t S, int64_t start,
                                        const unsigned char* vis, float scale, float* out, float*) {
    const AttentionArgs args{q, n, heads, kv_heads, d, keys, values, S, start, vis, scale, out};
    /* work units: (query, kv head) groups where a grouped kernel fits the shape, else (query, head) pairs */
    specbuild_pool_run(attention_range, &args, grouped_kernel(d, heads / kv_heads) ? n * kv_heads : n * heads);
}

/* RMS norm of M rows of K floats: out[m] = (x[m] * r) * w, r = 1 / sqrt(mean(x[m]^2) + eps) with the
   sum of squares taken in double, in ascending order (no reordering: no fast-math), so a row's bits
   never depend on the others or on the ISA build. One call in place of the handful of torch ops a
   norm costs on a decode step (each a dispatch, ~10-50 us on a slow host; this: about 1 us). */
extern "C" void specbuild_rms_norm(const float* x, int64_t M, int64_t K, const float* w, float eps, float* out) {
    for (int64_t m = 0; m < M; ++m) {
        const float* xr = x + m * K;
        float* o = out + m * K;
        double ss = 0.0;
        for (int64_t k = 0; k < K; ++k) ss += (double)xr[k] * (double)xr[k];
        const float r = 1.0f / sqrtf((float)(ss / (double)K) + eps);
        for (int64_t k = 0; k < K; ++k) o[k] = (xr[k] * r) * w[k];
    }
}

/* One head's rotation, v -> o (o may be v: each pair is read before it is written): each product
   rounded, then the sum (no FMA contraction). */
static inline void rotate_head(const float* v, float* o, const float* c, const float* s, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        const float lo = a * c[i];
        const float lo2 = b * s[i];
        const float hi = b * c[i + half];
        const float hi2 = a * s[i + half];
        o[i] = lo + lo2;
        o[i + half] = hi + hi2;
    }
}

/* RoPE in place on T tokens x H heads x d (d even): x = x * cos + roll(x, d / 2) * sin_signed, cos and
   sin_signed [T][d] (the first half of sin negated): the same bits as those three elementwise torch ops. */
extern "C" void specbuild_rope(float* x, int64_t T, int64_t H, int64_t d, const float* cos_t, const float* sin_t) {
    const int64_t half = d / 2;
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos_t + t * d;
        const float* s = sin_t + t * d;
        for (int64_t h = 0; h < H; ++h) {
            float* v = x + (t * H + h) * d;
            rotate_head(v, v, c, s, half);
        }
    }
}

/* A fused q/k/v product's n tokens (y: [n][(H + 2 KV) d], rows of one slot at positions start ..
   start + n - 1): q rotated into q_out [n][H][d], k rotated and v copied into the slot's cache
   (keys, values: [KV][S][d]). The rotation is specbuild_rope's, value for value; the stores are copies. */
extern "C" void specbuild_rope_store(const float* y, int64_t n, int64_t H, int64_t KV, int64_t d, const float* cos_t,
                                     const float* sin_t, float* q_out, float* keys, float* values, int64_t S,
                                     int64_t start) {
    const int64_t half = d / 2, W = (H + 2 * KV) * d;
    for (int64_t t = 0; t < n; ++t) {
        const float* c = cos_t + t * d;
        const float* s = sin_t + t * d;
        const float* row = y + t * W;
        for (int64_t h = 0; h < H + KV; ++h) {
            const float* v = row + h * d;
            float* o = h < H ? q_out + (t * H + h) * d : keys + ((h - H) * S + start + t) * d;
            rotate_head(v, o, c, s, half);
        }
        for (int64_t h = 0; h < KV; ++h)
            memcpy(values + (h * S + start + t) * d, row + (H + KV + h) * d, (size_t)d * sizeof(float));
    }
}

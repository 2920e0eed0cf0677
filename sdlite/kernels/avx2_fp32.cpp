// sdlite: fp32 kernels for x86 CPUs with AVX2 and FMA (and every AVX-512 CPU), built and loaded by
// sdlite/kernels/build.py. They serve the fp32-fast precision, never the exact one: they sum in another order and
// compute exp and erf by their own polynomials, so they do not give PyTorch's bits.
//
// sdl_attention_f32: fused (flash) attention in fp32.
// sdl_geglu_f32: the GEGLU feed-forward's epilogue, (value + bias) * gelu(gate + bias) in one pass.
// sdl_wino43_input, sdl_wino43_output: the transforms of Winograd F(4x4, 3x3) convolutions.
//
// Attention: out = softmax(q k^T * scale) v for each (batch, head), without a mask, block by block with the running
// ("online") softmax of FlashAttention (Dao et al., 2022), so the N x M scores never exist at once. Everything is
// fp32: products summed in fp32 FMAs, exp2 by a degree-6 polynomial (relative error ~1.2e-7, an ulp).
//
// Why: PyTorch's fp32 flash kernel runs its products as generic GEMM calls on small blocks and its softmax in
// separate passes; at SD 1.5's 64x64-latent self-attention (head dim 40) it reaches about a third of this CPU's fp32
// matmul rate under AVX2, and is the largest single cost of a 512x512 step there after the convolutions.
//
// Queries run along the vector lanes everywhere, so the softmax needs no horizontal reductions and no masks:
//   per (batch, head), by the thread that first meets it: K copied to dense rows [key][d], V transposed by key block
//   [block][d][KB], so that the broadcasts below read memory in order;
//   Q^T of a block of QB queries, [d][QB], scaled by scale * log2 e as it is copied (scores come out in base 2);
//   S^T = K_blk Q^T, [key][QB], in register tiles of 4 keys x 24 queries (one key row per broadcast);
//   per query lane: the block's maximum, alpha = 2^(old max - new max), P^T = 2^(S^T - max) written over S^T, the sum;
//   O^T = alpha O^T + V_blk^T P^T, [d][QB], in register tiles of 4 head-dim rows x 24 queries;
//   at the end out = (O^T)^T / sum.
// Only the keys that exist are computed (no padding to the block: 77 text tokens cost 77 keys).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "parallel.h"

namespace {

using sdl::parallel;

constexpr int T = 4;      // keys (S^T) or head-dim rows (O^T) of a register tile
constexpr int L = 3;      // vectors of 8 queries in a register tile
constexpr int QB = 48;    // queries per block (a multiple of 8 L)
constexpr int KB = 256;   // keys per block

// lanes [0, n) set, for n in 0..8
inline __m256i lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 2^x for x <= 0: 2^(x - round x) by its Taylor polynomial of degree 6 on [-1/2, 1/2] (relative error below 1.2e-7),
// times 2^round(x) added into the exponent. x is clamped at -125, whose 2^-125 the fp32 sums ignore.
inline __m256 exp2_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530393381609e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

struct Problem {
    const float *q, *k, *v;
    float* o;
    int B, H, N, M, D;
    int64_t qs[3], ks[3], vs[3], os[3];  // element strides of batch, head, token (the last dim is contiguous)
    float scale;
};

struct Buffers {
    float *kp = nullptr, *vt = nullptr, *qt = nullptr, *s = nullptr, *o = nullptr;
    bool ok = false;
    Buffers(size_t kp_n, size_t vt_n, size_t qt_n, size_t s_n, size_t o_n) {
        kp = (float*)aligned_alloc(64, kp_n * 4);
        vt = (float*)aligned_alloc(64, vt_n * 4);
        qt = (float*)aligned_alloc(64, qt_n * 4);
        s = (float*)aligned_alloc(64, s_n * 4);
        o = (float*)aligned_alloc(64, o_n * 4);
        ok = kp && vt && qt && s && o;
    }
    ~Buffers() { free(kp); free(vt); free(qt); free(s); free(o); }
};

// acc[i][l] (+)= sum over x < X of a[i][x] * b[x][8 l .. 8 l + 8], for NT rows i whose x-th value is at
// a + i * as + x and a b row of 8 L floats at b + x * QB: the one register tile of both products.
// S^T: a = K rows (x: head dim), b = Q^T. O^T: a = V^T rows (x: key), b = P^T.
template <int NT>
inline void tile(__m256 (&acc)[T][L], const float* a, int as, const float* b, int X) {
    for (int x = 0; x < X; ++x) {
        __m256 bv[L];
        for (int l = 0; l < L; ++l) bv[l] = _mm256_load_ps(b + (size_t)x * QB + 8 * l);
        for (int i = 0; i < NT; ++i) {
            const __m256 av = _mm256_broadcast_ss(a + i * as + x);
            for (int l = 0; l < L; ++l) acc[i][l] = _mm256_fmadd_ps(av, bv[l], acc[i][l]);
        }
    }
}

// S^T[j0 .. j0 + NT][g] = K[j0 ..] Q^T[.., g] for the query group g (8 L lanes from column g)
template <int NT>
inline void s_tile(const float* k, const float* qt, float* s, int D, int j0, int g) {
    __m256 acc[T][L];
    for (int i = 0; i < NT; ++i)
        for (int l = 0; l < L; ++l) acc[i][l] = _mm256_setzero_ps();
    tile<NT>(acc, k + (size_t)j0 * D, D, qt + g, D);
    for (int i = 0; i < NT; ++i)
        for (int l = 0; l < L; ++l) _mm256_store_ps(s + (size_t)(j0 + i) * QB + g + 8 * l, acc[i][l]);
}

// O^T[d0 .. d0 + NT][g] = alpha O^T + V^T[d0 ..] P^T[:, g] over the block's `cols` keys (vt: the block's V^T)
template <int NT>
inline void pv_tile(float* o, const float* vt, const float* p, const float* alpha, int d0, int g, int cols) {
    __m256 acc[T][L];
    for (int l = 0; l < L; ++l) {
        const __m256 al = _mm256_load_ps(alpha + g + 8 * l);
        for (int i = 0; i < NT; ++i) acc[i][l] = _mm256_mul_ps(al, _mm256_load_ps(o + (size_t)(d0 + i) * QB + g + 8 * l));
    }
    tile<NT>(acc, vt + (size_t)d0 * KB, KB, p + g, cols);
    for (int i = 0; i < NT; ++i)
        for (int l = 0; l < L; ++l) _mm256_store_ps(o + (size_t)(d0 + i) * QB + g + 8 * l, acc[i][l]);
}

// runs f.template operator()<NT> over [0, n) in steps of T, the last step NT = n % T
template <class F>
inline void tiles(int n, F f) {
    int i = 0;
    for (; i + T <= n; i += T) f(std::integral_constant<int, T>(), i);
    switch (n - i) {
        case 1: f(std::integral_constant<int, 1>(), i); break;
        case 2: f(std::integral_constant<int, 2>(), i); break;
        case 3: f(std::integral_constant<int, 3>(), i); break;
        default: break;
    }
}

// Work items are (batch, head, query block), in that order; one thread runs [begin, end).
int run(const Problem& a, int64_t begin, int64_t end) {
    const int D = a.D;
    const int nkb = (a.M + KB - 1) / KB;
    const int nqb = (a.N + QB - 1) / QB;
    Buffers buf((size_t)a.M * D, (size_t)nkb * D * KB, (size_t)D * QB, (size_t)KB * QB, (size_t)D * QB);
    if (!buf.ok) return 2;
    alignas(32) float mx[QB], sum[QB], alpha[QB];
    const float c = a.scale * 1.44269504088896341f;  // scale and ln -> log2
    int64_t packed = -1;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t bh = item / nqb;
        const int qblock = (int)(item % nqb);
        const int b = (int)(bh / a.H), h = (int)(bh % a.H);
        if (bh != packed) {
            const float* kbase = a.k + b * a.ks[0] + h * a.ks[1];
            const float* vbase = a.v + b * a.vs[0] + h * a.vs[1];
            for (int n = 0; n < a.M; ++n) {
                memcpy(buf.kp + (size_t)n * D, kbase + n * a.ks[2], (size_t)D * 4);
                const float* vr = vbase + n * a.vs[2];
                float* vd = buf.vt + (size_t)(n / KB) * D * KB + n % KB;
                for (int d = 0; d < D; ++d) vd[(size_t)d * KB] = vr[d];
            }
            packed = bh;
        }
        const int r0 = qblock * QB;
        const int rows = std::min(QB, a.N - r0);
        // Q^T, scaled; queries past the last are zero
        memset(buf.qt, 0, (size_t)D * QB * 4);
        const float* qbase = a.q + b * a.qs[0] + h * a.qs[1];
        for (int r = 0; r < rows; ++r) {
            const float* src = qbase + (r0 + r) * a.qs[2];
            for (int d = 0; d < D; ++d) buf.qt[(size_t)d * QB + r] = src[d] * c;
        }
        memset(buf.o, 0, (size_t)D * QB * 4);
        for (int i = 0; i < QB; ++i) mx[i] = -INFINITY, sum[i] = 0.f;
        for (int kb = 0; kb < nkb; ++kb) {
            const int j0 = kb * KB;
            const int cols = std::min(KB, a.M - j0);
            const float* kblk = buf.kp + (size_t)j0 * D;
            const float* vblk = buf.vt + (size_t)kb * D * KB;
            tiles(cols, [&](auto nt, int j) {
                for (int g = 0; g < QB; g += 8 * L) s_tile<decltype(nt)::value>(kblk, buf.qt, buf.s, D, j, g);
            });
            // the running softmax, 8 query lanes at a time: new maxima, alpha for what was summed, P^T, the sums
            for (int g = 0; g < QB; g += 8) {
                __m256 m = _mm256_set1_ps(-INFINITY);
                for (int j = 0; j < cols; ++j) m = _mm256_max_ps(m, _mm256_load_ps(buf.s + (size_t)j * QB + g));
                const __m256 old = _mm256_load_ps(mx + g);
                m = _mm256_max_ps(m, old);
                const __m256 al = exp2_nonpositive(_mm256_sub_ps(old, m));
                __m256 total = _mm256_setzero_ps();
                for (int j = 0; j < cols; ++j) {
                    float* sj = buf.s + (size_t)j * QB + g;
                    const __m256 e = exp2_nonpositive(_mm256_sub_ps(_mm256_load_ps(sj), m));
                    _mm256_store_ps(sj, e);
                    total = _mm256_add_ps(total, e);
                }
                _mm256_store_ps(mx + g, m);
                _mm256_store_ps(alpha + g, al);
                _mm256_store_ps(sum + g, _mm256_fmadd_ps(_mm256_load_ps(sum + g), al, total));
            }
            // O^T = alpha O^T + V^T P^T
            for (int g = 0; g < QB; g += 8 * L)
                tiles(D, [&](auto nt, int d0) {
                    pv_tile<decltype(nt)::value>(buf.o, vblk, buf.s, alpha, d0, g, cols);
                });
        }
        float* obase = a.o + b * a.os[0] + h * a.os[1];
        for (int r = 0; r < rows; ++r) {
            const float inv = 1.f / sum[r];
            float* dst = obase + (r0 + r) * a.os[2];
            for (int d = 0; d < D; ++d) dst[d] = buf.o[(size_t)d * QB + r] * inv;
        }
    }
    return 0;
}

}  // namespace

// q (B, H, N, D), k and v (B, H, M, D), out (B, H, N, D): fp32, any strides for the first three dims (given in
// elements as {batch, head, token}), contiguous along D. scale multiplies q k^T. threads: how many to use.
// Returns 0, 1 for a head dim outside 1..512 or an empty problem, 2 when memory could not be allocated.
extern "C" int sdl_attention_f32(const float* q, const float* k, const float* v, float* out, int B, int H, int N,
                                 int M, int D, const int64_t* qs, const int64_t* ks, const int64_t* vs,
                                 const int64_t* os, float scale, int threads) {
    if (D < 1 || D > 512 || B < 1 || H < 1 || N < 1 || M < 1) return 1;
    const Problem a{q, k, v, out, B, H, N, M, D, {qs[0], qs[1], qs[2]}, {ks[0], ks[1], ks[2]}, {vs[0], vs[1], vs[2]},
                    {os[0], os[1], os[2]}, scale};
    return sdl::parallel_parts((int64_t)B * H * ((N + QB - 1) / QB), threads,
                               [&](int64_t begin, int64_t end) { return run(a, begin, end); });
}

// --- GEGLU ----------------------------------------------------------------------------------------------------------
//
// PyTorch runs value * gelu(gate) of a GEGLU over a (tokens, 2F) bias-added product as a bias copy, a gelu over a
// strided half and a multiply: three passes over the largest activations of the UNet's transformers, each into a
// freshly allocated tensor. Here the two halves' products arrive without bias (two plain GEMMs) and one pass adds
// the biases, applies the exact (erf) GELU and multiplies, in place.

namespace {

// erf by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7)
inline __m256 erf_ps(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(ax, _mm256_set1_ps(0.3275911f), _mm256_set1_ps(1.f)));
    __m256 y = _mm256_set1_ps(1.061405429f);
    y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(-1.453152027f));
    y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(1.421413741f));
    y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(-0.284496736f));
    y = _mm256_fmadd_ps(y, t, _mm256_set1_ps(0.254829592f));
    y = _mm256_mul_ps(y, t);
    const __m256 e = exp2_nonpositive(_mm256_mul_ps(_mm256_mul_ps(ax, ax), _mm256_set1_ps(-1.44269504088896341f)));
    const __m256 r = _mm256_fnmadd_ps(y, e, _mm256_set1_ps(1.f));  // 1 - y e
    return _mm256_or_ps(r, _mm256_and_ps(x, sign));
}

inline __m256 geglu_ps(__m256 v, __m256 g) {
    const __m256 half_g = _mm256_mul_ps(g, _mm256_set1_ps(0.5f));
    const __m256 cdf = _mm256_add_ps(_mm256_set1_ps(1.f), erf_ps(_mm256_mul_ps(g, _mm256_set1_ps(0.70710678118654752f))));
    return _mm256_mul_ps(v, _mm256_mul_ps(half_g, cdf));
}

void geglu_rows(float* v, const float* g, const float* bv, const float* bg, int64_t r0, int64_t r1, int64_t cols,
                int64_t ldv, int64_t ldg) {
    const int64_t full = cols & ~7;
    const __m256i tail = lanes((int)(cols - full));
    for (int64_t r = r0; r < r1; ++r) {
        float* vr = v + r * ldv;
        const float* gr = g + r * ldg;
        for (int64_t c = 0; c < full; c += 8) {
            __m256 a = _mm256_loadu_ps(vr + c), z = _mm256_loadu_ps(gr + c);
            if (bv) a = _mm256_add_ps(a, _mm256_loadu_ps(bv + c));
            if (bg) z = _mm256_add_ps(z, _mm256_loadu_ps(bg + c));
            _mm256_storeu_ps(vr + c, geglu_ps(a, z));
        }
        if (full < cols) {
            __m256 a = _mm256_maskload_ps(vr + full, tail), z = _mm256_maskload_ps(gr + full, tail);
            if (bv) a = _mm256_add_ps(a, _mm256_maskload_ps(bv + full, tail));
            if (bg) z = _mm256_add_ps(z, _mm256_maskload_ps(bg + full, tail));
            _mm256_maskstore_ps(vr + full, tail, geglu_ps(a, z));
        }
    }
}

}  // namespace

// v (rows, cols; row stride ldv) <- (v + bv) * gelu(g + bg), g (rows, cols; row stride ldg); bv, bg: (cols) or null.
// All fp32. Returns 0, or 1 for an empty or malformed problem.
extern "C" int sdl_geglu_f32(float* v, const float* g, const float* bv, const float* bg, int64_t rows, int64_t cols,
                             int64_t ldv, int64_t ldg, int threads) {
    if (rows < 1 || cols < 1 || ldv < cols || ldg < cols) return 1;
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * cols / 65536 + 1));
    parallel(threads, [&](int t) {
        geglu_rows(v, g, bv, bg, rows * t / threads, rows * (t + 1) / threads, cols, ldv, ldg);
    });
    return 0;
}

// --- Winograd F(4x4, 3x3) transforms ---------------------------------------------------------------------------------
//
// A 3x3 stride-1 convolution by Winograd's F(4x4, 3x3) (Lavin & Gray 2015): each 4x4 block of outputs comes from a 6x6
// tile of the input (tiles overlap by 2), V = B^T d B; with U = G g G^T of each filter, the 36 element-wise products
// over the channels are 36 matrix products M[s] = V[s] U[s] (PyTorch's bmm), and Y = A^T M A. 36 multiplications per
// 16 outputs and channel pair instead of 144: 2.25x fewer than F(2x2, 3x3)'s 64 (16 per 4 outputs). The transforms
// read and write the activations, channels along the vector lanes (8 at a time, so C and K are multiples of 8):
//
//   B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1]
//   A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]
//
// sdl_wino43_input: tiles of tile rows [r0, r0 + rows) of the zero-padded input into V (36, P, C), P = N * rows * tw
// tiles in (n, tile row, tile column) order. sdl_wino43_output: M (36, P, kk) (row stride ldm) into the output's
// 4x4 blocks (channels k0 .. k0 + kk, plus the bias), the output being (N, 4 th, 4 tw, K) channels-last, contiguous.

namespace {

// rows of B^T applied to six vectors (one per tile row or column)
inline void bt6(const __m256 d[6], __m256 r[6]) {
    const __m256 four = _mm256_set1_ps(4.f), five = _mm256_set1_ps(5.f), two = _mm256_set1_ps(2.f);
    r[0] = _mm256_add_ps(_mm256_fnmadd_ps(five, d[2], _mm256_mul_ps(four, d[0])), d[4]);
    const __m256 a = _mm256_fnmadd_ps(four, d[2], d[4]);          // d4 - 4 d2
    const __m256 b = _mm256_fnmadd_ps(four, d[1], d[3]);          // d3 - 4 d1
    r[1] = _mm256_add_ps(a, b);
    r[2] = _mm256_sub_ps(a, b);
    const __m256 c = _mm256_sub_ps(d[4], d[2]);                   // d4 - d2
    const __m256 e = _mm256_mul_ps(two, _mm256_sub_ps(d[3], d[1]));  // 2 (d3 - d1)
    r[3] = _mm256_add_ps(c, e);
    r[4] = _mm256_sub_ps(c, e);
    r[5] = _mm256_add_ps(_mm256_fnmadd_ps(five, d[3], _mm256_mul_ps(four, d[1])), d[5]);
}

// rows of A^T applied to six vectors
inline void at6(const __m256 m[6], __m256 y[4]) {
    const __m256 a = _mm256_add_ps(m[1], m[2]), b = _mm256_sub_ps(m[1], m[2]);
    const __m256 c = _mm256_add_ps(m[3], m[4]), d = _mm256_sub_ps(m[3], m[4]);
    y[0] = _mm256_add_ps(_mm256_add_ps(m[0], a), c);
    y[1] = _mm256_fmadd_ps(_mm256_set1_ps(2.f), d, b);
    y[2] = _mm256_fmadd_ps(_mm256_set1_ps(4.f), c, a);
    y[3] = _mm256_add_ps(_mm256_fmadd_ps(_mm256_set1_ps(8.f), d, b), m[5]);
}

struct WinoIn {
    const float* x;        // element (n, h, w, c) at x[n*sn + h*sh + w*sw + c]
    int64_t sn, sh, sw;
    int N, H, W, C, ph, pw, r0, rows, tw;
    float* v;              // (36, P, C)
};

void wino43_input_tiles(const WinoIn& a, int64_t begin, int64_t end) {
    const int64_t P = (int64_t)a.N * a.rows * a.tw;
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t p = begin; p < end; ++p) {
        const int tx = (int)(p % a.tw), ty = (int)(p / a.tw % a.rows), n = (int)(p / a.tw / a.rows);
        const int h0 = 4 * (a.r0 + ty) - a.ph, w0 = 4 * tx - a.pw;
        const float* rowp[6];
        bool rin[6], cin[6];
        for (int i = 0; i < 6; ++i) {
            rin[i] = h0 + i >= 0 && h0 + i < a.H;
            cin[i] = w0 + i >= 0 && w0 + i < a.W;
            rowp[i] = a.x + n * a.sn + (int64_t)(h0 + i) * a.sh + (int64_t)w0 * a.sw;
        }
        float* out = a.v + p * a.C;
        for (int c = 0; c < a.C; c += 8) {
            __m256 t[6][6];   // t[i][j]: B^T applied down the tile's columns, row i, column j
            for (int j = 0; j < 6; ++j) {
                __m256 d[6];
                for (int i = 0; i < 6; ++i)
                    d[i] = rin[i] && cin[j] ? _mm256_loadu_ps(rowp[i] + j * a.sw + c) : zero;
                __m256 r[6];
                bt6(d, r);
                for (int i = 0; i < 6; ++i) t[i][j] = r[i];
            }
            for (int i = 0; i < 6; ++i) {
                __m256 r[6];
                bt6(t[i], r);
                for (int j = 0; j < 6; ++j) _mm256_storeu_ps(out + (int64_t)(6 * i + j) * P * a.C + c, r[j]);
            }
        }
    }
}

struct WinoOut {
    const float* m;        // (36, P, kk), row stride ldm, matrix stride P * ldm
    int64_t ldm;
    const float* bias;     // (K) or null
    float* y;              // (N, 4 th, 4 tw, K) contiguous
    int N, th, tw, K, r0, rows, k0, kk;
};

void wino43_output_tiles(const WinoOut& a, int64_t begin, int64_t end) {
    const int64_t P = (int64_t)a.N * a.rows * a.tw;
    const int64_t row = (int64_t)4 * a.tw * a.K;   // one output row, in elements
    for (int64_t p = begin; p < end; ++p) {
        const int tx = (int)(p % a.tw), ty = (int)(p / a.tw % a.rows), n = (int)(p / a.tw / a.rows);
        float* y0 = a.y + ((int64_t)n * 4 * a.th + 4 * (a.r0 + ty)) * row + (int64_t)4 * tx * a.K + a.k0;
        const float* m0 = a.m + p * a.ldm;
        for (int k = 0; k < a.kk; k += 8) {
            __m256 t[4][6];   // A^T applied down the columns
            for (int j = 0; j < 6; ++j) {
                __m256 mm[6], r[4];
                for (int i = 0; i < 6; ++i) mm[i] = _mm256_loadu_ps(m0 + (int64_t)(6 * i + j) * P * a.ldm + k);
                at6(mm, r);
                for (int i = 0; i < 4; ++i) t[i][j] = r[i];
            }
            const __m256 b = a.bias ? _mm256_loadu_ps(a.bias + a.k0 + k) : _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                __m256 r[4];
                at6(t[i], r);
                for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y0 + i * row + (int64_t)j * a.K + k, _mm256_add_ps(r[j], b));
            }
        }
    }
}

}  // namespace

// x: the input as (N, H, W, C) with element strides sn, sh, sw (channels contiguous); ph, pw: the zero padding at
// the top and left (the bottom and right are padded as far as the tiles reach). v: (36, N * rows * tw, C).
// Returns 0, or 1 for a malformed problem (C not a multiple of 8, an empty range).
extern "C" int sdl_wino43_input(const float* x, int64_t sn, int64_t sh, int64_t sw, int N, int H, int W, int C,
                                int ph, int pw, int r0, int rows, int tw, float* v, int threads) {
    if (N < 1 || H < 1 || W < 1 || C < 8 || C % 8 || rows < 1 || tw < 1 || r0 < 0) return 1;
    const WinoIn a{x, sn, sh, sw, N, H, W, C, ph, pw, r0, rows, tw, v};
    return sdl::parallel_parts((int64_t)N * rows * tw, threads, [&](int64_t begin, int64_t end) {
        wino43_input_tiles(a, begin, end);
        return 0;
    });
}

// m: (36, N * rows * tw, kk) with row stride ldm; y: (N, 4 th, 4 tw, K) contiguous, of which output channels
// [k0, k0 + kk) of the blocks of tile rows [r0, r0 + rows) are written, plus bias[k0 + k] (bias: (K) or null).
// Returns 0, or 1 for a malformed problem.
extern "C" int sdl_wino43_output(const float* m, int64_t ldm, const float* bias, float* y, int N, int th, int tw,
                                 int K, int r0, int rows, int k0, int kk, int threads) {
    if (N < 1 || th < 1 || tw < 1 || rows < 1 || r0 < 0 || r0 + rows > th || kk < 8 || kk % 8 || k0 < 0 ||
        k0 + kk > K || ldm < kk)
        return 1;
    const WinoOut a{m, ldm, bias, y, N, th, tw, K, r0, rows, k0, kk};
    return sdl::parallel_parts((int64_t)N * rows * tw, threads, [&](int64_t begin, int64_t end) {
        wino43_output_tiles(a, begin, end);
        return 0;
    });
}

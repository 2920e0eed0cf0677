// sdlite: fused bf16 attention on AMX tiles (Intel Sapphire Rapids and later), built and loaded by
// sdlite/kernels/build.py.
//
// sdl_attention_amx: out = softmax(q k^T * scale) v for each (batch, head), the same problem, arguments and roundings
// as sdl_attention_bf16 in avx512_bf16.cpp (bf16 products summed in fp32, an fp32 softmax in base 2, probabilities
// rounded to bf16 for the second product, the output rounded once), with both products on the tile unit.
//
// Why: at Stable Diffusion 1.x's 64x64-latent self-attention (4096 keys, head dim 40) the products are small next to
// the softmax: PyTorch's flash kernel, which runs them on oneDNN's AMX brgemm, takes the same time at head dims 32 and
// 64, and four of its passes over each block of scores (scale and maximum, exp and sum, rounding) are separate.
// AVX512-BF16 dot products (the other kernel) are 16 times slower than the tiles, so that kernel loses on these CPUs.
// Here the tiles do the products and each score is touched by two vector passes: one for the row maximum, one for
// 2^(s c - max), the row sum and the bf16 probability.
//
// Layout, per (batch, head), packed once by the thread that first meets it (a thread's items are consecutive):
//   K as tiles of 16 keys x 32 head-dim values, in the pair ("VNNI") order the tile product reads as its B operand,
//   the head dim zero-padded to a multiple of 32;
//   V as tiles of 32 keys x 16 output columns, in the same pair order, zero-padded in keys and columns.
// Per block of QB = 32 queries (two 16-row tiles) and KB keys: S = Q K^T into fp32 tiles (2 x 2 at a time), the row
// maxima, P = 2^(S c - max) as bf16 with the rows' sums, O = alpha O + P V with O's tiles loaded from and stored to
// an fp32 buffer. Keys past the last (a block of 77 context tokens) get probability 0.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include "attention.h"

namespace {

using Problem = sdl::AttentionProblem;
using sdl::exp2_softmax;
using sdl::lanes;

constexpr int QB = 32;   // queries per block: two tiles of 16 rows
constexpr int KB = 256;  // keys per block (a multiple of 32): a block's scores, 32 KB, stay in L1 (512: 17% slower)
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;

struct TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// every tile 16 rows x 64 bytes (16 fp32, or 32 bf16 as 16 pairs)
void configure_tiles() {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

// Linux hands a process the tile state only when asked; asked once per process (the answer holds for all its threads)
bool tiles_permitted() {
    static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

// the largest of a row's first cols scores
inline float row_max(const float* s, int cols) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < cols; j += 16) m = _mm512_mask_max_ps(m, lanes(cols - j), m, _mm512_load_ps(s + j));
    return _mm512_reduce_max_ps(m);
}

// A row's probabilities 2^(s c - ref) as bf16 (0 past the last key, up to cols32); returns their lane-wise sums
inline __m512 probabilities(const float* s, uint16_t* pr, int cols, int cols32, float c, float ref) {
    const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(-ref);
    __m512 sum = _mm512_setzero_ps();
    const int full = cols & ~15;
    int j = 0;
    for (; j < full; j += 16) {
        const __m512 x = _mm512_load_ps(s + j);
        const __m512 e = exp2_softmax(_mm512_fmadd_ps(x, vc, vm));
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256((__m256i*)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    for (; j < cols32; j += 16) {
        const __mmask16 valid = lanes(cols - j);
        const __m512 x = _mm512_load_ps(s + j);
        const __m512 e = _mm512_maskz_mov_ps(valid, exp2_softmax(_mm512_fmadd_ps(x, vc, vm)));
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256((__m256i*)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return sum;
}

struct Shape {
    int DS;   // 32-wide steps along the head dim (the first product's depth)
    int DT;   // 16-wide tiles of output columns
    int MP;   // keys, padded to a multiple of 32
    int nkb;  // key blocks
    int nqb;  // query blocks
    explicit Shape(const Problem& a)
        : DS((a.D + 31) / 32), DT((a.D + 15) / 16), MP((a.M + 31) / 32 * 32), nkb((a.M + KB - 1) / KB),
          nqb((a.N + QB - 1) / QB) {}
};

struct Buffers {
    uint16_t *kp = nullptr, *vp = nullptr, *qb = nullptr, *p = nullptr;
    float *s = nullptr, *o = nullptr;
    bool ok = false;
    explicit Buffers(const Shape& z) {
        const size_t kp_n = (size_t)(z.MP / 16) * z.DS * 512, vp_n = (size_t)(z.MP / 32) * z.DT * 512;
        kp = (uint16_t*)aligned_alloc(64, kp_n * 2);
        vp = (uint16_t*)aligned_alloc(64, vp_n * 2);
        qb = (uint16_t*)aligned_alloc(64, (size_t)QB * z.DS * 32 * 2);
        p = (uint16_t*)aligned_alloc(64, (size_t)QB * KB * 2);
        s = (float*)aligned_alloc(64, (size_t)QB * KB * 4);
        o = (float*)aligned_alloc(64, (size_t)QB * z.DT * 16 * 4);
        ok = kp && vp && qb && p && s && o;
        if (ok) {
            memset(kp, 0, kp_n * 2);
            memset(vp, 0, vp_n * 2);
            memset(p, 0, (size_t)QB * KB * 2);
        }
    }
    ~Buffers() {
        free(kp);
        free(vp);
        free(qb);
        free(p);
        free(s);
        free(o);
    }
};

// K and V of one (batch, head) into tile order (padding stays zero: the buffers start zeroed and every (b, h) has the
// same shape, so the same positions are written each time).
// K: each 64-byte row of a tile holds one head-dim pair of 16 keys, gathered from their 16 rows at once.
// V: each 64-byte row holds 16 output columns of a key pair, interleaved from the two keys' rows.
void pack(const Problem& a, const Shape& z, Buffers& buf, int b, int h) {
    const uint16_t* kbase = a.k + b * a.ks[0] + h * a.ks[1];
    const uint16_t* vbase = a.v + b * a.vs[0] + h * a.vs[1];
    const int pairs = a.D / 2;
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(a.ks[2] * 2)));
    for (int n0 = 0; n0 < a.M; n0 += 16) {
        const __mmask16 keys = lanes(a.M - n0);
        const uint16_t* kr = kbase + n0 * a.ks[2];
        uint16_t* kt = buf.kp + (size_t)(n0 / 16) * z.DS * 512;
        for (int pi = 0; pi < pairs; ++pi) {
            const __m512i got = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keys, rows, kr + 2 * pi, 1);
            _mm512_store_si512(kt + (pi / 16) * 512 + (pi % 16) * 32, got);
        }
        if (a.D & 1)  // an odd head dim's last value, without reading past the row
            for (int n = n0; n < std::min(a.M, n0 + 16); ++n)
                kt[((a.D - 1) / 32) * 512 + (((a.D - 1) % 32) / 2) * 32 + (n % 16) * 2] =
                    kr[(n - n0) * a.ks[2] + a.D - 1];
    }
    const __m512i mix = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                          0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                          0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);  // x0 y0 x1 y1 ... x15 y15
    for (int n = 0; n < a.M; n += 2) {
        const uint16_t* x = vbase + n * a.vs[2];
        const uint16_t* y = x + a.vs[2];
        const bool second = n + 1 < a.M;
        uint16_t* vt = buf.vp + (size_t)(n / 32) * z.DT * 512 + ((n % 32) / 2) * 32;
        for (int d = 0; d < a.D; d += 16) {
            const __mmask32 cols = (__mmask32)lanes(a.D - d);
            const __m512i xv = _mm512_maskz_loadu_epi16(cols, x + d);
            const __m512i yv = second ? _mm512_maskz_loadu_epi16(cols, y + d) : _mm512_setzero_si512();
            _mm512_store_si512(vt + (d / 16) * 512, _mm512_permutex2var_epi16(xv, mix, yv));
        }
    }
}

// S[0..32, 0..cols) = Qblock K[k0 .. k0 + cols)^T, cols rounded up to 32 (those columns' scores are not used)
inline void scores(const Shape& z, const Buffers& buf, int k0, int cols) {
    const int qstride = z.DS * 64;  // bytes per row of the query block
    for (int j = 0; j < cols; j += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t* k0t = buf.kp + (size_t)((k0 + j) / 16) * z.DS * 512;
        const uint16_t* k1t = k0t + (size_t)z.DS * 512;
        for (int s = 0; s < z.DS; ++s) {
            _tile_loadd(4, buf.qb + s * 32, qstride);
            _tile_loadd(5, buf.qb + 16 * z.DS * 32 + s * 32, qstride);
            _tile_loadd(6, k0t + s * 512, 64);
            _tile_loadd(7, k1t + s * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, buf.s + j, KB * 4);
        _tile_stored(1, buf.s + j + 16, KB * 4);
        _tile_stored(2, buf.s + 16 * KB + j, KB * 4);
        _tile_stored(3, buf.s + 16 * KB + j + 16, KB * 4);
    }
}

// O = O + P V[k0 .. k0 + cols) (O already scaled by alpha; P zero past the last key)
inline void values(const Shape& z, const Buffers& buf, int k0, int cols) {
    const int ostride = z.DT * 64;
    for (int t = 0; t < z.DT; ++t) {
        float* o0 = buf.o + t * 16;
        float* o1 = buf.o + 16 * z.DT * 16 + t * 16;
        _tile_loadd(0, o0, ostride);
        _tile_loadd(1, o1, ostride);
        for (int j = 0; j < cols; j += 32) {
            _tile_loadd(6, buf.vp + ((size_t)((k0 + j) / 32) * z.DT + t) * 512, 64);
            _tile_loadd(4, buf.p + j, KB * 2);
            _tile_loadd(5, buf.p + 16 * KB + j, KB * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
        }
        _tile_stored(0, o0, ostride);
        _tile_stored(1, o1, ostride);
    }
}

// Work items are (batch, head, query block), in that order; one thread runs [begin, end).
int run(const Problem& a, int64_t begin, int64_t end) {
    const Shape z(a);
    Buffers buf(z);
    if (!buf.ok) return 2;
    configure_tiles();
    const int DV = z.DT * 16;
    const float c = a.scale * 1.44269504088896341f;  // scale and ln -> log2
    float mrow[QB];
    __m512 lsum[QB];  // per row, the lane-wise sums of its probabilities
    int64_t packed = -1;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t bh = item / z.nqb;
        const int r0 = (int)(item % z.nqb) * QB;
        const int b = (int)(bh / a.H), h = (int)(bh % a.H);
        if (bh != packed) {
            pack(a, z, buf, b, h);
            packed = bh;
        }
        const int rows = std::min(QB, a.N - r0);
        memset(buf.qb, 0, (size_t)QB * z.DS * 64);
        const uint16_t* qbase = a.q + b * a.qs[0] + h * a.qs[1];
        for (int r = 0; r < rows; ++r)
            memcpy(buf.qb + (size_t)r * z.DS * 32, qbase + (r0 + r) * a.qs[2], (size_t)a.D * 2);
        memset(buf.o, 0, (size_t)QB * DV * 4);
        for (int r = 0; r < QB; ++r) {
            mrow[r] = -INFINITY;
            lsum[r] = _mm512_setzero_ps();
        }
        for (int kb = 0; kb < z.nkb; ++kb) {
            const int k0 = kb * KB;
            const int cols = std::min(KB, a.M - k0);
            const int cols32 = (cols + 31) & ~31;
            scores(z, buf, k0, cols32);
            for (int r = 0; r < rows; ++r) {
                const float* s = buf.s + (size_t)r * KB;
                const float mnew = std::max(mrow[r], row_max(s, cols) * c);
                if (mnew > mrow[r] && kb > 0) {  // a larger maximum: what was summed so far scaled to it
                    const __m512 al = _mm512_set1_ps(exp2f(mrow[r] - mnew));
                    lsum[r] = _mm512_mul_ps(lsum[r], al);
                    float* orow = buf.o + (size_t)r * DV;
                    for (int d = 0; d < DV; d += 16)
                        _mm512_store_ps(orow + d, _mm512_mul_ps(al, _mm512_load_ps(orow + d)));
                }
                mrow[r] = mnew;
                lsum[r] = _mm512_add_ps(lsum[r], probabilities(s, buf.p + (size_t)r * KB, cols, cols32, c, mnew));
            }
            values(z, buf, k0, cols32);
        }
        sdl::write_rows(a, b, h, r0, rows, buf.o, DV, lsum);
    }
    _tile_release();
    return 0;
}

}  // namespace

// As sdl_attention_bf16: q (B, H, N, D), k and v (B, H, M, D), out (B, H, N, D), bf16 as uint16, any strides for the
// first three dims (in elements, {batch, head, token}), contiguous along D; scale multiplies q k^T. Returns 0, 1 for
// a head dim outside 1..512 or an empty problem, 2 when memory could not be allocated, 3 when Linux does not grant the
// tile state.
extern "C" int sdl_attention_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int B, int H,
                                 int N, int M, int D, const int64_t* qs, const int64_t* ks, const int64_t* vs,
                                 const int64_t* os, float scale, int threads) {
    if (!tiles_permitted()) return 3;
    return sdl::attention_call(q, k, v, out, B, H, N, M, D, qs, ks, vs, os, scale, threads, QB, run);
}

// 1 when Linux grants this process the tile state (asked here), else 0: checked once before the kernel is used
extern "C" int sdl_amx_permitted() { return tiles_permitted() ? 1 : 0; }

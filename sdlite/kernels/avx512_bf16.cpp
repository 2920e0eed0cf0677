// sdlite: bf16 kernels for x86 CPUs with AVX512-BF16, built and loaded by sdlite/kernels/build.py.
//
// sdl_attention_bf16: fused (flash) attention.
// sdl_geglu_bf16: the GEGLU feed-forward's epilogue, (value + bias) * gelu(gate + bias) in one pass.
// sdl_minmax_bf16, sdl_quantize_u8_bf16: an int8 layer's bf16 input, its range and its uint8 codes (bf16-int8).
// sdl_quantize_rows_u8_bf16, sdl_scale_rows_bf16: the same with one scale per row (a transformer's tokens).
// sdl_rope_bf16: the rotary embedding of a transformer's queries or keys, in one pass, into a strided output.
// sdl_rms_scale_bf16: an RMS norm's scaling by its rows' factors and its weight, in one pass.
//
// Attention: out = softmax(q k^T * scale) v for each (batch, head), without a mask, computed block by block with the running
// ("online") softmax of FlashAttention (Dao et al., 2022), so the N x M scores never exist at once. Products are bf16
// pairs summed in fp32 (vdpbf16ps), the softmax is fp32, the probabilities are rounded to bf16 for the second product
// and the output is rounded to bf16 once at the end: the same roundings PyTorch's flash CPU kernel makes.
//
// Why: PyTorch's kernel spends half its time outside the products (softmax, exp) and runs the products through
// generic GEMM calls at head dim 40; at Stable Diffusion 1.x's 64x64-latent self-attention this kernel is ~3x
// faster (bench/profile_unet.py, tests/test_kernels.py checks it against fp32 attention).
//
// Layout work per (batch, head), done once by the thread that first meets it:
//   K as [key block][d pair][KB keys] (so one 512-bit load holds 16 keys' (d, d+1) pairs),
//   V as [key block][key pair][DV] (16 output columns' (key, key+1) pairs per load), zero padded.
// Per block of QB queries: S = Q K_blk^T in 4 x 64 register tiles (each row's maximum kept in a register as the tiles
// are stored), the online softmax in base 2 (exp2_softmax: 7.5e-5 relative error, a 50th of bf16's step; the
// running sums lane-wise, added up once at the end), and O = alpha * O + P V_blk in 4 x 64 register tiles.
// At SD 1.5's (2, 8, 4096, 4096, 40) this runs in 63 ms where it took 77 ms with 128-key blocks, a separate maximum
// pass, a degree-5 exp2 and a sum per block (a 2-core Zen 4). On a 2-core AMD EPYC with full-width AVX-512: 61-62 ms
// against 70-77 ms before the PV product's 8-row tiles (24 accumulators in flight instead of 12), the packing of K by
// whole pairs along the block and of V by two-row interleaves, and alpha = 1 without an exp2 where the maximum stays;
// 59.5 ms with head dim 40's last 8 columns two rows to a vector (pv_tile_half).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "parallel.h"

namespace {

using sdl::parallel;

constexpr int QB = 64;    // queries per block (a multiple of 4)
constexpr int KB = 256;   // keys per block (a multiple of 64)

// 2^x for x <= 0 (x below -127 gives ~2^-127, which the fp32 sums ignore)
inline __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);  // in [-0.5, 0.5]
    __m512 p = _mm512_set1_ps(1.33335581e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

using Problem = sdl::AttentionProblem;
using sdl::exp2_softmax;
using sdl::lanes;

struct Buffers {
    uint32_t *kp = nullptr, *vp = nullptr, *qb = nullptr;
    float *s = nullptr, *o = nullptr;
    uint16_t* p = nullptr;
    bool ok = false;
    Buffers(size_t kp_n, size_t vp_n, size_t qb_n, size_t s_n, size_t o_n) {
        kp = (uint32_t*)aligned_alloc(64, kp_n * 4);
        vp = (uint32_t*)aligned_alloc(64, vp_n * 4);
        qb = (uint32_t*)aligned_alloc(64, qb_n * 4);
        s = (float*)aligned_alloc(64, s_n * 4);
        p = (uint16_t*)aligned_alloc(64, s_n * 2);
        o = (float*)aligned_alloc(64, o_n * 4);
        ok = kp && vp && qb && s && p && o;
    }
    ~Buffers() { free(kp); free(vp); free(qb); free(s); free(p); free(o); }
};

// O[r..r+R, d0..d0+16 NC] = alpha O + P V over the block's key pairs (the R x NC accumulators stay in registers)
template <int R, int NC>
inline void pv_tile(const Buffers& buf, const uint32_t* vblk, const float* alpha, int r, int d0, int DV, int pairs) {
    __m512 acc[R][NC];
    for (int i = 0; i < R; ++i) {
        const __m512 al = _mm512_set1_ps(alpha[r + i]);
        for (int d = 0; d < NC; ++d)
            acc[i][d] = _mm512_mul_ps(al, _mm512_load_ps(buf.o + (size_t)(r + i) * DV + d0 + 16 * d));
    }
    const int* prow = (const int*)(buf.p + (size_t)r * KB);
    for (int j = 0; j < pairs; ++j) {
        __m512bh vv[NC];
        for (int d = 0; d < NC; ++d) vv[d] = (__m512bh)_mm512_load_si512(vblk + (size_t)j * DV + d0 + 16 * d);
        for (int i = 0; i < R; ++i) {
            const __m512bh p2 = (__m512bh)_mm512_set1_epi32(prow[i * (KB / 2) + j]);
            for (int d = 0; d < NC; ++d) acc[i][d] = _mm512_dpbf16_ps(acc[i][d], p2, vv[d]);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int d = 0; d < NC; ++d) _mm512_store_ps(buf.o + (size_t)(r + i) * DV + d0 + 16 * d, acc[i][d]);
}

// pv_tile for NF full 16-column vectors and a last one of at most 8 columns (SD 1.x's head dim 40 = 16 + 16 + 8):
// those 8 columns of two rows share one accumulator (the V values broadcast to both halves, each half the row's
// probability), so the padding's 8 columns cost no products: 20 vdpbf16ps per key pair for 8 rows instead of 24
template <int R, int NF>
inline void pv_tile_half(const Buffers& buf, const uint32_t* vblk, const float* alpha, int r, int d0, int DV,
                         int pairs) {
    static_assert(R % 2 == 0, "rows go in pairs");
    __m512 acc[R][NF > 0 ? NF : 1];
    __m512 two[R / 2];  // rows r + 2i (lanes 0-7) and r + 2i + 1 (lanes 8-15) of the last 8 columns
    const int dt = d0 + 16 * NF;
    for (int i = 0; i < R; ++i) {
        const __m512 al = _mm512_set1_ps(alpha[r + i]);
        for (int d = 0; d < NF; ++d)
            acc[i][d] = _mm512_mul_ps(al, _mm512_load_ps(buf.o + (size_t)(r + i) * DV + d0 + 16 * d));
    }
    for (int i = 0; i < R / 2; ++i) {
        const float* o = buf.o + (size_t)(r + 2 * i) * DV + dt;
        const __m512 both = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_load_ps(o)), _mm256_load_ps(o + DV), 1);
        const __m512 al = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(alpha[r + 2 * i]),
                                               _mm512_set1_ps(alpha[r + 2 * i + 1]));
        two[i] = _mm512_mul_ps(al, both);
    }
    const int* prow = (const int*)(buf.p + (size_t)r * KB);
    for (int j = 0; j < pairs; ++j) {
        __m512bh vv[NF > 0 ? NF : 1];
        for (int d = 0; d < NF; ++d) vv[d] = (__m512bh)_mm512_load_si512(vblk + (size_t)j * DV + d0 + 16 * d);
        const __m256i tail = _mm256_load_si256((const __m256i*)(vblk + (size_t)j * DV + dt));
        const __m512bh vt = (__m512bh)_mm512_broadcast_i64x4(tail);
        for (int i = 0; i < R; i += 2) {
            const __m512i p0 = _mm512_set1_epi32(prow[i * (KB / 2) + j]);
            const __m512i p1 = _mm512_set1_epi32(prow[(i + 1) * (KB / 2) + j]);
            for (int d = 0; d < NF; ++d) {
                acc[i][d] = _mm512_dpbf16_ps(acc[i][d], (__m512bh)p0, vv[d]);
                acc[i + 1][d] = _mm512_dpbf16_ps(acc[i + 1][d], (__m512bh)p1, vv[d]);
            }
            two[i / 2] = _mm512_dpbf16_ps(two[i / 2], (__m512bh)_mm512_mask_blend_epi32(0xFF00, p0, p1), vt);
        }
    }
    for (int i = 0; i < R; ++i)
        for (int d = 0; d < NF; ++d) _mm512_store_ps(buf.o + (size_t)(r + i) * DV + d0 + 16 * d, acc[i][d]);
    for (int i = 0; i < R / 2; ++i) {
        float* o = buf.o + (size_t)(r + 2 * i) * DV + dt;
        _mm256_store_ps(o, _mm512_castps512_ps256(two[i]));
        _mm256_store_ps(o + DV, _mm512_extractf32x8_ps(two[i], 1));
    }
}

// O = alpha O + P V for rows [r, r + R) over all DV columns, in tiles of up to 64 columns: R = 8 rows keep 16-24
// accumulators in flight (a vdpbf16ps's latency times the two the CPU issues per cycle: with 12 in flight the PV
// product ran at half speed at SD 1.x's head dim 40); 64 columns take two tiles of 4 rows; a last vector of at most 8
// columns goes two rows a vector (pv_tile_half)
template <int R>
inline void pv_rows(const Buffers& buf, const uint32_t* vblk, const float* alpha, int r, int D, int DV, int pairs) {
    const bool half = D % 16 != 0 && D % 16 <= 8;
    for (int d0 = 0; d0 < DV; d0 += 64) {
        const int nc = std::min(4, (DV - d0) / 16);
        if (half && d0 + 16 * nc == DV && nc < 4) {
            switch (nc) {
                case 1: pv_tile_half<R, 0>(buf, vblk, alpha, r, d0, DV, pairs); break;
                case 2: pv_tile_half<R, 1>(buf, vblk, alpha, r, d0, DV, pairs); break;
                default: pv_tile_half<R, 2>(buf, vblk, alpha, r, d0, DV, pairs); break;
            }
            continue;
        }
        switch (nc) {
            case 1: pv_tile<R, 1>(buf, vblk, alpha, r, d0, DV, pairs); break;
            case 2: pv_tile<R, 2>(buf, vblk, alpha, r, d0, DV, pairs); break;
            case 3: pv_tile<R, 3>(buf, vblk, alpha, r, d0, DV, pairs); break;
            default:
                for (int i = 0; i < R; i += 4) pv_tile<4, 4>(buf, vblk, alpha, r + i, d0, DV, pairs);
                break;
        }
    }
}

// K (M keys x D, row stride ks[2]) as [key block][d pair][KB keys] of uint32 (one key's dims 2p and 2p + 1), into
// zeroed memory (pairs copied whole where the rows are 4-byte aligned with an even D)
void pack_k(const Problem& a, const uint16_t* kbase, uint32_t* kp, int P) {
    if (a.D % 2 == 0 && a.ks[2] % 2 == 0 && (uintptr_t)kbase % 4 == 0) {
        const uint32_t* k32 = (const uint32_t*)kbase;
        const int64_t row = a.ks[2] / 2;
        for (int n0 = 0; n0 < a.M; n0 += KB) {     // by block and pair: the stores run along the block's keys
            const int keys = std::min(KB, a.M - n0);
            uint32_t* kd = kp + (size_t)(n0 / KB) * P * KB;
            for (int p = 0; p < P; ++p)
                for (int nn = 0; nn < keys; ++nn) kd[(size_t)p * KB + nn] = k32[(n0 + nn) * row + p];
        }
        return;
    }
    for (int n = 0; n < a.M; ++n) {
        const int nn = n % KB;
        uint32_t* kd = kp + (size_t)(n / KB) * P * KB + nn;
        const uint16_t* kr = kbase + n * a.ks[2];
        for (int d = 0; d < a.D; ++d) ((uint16_t*)(kd + (size_t)(d / 2) * KB))[d & 1] = kr[d];
    }
}

// V (M keys x D) as [key block][key pair][DV] of uint32 (the pair's two values of one dim), into zeroed memory: two
// rows interleaved 32 dims at a time
void pack_v(const Problem& a, const uint16_t* vbase, uint32_t* vp, int DV) {
    alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_load_si512(lo_idx);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int n = 0; n < a.M; n += 2) {
        const int nn = n % KB;
        uint32_t* vd = vp + ((size_t)(n / KB) * (KB / 2) + nn / 2) * DV;
        const uint16_t* r0 = vbase + n * a.vs[2];
        const uint16_t* r1 = r0 + a.vs[2];
        for (int d = 0; d < a.D; d += 32) {
            const int left = a.D - d;
            const __mmask32 m = left >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << left) - 1);
            const __m512i x0 = _mm512_maskz_loadu_epi16(m, r0 + d);
            const __m512i x1 = n + 1 < a.M ? _mm512_maskz_loadu_epi16(m, r1 + d) : _mm512_setzero_si512();
            _mm512_mask_storeu_epi32(vd + d, lanes(left), _mm512_permutex2var_epi16(x0, lo, x1));
            if (left > 16)
                _mm512_mask_storeu_epi32(vd + d + 16, lanes(left - 16), _mm512_permutex2var_epi16(x0, hi, x1));
        }
    }
}

// Work items are (batch, head, query block), in that order; one thread runs [begin, end).
int run(const Problem& a, int64_t begin, int64_t end) {
    const int P = (a.D + 1) / 2;          // bf16 pairs along the head dim
    const int DV = (a.D + 15) / 16 * 16;  // output columns, padded
    const int nkb = (a.M + KB - 1) / KB;
    const int nqb = (a.N + QB - 1) / QB;
    Buffers buf((size_t)nkb * P * KB, (size_t)nkb * (KB / 2) * DV, (size_t)QB * P, (size_t)QB * KB,
                (size_t)QB * DV);
    if (!buf.ok) return 2;
    float mrow[QB], alpha[QB];
    __m512 rowmax[QB];  // per row, the lane-wise maximum of the block's scores
    __m512 lsum[QB];    // per row, the lane-wise running sum of the probabilities
    const float c = a.scale * 1.44269504088896341f;  // scale and ln -> log2
    int64_t packed = -1;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t bh = item / nqb;
        const int qblock = (int)(item % nqb);
        const int b = (int)(bh / a.H), h = (int)(bh % a.H);
        if (bh != packed) {
            memset(buf.kp, 0, (size_t)nkb * P * KB * 4);
            memset(buf.vp, 0, (size_t)nkb * (KB / 2) * DV * 4);
            const uint16_t* kbase = a.k + b * a.ks[0] + h * a.ks[1];
            const uint16_t* vbase = a.v + b * a.vs[0] + h * a.vs[1];
            pack_k(a, kbase, buf.kp, P);
            pack_v(a, vbase, buf.vp, DV);
            packed = bh;
        }
        const int r0 = qblock * QB;
        const int rows = std::min(QB, a.N - r0);
        const int rows4 = (rows + 3) & ~3;
        memset(buf.qb, 0, (size_t)QB * P * 4);
        const uint16_t* qbase = a.q + b * a.qs[0] + h * a.qs[1];
        for (int r = 0; r < rows; ++r) memcpy(buf.qb + (size_t)r * P, qbase + (r0 + r) * a.qs[2], (size_t)a.D * 2);
        memset(buf.o, 0, (size_t)QB * DV * 4);
        for (int r = 0; r < QB; ++r) {
            mrow[r] = -INFINITY;
            lsum[r] = _mm512_setzero_ps();
        }
        for (int kb = 0; kb < nkb; ++kb) {
            const int cols = std::min(KB, a.M - kb * KB);
            const int cfull = cols & ~15;
            const __mmask16 tail = lanes(cols - cfull);
            const uint32_t* kblk = buf.kp + (size_t)kb * P * KB;
            for (int r = 0; r < rows4; ++r) rowmax[r] = _mm512_set1_ps(-INFINITY);
            // S = Q K^T (columns past the last key are not computed: a short last block, 77 context tokens)
            for (int r = 0; r < rows4; r += 4) {
                for (int cc = 0; cc < cols; cc += 64) {
                    __m512 acc[4][4];
                    for (int i = 0; i < 4; ++i)
                        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
                    for (int p = 0; p < P; ++p) {
                        const uint32_t* kp = kblk + (size_t)p * KB + cc;
                        const __m512bh b0 = (__m512bh)_mm512_load_si512(kp);
                        const __m512bh b1 = (__m512bh)_mm512_load_si512(kp + 16);
                        const __m512bh b2 = (__m512bh)_mm512_load_si512(kp + 32);
                        const __m512bh b3 = (__m512bh)_mm512_load_si512(kp + 48);
                        for (int i = 0; i < 4; ++i) {
                            const __m512bh q2 = (__m512bh)_mm512_set1_epi32((int)buf.qb[(size_t)(r + i) * P + p]);
                            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], q2, b0);
                            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], q2, b1);
                            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], q2, b2);
                            acc[i][3] = _mm512_dpbf16_ps(acc[i][3], q2, b3);
                        }
                    }
                    for (int i = 0; i < 4; ++i)
                        for (int j = 0; j < 4; ++j) _mm512_store_ps(buf.s + (size_t)(r + i) * KB + cc + 16 * j, acc[i][j]);
                    // each row's running maximum over the block's keys (lanes past the last key left out)
                    __mmask16 valid[4];
                    for (int j = 0; j < 4; ++j) {
                        const int left = cols - cc - 16 * j;
                        valid[j] = lanes(left);
                    }
                    for (int i = 0; i < 4; ++i) {
                        __m512 m = rowmax[r + i];
                        for (int j = 0; j < 4; ++j) m = _mm512_mask_max_ps(m, valid[j], m, acc[i][j]);
                        rowmax[r + i] = m;
                    }
                }
            }
            // the running softmax: new row maxima, the factor alpha for what was summed so far, P = 2^(S c - max)
            for (int r = 0; r < rows4; ++r) {
                const float* s = buf.s + (size_t)r * KB;
                const float mnew = std::max(mrow[r], _mm512_reduce_max_ps(rowmax[r]) * c);
                const float al = mnew == mrow[r] ? 1.f : exp2f(mrow[r] - mnew);   // the maximum rarely moves
                alpha[r] = al;
                mrow[r] = mnew;
                const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(-mnew);
                __m512 sum = _mm512_mul_ps(lsum[r], _mm512_set1_ps(al));
                uint16_t* pr = buf.p + (size_t)r * KB;
                for (int j = 0; j < cols; j += 16) {  // P is read up to the pair after the last key: zero there
                    __m512 e = exp2_softmax(_mm512_fmadd_ps(_mm512_load_ps(s + j), vc, vm));
                    if (j + 16 > cols) e = _mm512_maskz_mov_ps(tail, e);
                    sum = _mm512_add_ps(sum, e);
                    _mm256_store_si256((__m256i*)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
                }
                lsum[r] = sum;
            }
            // O = alpha O + P V, in tiles of 4 rows x up to 64 output columns
            const uint32_t* vblk = buf.vp + (size_t)kb * (KB / 2) * DV;
            const int pairs = (cols + 1) / 2;
            int r = 0;
            for (; r + 8 <= rows4; r += 8) pv_rows<8>(buf, vblk, alpha, r, a.D, DV, pairs);
            if (r < rows4) pv_rows<4>(buf, vblk, alpha, r, a.D, DV, pairs);
        }
        sdl::write_rows(a, b, h, r0, rows, buf.o, DV, lsum);
    }
    return 0;
}

}  // namespace

// q (B, H, N, D), k and v (B, H, M, D), out (B, H, N, D): bf16 as uint16, any strides for the first three dims
// (given in elements as {batch, head, token}), contiguous along D. scale multiplies q k^T. threads: how many to use.
// Returns 0, 1 for a head dim outside 1..512 or an empty problem, 2 when memory could not be allocated.
extern "C" int sdl_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int B, int H,
                                  int N, int M, int D, const int64_t* qs, const int64_t* ks, const int64_t* vs,
                                  const int64_t* os, float scale, int threads) {
    return sdl::attention_call(q, k, v, out, B, H, N, M, D, qs, ks, vs, os, scale, threads, QB, run);
}

// --- GEGLU ----------------------------------------------------------------------------------------------------------
//
// PyTorch runs value * gelu(gate) of a GEGLU over a (tokens, 2F) bias-added product as a bias copy, a gelu and a
// multiply: three passes over the largest activations of the UNet's transformers. Here the two halves' products
// arrive without bias (two plain GEMMs, which oneDNN also runs faster than one of twice the width at 320 channels),
// and one pass adds the biases in fp32, applies the exact (erf) GELU and rounds once to bf16.

namespace {

// 16 bf16 values (as loaded) to fp32
inline __m512 widen(__m256i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)); }

inline __m512 load_bf16(const uint16_t* p) { return widen(_mm256_loadu_si256((const __m256i*)p)); }

inline __m512 load_bf16_masked(const uint16_t* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }

// a * b + c with two roundings, as PyTorch's separate multiply and add make: the empty asm holds the product in a
// register, so that the compiler cannot contract the two into one fused multiply-add (one rounding), which it does
// to intrinsics at -O3 even under -std=c++17 (measured: a code one lower where x * inv + add falls on a tie)
inline __m512 mul_add(__m512 a, __m512 b, __m512 c) {
    __m512 p = _mm512_mul_ps(a, b);
    asm("" : "+v"(p));
    return _mm512_add_ps(p, c);
}

// erf by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7)
inline __m512 erf_ps(__m512 x) {
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(ax, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.f)));
    __m512 y = _mm512_set1_ps(1.061405429f);
    y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-1.453152027f));
    y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(1.421413741f));
    y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(-0.284496736f));
    y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(0.254829592f));
    y = _mm512_mul_ps(y, t);
    const __m512 e = exp2_nonpositive(_mm512_mul_ps(_mm512_mul_ps(ax, ax), _mm512_set1_ps(-1.44269504088896341f)));
    const __m512 r = _mm512_fnmadd_ps(y, e, _mm512_set1_ps(1.f));  // 1 - y e
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}

inline __m512 geglu_ps(__m512 v, __m512 g) {
    const __m512 half_g = _mm512_mul_ps(g, _mm512_set1_ps(0.5f));
    const __m512 cdf = _mm512_add_ps(_mm512_set1_ps(1.f), erf_ps(_mm512_mul_ps(g, _mm512_set1_ps(0.70710678118654752f))));
    return _mm512_mul_ps(v, _mm512_mul_ps(half_g, cdf));
}

// The range of bf16 values seen (the GEGLU epilogue's output as stored, an int8 layer's input), written as
// {min, max, 1 if one was infinite or NaN else 0}.
struct Range {
    __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
    __mmask16 nonfinite = 0;
    inline void add(__m256i raw, __mmask16 m) {
        const __m512 w = widen(raw);
        lo = _mm512_mask_min_ps(lo, m, lo, w);
        hi = _mm512_mask_max_ps(hi, m, hi, w);
        nonfinite |= _mm512_mask_fpclass_ps_mask(m, w, 0x99);  // QNaN, SNaN, +inf, -inf
    }
    inline void store(float* out) const {
        out[0] = _mm512_reduce_min_ps(lo);
        out[1] = _mm512_reduce_max_ps(hi);
        out[2] = nonfinite ? 1.f : 0.f;
    }
};

// one range of `n` per-thread ones (each as Range::store writes it)
inline void merge_ranges(const float* parts, int n, float* out) {
    out[0] = INFINITY, out[1] = -INFINITY, out[2] = 0.f;
    for (int t = 0; t < n; ++t) {
        out[0] = std::min(out[0], parts[3 * t]);
        out[1] = std::max(out[1], parts[3 * t + 1]);
        out[2] = std::max(out[2], parts[3 * t + 2]);
    }
}

void geglu_rows(uint16_t* v, const uint16_t* g, const uint16_t* bv, const uint16_t* bg, int64_t r0, int64_t r1,
                int64_t cols, int64_t ldv, int64_t ldg, float* range) {
    const int64_t full = cols & ~15;
    const __mmask16 tail = lanes((int)(cols - full));
    Range seen;
    for (int64_t r = r0; r < r1; ++r) {
        uint16_t* vr = v + r * ldv;
        const uint16_t* gr = g + r * ldg;
        for (int64_t c = 0; c < full; c += 16) {
            __m512 a = load_bf16(vr + c), z = load_bf16(gr + c);
            if (bv) a = _mm512_add_ps(a, load_bf16(bv + c));
            if (bg) z = _mm512_add_ps(z, load_bf16(bg + c));
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(geglu_ps(a, z));
            _mm256_storeu_si256((__m256i*)(vr + c), out);
            if (range) seen.add(out, 0xFFFF);
        }
        if (tail) {
            __m512 a = load_bf16_masked(vr + full, tail), z = load_bf16_masked(gr + full, tail);
            if (bv) a = _mm512_add_ps(a, load_bf16_masked(bv + full, tail));
            if (bg) z = _mm512_add_ps(z, load_bf16_masked(bg + full, tail));
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(geglu_ps(a, z));
            _mm256_mask_storeu_epi16(vr + full, tail, out);
            if (range) seen.add(out, tail);
        }
    }
    if (range) seen.store(range);
}

}  // namespace

// v (rows, cols; row stride ldv) <- (v + bv) * gelu(g + bg), g (rows, cols; row stride ldg); bv, bg: (cols) or null.
// All bf16 as uint16. range (or null): the smallest and largest value written, and 1 if one is not finite, else 0
// (the int8 layer that reads the result then skips its own min/max pass). Returns 0, or 1 for an empty or malformed
// problem.
extern "C" int sdl_geglu_bf16(uint16_t* v, const uint16_t* g, const uint16_t* bv, const uint16_t* bg, int64_t rows,
                              int64_t cols, int64_t ldv, int64_t ldg, float* range, int threads) {
    if (rows < 1 || cols < 1 || ldv < cols || ldg < cols) return 1;
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, rows * cols / 65536 + 1));
    std::vector<float> parts(3 * threads);
    parallel(threads, [&](int t) {
        geglu_rows(v, g, bv, bg, rows * t / threads, rows * (t + 1) / threads, cols, ldv, ldg,
                   range ? parts.data() + 3 * t : nullptr);
    });
    if (range) merge_ranges(parts.data(), threads, range);
    return 0;
}

// --- int8 activations -------------------------------------------------------------------------------------------------
//
// The bf16-int8 precision quantizes the bf16 input of each int8 layer per call (asymmetric uint8 over the tensor's
// range, as sdlite.engine.quant.quantize_activation does in fp32). PyTorch needs a conversion to fp32, a min/max, a
// multiply, an add, a clamp and a cast: six passes over the layer's input. Here: one pass for the range, one for
// the codes.

namespace {

void minmax_range(const uint16_t* x, int64_t i0, int64_t i1, float* out) {
    Range seen;
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16) seen.add(_mm256_loadu_si256((const __m256i*)(x + i)), 0xFFFF);
    if (i < i1) {
        const __mmask16 m = lanes((int)(i1 - i));
        seen.add(_mm256_maskz_loadu_epi16(m, x + i), m);
    }
    seen.store(out);
}

void quantize_range(const uint16_t* x, uint8_t* q, int64_t i0, int64_t i1, float inv, float add, float top) {
    const __m512 vi = _mm512_set1_ps(inv), va = _mm512_set1_ps(add), vt = _mm512_set1_ps(top), z = _mm512_setzero_ps();
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16) {
        // (x * inv) + add, two roundings as PyTorch's separate multiply and add make, then clamp and truncate
        __m512 v = mul_add(widen(_mm256_loadu_si256((const __m256i*)(x + i))), vi, va);
        v = _mm512_min_ps(_mm512_max_ps(v, z), vt);
        _mm_storeu_si128((__m128i*)(q + i), _mm512_cvtusepi32_epi8(_mm512_cvttps_epu32(v)));
    }
    if (i < i1) {
        const __mmask16 m = lanes((int)(i1 - i));
        __m512 v = mul_add(widen(_mm256_maskz_loadu_epi16(m, x + i)), vi, va);
        v = _mm512_min_ps(_mm512_max_ps(v, z), vt);
        _mm_mask_storeu_epi8(q + i, m, _mm512_cvtusepi32_epi8(_mm512_cvttps_epu32(v)));
    }
}

// how many of `threads` split() uses for n values (at least 32768 each)
inline int split_threads(int64_t n, int threads) {
    return (int)std::max<int64_t>(1, std::min<int64_t>(threads, n / 32768 + 1));
}

// splits [0, n) into split_threads(n, threads) 64-aligned ranges and runs fn(t, begin, end) on each
template <class F>
void split(int64_t n, int threads, F fn) {
    threads = split_threads(n, threads);
    parallel(threads, [&](int t) {
        fn(t, t == 0 ? 0 : (n * t / threads) & ~63, t == threads - 1 ? n : (n * (t + 1) / threads) & ~63);
    });
}

}  // namespace

// The smallest and largest of n contiguous bf16 values into range[0], range[1]. Returns 0, 1 for n < 1, 3 when a
// value is infinite or NaN (range then undefined).
extern "C" int sdl_minmax_bf16(const uint16_t* x, int64_t n, float* range, int threads) {
    if (n < 1) return 1;
    const int used = split_threads(n, threads);
    std::vector<float> parts(3 * used);
    split(n, used, [&](int t, int64_t b, int64_t e) { minmax_range(x, b, e, parts.data() + 3 * t); });
    float merged[3];
    merge_ranges(parts.data(), used, merged);
    range[0] = merged[0], range[1] = merged[1];
    return merged[2] != 0.f ? 3 : 0;
}

// q[i] = uint8(clamp(x[i] * inv + add, 0, top)) (truncated, so add carries the zero point + 0.5 of round half up)
// for n contiguous bf16 values. Returns 0, or 1 for n < 1 or top outside 1..255.
extern "C" int sdl_quantize_u8_bf16(const uint16_t* x, uint8_t* q, int64_t n, float inv, float add, float top,
                                    int threads) {
    if (n < 1 || !(top >= 1.f && top <= 255.f)) return 1;
    split(n, threads, [&](int, int64_t b, int64_t e) { quantize_range(x, q, b, e, inv, add, top); });
    return 0;
}

// --- int8 activations, one scale per row ------------------------------------------------------------------------------
//
// A transformer's int8 layers (bf16-int8 on a DiT) scale each token apart: symmetric codes round(x / s) + zp with
// s = max|x| / half per row, kept in 1..2 zp - 1 so that oneDNN's one zero point serves every row, and the product's
// row then multiplied by s (sdl_scale_rows_bf16). The arithmetic is sdlite.engine.quant.quantize_rows' in fp32: the
// scale and its inverse by IEEE division, then a multiply and an add (two roundings), clamp, truncate.

namespace {

int quantize_rows(const uint16_t* x, uint8_t* q, float* scales, int64_t r0, int64_t r1, int64_t cols, float half,
                  float zp) {
    const int64_t full = cols & ~15;
    const __mmask16 tail = lanes((int)(cols - full));
    const __m512 z = _mm512_setzero_ps(), vt = _mm512_set1_ps(2.f * zp - 1.f);
    for (int64_t r = r0; r < r1; ++r) {
        const uint16_t* xr = x + r * cols;
        uint8_t* qr = q + r * cols;
        Range seen;
        for (int64_t c = 0; c < full; c += 16) seen.add(_mm256_loadu_si256((const __m256i*)(xr + c)), 0xFFFF);
        if (full < cols) seen.add(_mm256_maskz_loadu_epi16(tail, xr + full), tail);
        float range[3];
        seen.store(range);
        if (range[2] != 0.f) return 3;
        const float amax = std::max(-range[0], range[1]);
        const float scale = amax > 0.f ? amax / half : 1.f;
        scales[r] = scale;
        const __m512 vi = _mm512_set1_ps(1.f / scale), va = _mm512_set1_ps(zp + 0.5f);
        for (int64_t c = 0; c < full; c += 16) {
            __m512 v = mul_add(load_bf16(xr + c), vi, va);
            v = _mm512_min_ps(_mm512_max_ps(v, z), vt);
            _mm_storeu_si128((__m128i*)(qr + c), _mm512_cvtusepi32_epi8(_mm512_cvttps_epu32(v)));
        }
        if (full < cols) {
            __m512 v = mul_add(load_bf16_masked(xr + full, tail), vi, va);
            v = _mm512_min_ps(_mm512_max_ps(v, z), vt);
            _mm_mask_storeu_epi8(qr + full, tail, _mm512_cvtusepi32_epi8(_mm512_cvttps_epu32(v)));
        }
    }
    return 0;
}

void scale_rows(uint16_t* y, const float* scales, const float* bias, int64_t r0, int64_t r1, int64_t cols) {
    const int64_t full = cols & ~15;
    const __mmask16 tail = lanes((int)(cols - full));
    for (int64_t r = r0; r < r1; ++r) {
        uint16_t* yr = y + r * cols;
        const __m512 s = _mm512_set1_ps(scales[r]);
        for (int64_t c = 0; c < full; c += 16) {
            const __m512 v = bias ? mul_add(load_bf16(yr + c), s, _mm512_loadu_ps(bias + c))
                                  : _mm512_mul_ps(load_bf16(yr + c), s);
            _mm256_storeu_si256((__m256i*)(yr + c), (__m256i)_mm512_cvtneps_pbh(v));
        }
        if (full < cols) {
            const __m512 y16 = load_bf16_masked(yr + full, tail);
            const __m512 v = bias ? mul_add(y16, s, _mm512_maskz_loadu_ps(tail, bias + full)) : _mm512_mul_ps(y16, s);
            _mm256_mask_storeu_epi16(yr + full, tail, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

}  // namespace

// For each of `rows` rows of `cols` contiguous bf16 values: scales[r] = max|x| / half (1 for an all-zero row) and
// q = uint8(clamp(x / scales[r] + zp + 0.5, 0, 2 zp - 1)) (truncated). Returns 0; 1 for bad sizes or a zero point
// outside 1..128; 3 when a value is infinite or NaN.
extern "C" int sdl_quantize_rows_u8_bf16(const uint16_t* x, uint8_t* q, float* scales, int64_t rows, int64_t cols,
                                         float half, float zp, int threads) {
    if (rows < 1 || cols < 1 || !(zp >= 1.f && zp <= 128.f) || !(half >= 1.f && half < zp)) return 1;
    const int used = split_threads(rows * cols, threads);
    return sdl::parallel_parts(rows, used, [&](int64_t b, int64_t e) {
        return quantize_rows(x, q, scales, b, e, cols, half, zp);
    });
}

// y[r, c] = bf16(y[r, c] * scales[r] + bias[c]) in place (bias may be null: no add), rounded to nearest even, for
// `rows` rows of `cols` contiguous bf16 values. Returns 0, or 1 for bad sizes.
extern "C" int sdl_scale_rows_bf16(uint16_t* y, const float* scales, const float* bias, int64_t rows, int64_t cols,
                                   int threads) {
    if (rows < 1 || cols < 1) return 1;
    const int used = split_threads(rows * cols, threads);
    return sdl::parallel_parts(rows, used, [&](int64_t b, int64_t e) {
        scale_rows(y, scales, bias, b, e, cols);
        return 0;
    });
}

// --- the rotary embedding -----------------------------------------------------------------------------------------------
//
// Each channel pair (x0, x1) of a head's row turned by its angle: (x0 c - x1 s, x1 c + x0 s), from cos and sin tables
// that repeat each pair's value twice (FLUX.1's layout; a complex table's real and imaginary parts repeated so). The
// arithmetic is sdlite.models.layers.rotate_pairs' in fp32, x * cos + (-x1, x0) * sin: two products and a sum, each rounded
// (no fused multiply-add), then rounded to bf16 once. One pass reads x and writes the output wherever its strides say
// (a slice of the joint [text, image] sequence: no cat afterwards), where PyTorch's version makes six passes and four
// temporaries (a 2-core Xeon with AMX: 39 ms a call at FLUX.1's (1, 1280, 24, 128), most of a step's elementwise time).

namespace {

inline __m512 rotate_pairs(__m512 x, __m512 c, __m512 s) {
    // (-x1, x0) of each pair: the pair's halves swapped, the first negated
    const __m512 swapped = _mm512_permute_ps(x, 0xB1);
    const __m512 turned = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(swapped),
                                                               _mm512_set1_epi64((long long)0x80000000u)));
    __m512 a = _mm512_mul_ps(x, c);
    __m512 b = _mm512_mul_ps(turned, s);
    asm("" : "+v"(a), "+v"(b));
    return _mm512_add_ps(a, b);
}

// A row of a tensor with three leading dimensions (n0, n1, n2) before its contiguous last one: row r's indices, and
// its offset (elements) under given strides.
struct Row3 {
    int64_t i0, i1, i2;
    Row3(int64_t r, int64_t n1, int64_t n2) : i0(r / (n1 * n2)), i1(r / n2 % n1), i2(r % n2) {}
    int64_t at(const int64_t* st) const { return i0 * st[0] + i1 * st[1] + i2 * st[2]; }
};

struct Rope {
    const uint16_t* x;
    const float *cos, *sin;
    uint16_t* out;
    int64_t S, H, D;
    // strides (elements): x and out over (batch, token, head), the tables over (batch, token, -: 0)
    int64_t xs[3], ts[3], os[3];
};

void rope_rows(const Rope& a, int64_t r0, int64_t r1) {
    const int64_t full = a.D & ~15;
    const __mmask16 tail = lanes((int)(a.D - full));
    for (int64_t r = r0; r < r1; ++r) {
        const Row3 idx(r, a.S, a.H);
        const uint16_t* xr = a.x + idx.at(a.xs);
        const float* cr = a.cos + idx.at(a.ts);
        const float* sr = a.sin + idx.at(a.ts);
        uint16_t* yr = a.out + idx.at(a.os);
        for (int64_t d = 0; d < full; d += 16) {
            const __m512 y = rotate_pairs(load_bf16(xr + d), _mm512_loadu_ps(cr + d), _mm512_loadu_ps(sr + d));
            _mm256_storeu_si256((__m256i*)(yr + d), (__m256i)_mm512_cvtneps_pbh(y));
        }
        if (full < a.D) {
            const __m512 y = rotate_pairs(load_bf16_masked(xr + full, tail), _mm512_maskz_loadu_ps(tail, cr + full),
                                          _mm512_maskz_loadu_ps(tail, sr + full));
            _mm256_mask_storeu_epi16(yr + full, tail, (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
}

}  // namespace

// out[b, s, h, :] = bf16(rotate(x[b, s, h, :])) for x and out (B, S, H, D) bf16 with the given strides (D contiguous,
// D even), cos and sin (B, S, D) fp32 with strides ts (ts[0] = 0: one table for the batch), D contiguous. out may be
// x itself (each 16 values are read before they are written). Returns 0, or 1 for bad sizes.
extern "C" int sdl_rope_bf16(const uint16_t* x, const float* cos, const float* sin, uint16_t* out, int64_t B,
                             int64_t S, int64_t H, int64_t D, const int64_t* xs, const int64_t* ts, const int64_t* os,
                             int threads) {
    if (B < 1 || S < 1 || H < 1 || D < 2 || D % 2 || D > 1024) return 1;
    Rope a{x, cos, sin, out, S, H, D, {xs[0], xs[1], xs[2]}, {ts[0], ts[1], 0}, {os[0], os[1], os[2]}};
    const int64_t rows = B * S * H;
    const int used = split_threads(rows * D, threads);
    return sdl::parallel_parts(rows, used, [&](int64_t b, int64_t e) {
        rope_rows(a, b, e);
        return 0;
    });
}

// --- the RMS norm's scaling ----------------------------------------------------------------------------------------------
//
// diffusers' RMSNorm in bf16 (sdlite.models.layers.RMSNorm) makes six passes: x in fp32, squared, the mean (its
// variance, which PyTorch's summation order fixes: computed by PyTorch still, to keep its bits), then x * rsqrt(variance
// + eps) in fp32, rounded to bf16, times the bf16 weight and rounded again. This is the last three in one pass, with the
// same roundings: y = bf16(float(bf16(float(x) * r)) * float(w)) for each row's r.

namespace {

struct RmsScale {
    const uint16_t* x;
    const float* r;
    const uint16_t* w;
    uint16_t* out;
    int64_t n1, n2, D;
    int64_t xs[3], rs[3], os[3];   // strides (elements) over the three leading dimensions
};

inline __m512 round_bf16(__m512 v) { return widen((__m256i)_mm512_cvtneps_pbh(v)); }

void rms_scale_rows(const RmsScale& a, int64_t r0, int64_t r1) {
    const int64_t full = a.D & ~15;
    const __mmask16 tail = lanes((int)(a.D - full));
    for (int64_t row = r0; row < r1; ++row) {
        const Row3 idx(row, a.n1, a.n2);
        const uint16_t* xr = a.x + idx.at(a.xs);
        uint16_t* yr = a.out + idx.at(a.os);
        const __m512 r = _mm512_set1_ps(a.r[idx.at(a.rs)]);
        for (int64_t d = 0; d < full; d += 16) {
            const __m512 y = _mm512_mul_ps(round_bf16(_mm512_mul_ps(load_bf16(xr + d), r)), load_bf16(a.w + d));
            _mm256_storeu_si256((__m256i*)(yr + d), (__m256i)_mm512_cvtneps_pbh(y));
        }
        if (full < a.D) {
            const __m512 y = _mm512_mul_ps(round_bf16(_mm512_mul_ps(load_bf16_masked(xr + full, tail), r)),
                                           load_bf16_masked(a.w + full, tail));
            _mm256_mask_storeu_epi16(yr + full, tail, (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
}

}  // namespace

// out = bf16(float(bf16(float(x) * r)) * float(w)) for x and out (n0, n1, n2, D) bf16 with the given strides (D
// contiguous), r (n0, n1, n2) fp32 (one per row, strides rs), w (D) bf16. Returns 0, or 1 for bad sizes.
extern "C" int sdl_rms_scale_bf16(const uint16_t* x, const float* r, const uint16_t* w, uint16_t* out, int64_t n0,
                                  int64_t n1, int64_t n2, int64_t D, const int64_t* xs, const int64_t* rs,
                                  const int64_t* os, int threads) {
    if (n0 < 1 || n1 < 1 || n2 < 1 || D < 1) return 1;
    RmsScale a{x, r, w, out, n1, n2, D, {xs[0], xs[1], xs[2]}, {rs[0], rs[1], rs[2]}, {os[0], os[1], os[2]}};
    const int64_t rows = n0 * n1 * n2;
    const int used = split_threads(rows * D, threads);
    return sdl::parallel_parts(rows, used, [&](int64_t b, int64_t e) {
        rms_scale_rows(a, b, e);
        return 0;
    });
}

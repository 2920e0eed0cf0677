// sdlite kernels: what the two bf16 attention kernels (avx512_bf16.cpp, amx_bf16.cpp) share: the problem, the
// softmax's exp2, the output's last pass and the entry point's checks. Needs AVX-512 (F, BW, DQ) and AVX512-BF16.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "parallel.h"

namespace sdl {

// out = softmax(q k^T * scale) v for each (batch, head): q (B, H, N, D), k and v (B, H, M, D), out (B, H, N, D), bf16
// as uint16, contiguous along D
struct AttentionProblem {
    const uint16_t *q, *k, *v;
    uint16_t* o;
    int B, H, N, M, D;
    int64_t qs[3], ks[3], vs[3], os[3];  // element strides of batch, head, token (the last dim is contiguous)
    float scale;
};

// 2^x for the softmax, whose probabilities are rounded to bf16 (relative step 2^-8) right after: 2^(x - floor x) by
// a degree-3 polynomial (relative error below 7.5e-5, a 50th of that step), times 2^floor(x) by scalef (which gives
// 0 for very negative x). Five instructions where a degree-5 exp2 with a separate range reduction takes nine.
inline __m512 exp2_softmax(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x), in [0, 1)
    __m512 p = _mm512_set1_ps(7.802446323500599e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2606731455057738e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958334433670675e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999252309395568e-1f));
    return _mm512_scalef_ps(p, x);
}

// the first `left` of 16 lanes (none for left <= 0, all for left >= 16)
inline __mmask16 lanes(int left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

// Rows [r0, r0 + rows) of (batch b, head h)'s output: o (rows x ostride fp32, unnormalised) over each row's
// lane-wise probability sums lsum, rounded once to bf16
inline void write_rows(const AttentionProblem& a, int b, int h, int r0, int rows, const float* o, int ostride,
                       const __m512* lsum) {
    uint16_t* base = a.o + b * a.os[0] + h * a.os[1];
    for (int r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(lsum[r]));
        uint16_t* dst = base + (r0 + r) * a.os[2];
        for (int d = 0; d < a.D; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_load_ps(o + (size_t)r * ostride + d), inv);
            const __m256i y = (__m256i)_mm512_cvtneps_pbh(x);
            _mm256_mask_storeu_epi16(dst + d, lanes(a.D - d), y);
        }
    }
}

// The entry points' common part: the problem from the C arguments (strides given in elements as {batch, head,
// token}), checked, and run(problem, begin, end) over the work items (batch, head, block of qb queries), split into
// one contiguous part per thread. Returns 0, 1 for a head dim outside 1..512 or an empty problem, else run's status.
template <class Run>
int attention_call(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int B, int H, int N, int M,
                   int D, const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* os, float scale,
                   int threads, int qb, Run run) {
    if (D < 1 || D > 512 || B < 1 || H < 1 || N < 1 || M < 1) return 1;
    const AttentionProblem a{q, k, v, out, B, H, N, M, D, {qs[0], qs[1], qs[2]}, {ks[0], ks[1], ks[2]},
                             {vs[0], vs[1], vs[2]}, {os[0], os[1], os[2]}, scale};
    return parallel_parts((int64_t)B * H * ((N + qb - 1) / qb), threads,
                          [&](int64_t begin, int64_t end) { return run(a, begin, end); });
}

}  // namespace sdl

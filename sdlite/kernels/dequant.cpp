// sdlite: ggml's block formats (and sdlite's own I8_ROW and I4_G<n>) decoded into float32 or bfloat16 in one pass,
// built and loaded by sdlite/kernels/build.py, called by sdlite/kernels/dequant.py.
//
// sdl_dequant: every block of a quantised tensor, in row-major order, written as floats (or rounded to bfloat16) into
// the output. The values are bit for bit those of the vectorised PyTorch decoders of sdlite/weights/quants.py (and so
// ggml's dequantize_row_* functions): each value is computed in float32 by the same operations in the same order
// (d * scale first, then times q, then the minimum's product subtracted), with no fused multiply-add (built with
// -ffp-contract=off), and rounded to bfloat16 to nearest-even as PyTorch rounds.
//
// Why: the PyTorch decoders run a dozen whole-tensor passes per chunk (shifts, masks, casts, products), each through
// memory; a GGUF transformer's step spent about as long decoding its weights as multiplying by them. Here a block's
// bytes are read once, its values made in a small buffer that stays in L1, and written once.
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "parallel.h"

namespace {

// the kinds the caller names (the GGUF type numbers; sdlite's own types above them)
enum Kind : int {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    I8_ROW = 1000,  // a block is a row: an fp32 scale, then the row's int8 values
    I4_G = 1001,    // a block is a group of n values: fp16 d, fp16 m, n/2 bytes of nibbles
};

constexpr int CHUNK = 256;  // values made at a time (a K block; I8_ROW rows and I4_G groups in pieces of this)

// an fp16 number's exact float value, without F16C (one or two per block: not worth an ISA requirement)
inline float half(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f;  // man * 2^-24, exact
        memcpy(&u, &f, 4);
        u |= sign;
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline float f32(const uint8_t* p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

// Q4_K / Q5_K: scale and minimum j (0..7) from their 12 packed bytes
inline void k_scale_min(const uint8_t* s, int j, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(s[j] & 0x3F);
        *m = (float)(s[j + 4] & 0x3F);
    } else {
        *sc = (float)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Q3_K: scale s (0..15) from its 12 packed bytes, minus 32
inline float q3_scale(const uint8_t* s, int i) {
    int low = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4);
    int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (float)(low | (high << 4)) - 32.0f;
}

// --- one block's values (the layouts are sdlite/weights/quants.py's table) --------------------------------------

void q4_0(const uint8_t* b, float* y) {
    float d = half(b);
    const uint8_t* q = b + 2;
    for (int l = 0; l < 16; l++) {
        y[l] = ((float)(q[l] & 0x0F) - 8.0f) * d;
        y[l + 16] = ((float)(q[l] >> 4) - 8.0f) * d;
    }
}

void q4_1(const uint8_t* b, float* y) {
    float d = half(b), m = half(b + 2);
    const uint8_t* q = b + 4;
    for (int l = 0; l < 16; l++) {
        y[l] = (float)(q[l] & 0x0F) * d + m;
        y[l + 16] = (float)(q[l] >> 4) * d + m;
    }
}

// Q5_0 / Q5_1: value i's fifth bit is bit i of the 4 bytes at h
inline int fifth(const uint8_t* h, int i) { return ((h[i >> 3] >> (i & 7)) & 1) << 4; }

void q5_0(const uint8_t* b, float* y) {
    float d = half(b);
    const uint8_t *h = b + 2, *q = b + 6;
    for (int l = 0; l < 16; l++) {
        y[l] = ((float)((q[l] & 0x0F) | fifth(h, l)) - 16.0f) * d;
        y[l + 16] = ((float)((q[l] >> 4) | fifth(h, l + 16)) - 16.0f) * d;
    }
}

void q5_1(const uint8_t* b, float* y) {
    float d = half(b), m = half(b + 2);
    const uint8_t *h = b + 4, *q = b + 8;
    for (int l = 0; l < 16; l++) {
        y[l] = (float)((q[l] & 0x0F) | fifth(h, l)) * d + m;
        y[l + 16] = (float)((q[l] >> 4) | fifth(h, l + 16)) * d + m;
    }
}

void q8_0(const uint8_t* b, float* y) {
    float d = half(b);
    const int8_t* q = (const int8_t*)(b + 2);
    for (int l = 0; l < 32; l++) y[l] = (float)q[l] * d;
}

void q2_k(const uint8_t* b, float* y) {
    const uint8_t *sc = b, *qs = b + 16;
    float d = half(b + 80), dmin = half(b + 82);
    for (int g = 0; g < 16; g++) {  // 16 values per scale; value v = 128 h + 32 j + l takes bits 2j of byte 32 h + l
        float dl = d * (float)(sc[g] & 0x0F), ml = dmin * (float)(sc[g] >> 4);
        int h = g / 8, j = (g % 8) / 2, l0 = (g % 2) * 16;
        for (int l = l0; l < l0 + 16; l++) y[16 * g + l - l0] = dl * (float)((qs[32 * h + l] >> (2 * j)) & 3) - ml;
    }
}

void q3_k(const uint8_t* b, float* y) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    float d = half(b + 108);
    for (int g = 0; g < 16; g++) {  // value v = 128 h + 32 j + l: low bits 2j of byte 32 h + l, high bit 4h + j of byte l
        float dl = d * q3_scale(sc, g);
        int h = g / 8, j = (g % 8) / 2, l0 = (g % 2) * 16;
        for (int l = l0; l < l0 + 16; l++) {
            int low = (qs[32 * h + l] >> (2 * j)) & 3, high = (hm[l] >> (4 * h + j)) & 1;
            y[16 * g + l - l0] = dl * ((float)low - (high ? 0.0f : 4.0f));
        }
    }
}

void q4_k(const uint8_t* b, float* y) {
    float d = half(b), dmin = half(b + 2);
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int j = 0; j < 8; j++) {  // 32 values per scale: the low nibbles of 32 bytes, then their high ones
        float sc, m;
        k_scale_min(s, j, &sc, &m);
        float dl = d * sc, ml = dmin * m;
        const uint8_t* q = qs + 32 * (j / 2);
        int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) y[32 * j + l] = dl * (float)((q[l] >> shift) & 0x0F) - ml;
    }
}

void q5_k(const uint8_t* b, float* y) {
    float d = half(b), dmin = half(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {  // as Q4_K, the fifth bit of value 32 j + l being bit j of byte l
        float sc, m;
        k_scale_min(s, j, &sc, &m);
        float dl = d * sc, ml = dmin * m;
        const uint8_t* q = qs + 32 * (j / 2);
        int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++)
            y[32 * j + l] = dl * (float)(((q[l] >> shift) & 0x0F) | (((qh[l] >> j) & 1) << 4)) - ml;
    }
}

void q6_k(const uint8_t* b, float* y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = (const int8_t*)(b + 192);
    float d = half(b + 208);
    for (int g = 0; g < 16; g++) {  // value 128 h + 32 k + l: nibble k / 2 of byte 64 h + 32 (k % 2) + l, bits 2k of 32 h + l
        float dl = d * (float)sc[g];
        int h = g / 8, k = (g % 8) / 2, l0 = (g % 2) * 16;
        for (int l = l0; l < l0 + 16; l++) {
            int low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F, high = (qh[32 * h + l] >> (2 * k)) & 3;
            y[16 * g + l - l0] = dl * ((float)(low | (high << 4)) - 32.0f);
        }
    }
}

using BlockFn = void (*)(const uint8_t*, float*);

BlockFn block_fn(int kind) {
    switch (kind) {
        case Q4_0: return q4_0;
        case Q4_1: return q4_1;
        case Q5_0: return q5_0;
        case Q5_1: return q5_1;
        case Q8_0: return q8_0;
        case Q2_K: return q2_k;
        case Q3_K: return q3_k;
        case Q4_K: return q4_k;
        case Q5_K: return q5_k;
        case Q6_K: return q6_k;
        default: return nullptr;
    }
}

// --- writing values out ------------------------------------------------------------------------------------------

// float32 -> bfloat16, to nearest even (c10::BFloat16's rounding); a NaN stays a NaN
inline uint16_t bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : (uint16_t)r;
}

inline void put(const float* y, int n, void* out, int64_t at, bool to_bf16) {
    if (to_bf16) {
        uint16_t* o = (uint16_t*)out + at;
        for (int i = 0; i < n; i++) o[i] = bf16(y[i]);
    } else {
        memcpy((float*)out + at, y, sizeof(float) * n);
    }
}

// I8_ROW: row r's n values
void i8_row(const uint8_t* b, int64_t n, void* out, int64_t at, bool to_bf16) {
    float d = f32(b), y[CHUNK];
    const int8_t* q = (const int8_t*)(b + 4);
    for (int64_t s = 0; s < n; s += CHUNK) {
        int m = (int)std::min<int64_t>(CHUNK, n - s);
        for (int i = 0; i < m; i++) y[i] = (float)q[s + i] * d;
        put(y, m, out, at + s, to_bf16);
    }
}

// I4_G: a group of n values (n even, at most 2 CHUNK): byte i's low nibble is value i, its high one value i + n/2
void i4_group(const uint8_t* b, int n, void* out, int64_t at, bool to_bf16) {
    float d = half(b), m = half(b + 2), y[2 * CHUNK];
    const uint8_t* q = b + 4;
    int half_n = n / 2;
    for (int i = 0; i < half_n; i++) {
        y[i] = (float)(q[i] & 0x0F) * d + m;
        y[i + half_n] = (float)(q[i] >> 4) * d + m;
    }
    put(y, n, out, at, to_bf16);
}

}  // namespace

// Decodes `blocks` blocks of `kind` (block_size values in type_size bytes each, from `data`) into `out`: float32
// (out_bf16 = 0) or bfloat16 (1), block_size values per block, in order. Returns 0, or 1 for a kind, size or
// argument it does not take (nothing written).
extern "C" int sdl_dequant(const uint8_t* data, int kind, int64_t block_size, int64_t type_size, int64_t blocks,
                           void* out, int out_bf16, int threads) {
    if (blocks < 0 || block_size < 1 || !data || !out) return 1;
    bool to_bf16 = out_bf16 != 0;
    if (kind == I8_ROW) {
        if (type_size != block_size + 4) return 1;
        return sdl::parallel_parts(blocks, threads, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; r++) i8_row(data + r * type_size, block_size, out, r * block_size, to_bf16);
            return 0;
        });
    }
    if (kind == I4_G) {
        if (block_size % 2 || block_size > 2 * CHUNK || type_size != 4 + block_size / 2) return 1;
        return sdl::parallel_parts(blocks, threads, [&](int64_t begin, int64_t end) {
            for (int64_t g = begin; g < end; g++)
                i4_group(data + g * type_size, (int)block_size, out, g * block_size, to_bf16);
            return 0;
        });
    }
    BlockFn fn = block_fn(kind);
    static const int64_t sizes[][3] = {{Q4_0, 32, 18}, {Q4_1, 32, 20}, {Q5_0, 32, 22}, {Q5_1, 32, 24}, {Q8_0, 32, 34},
                                       {Q2_K, 256, 84}, {Q3_K, 256, 110}, {Q4_K, 256, 144}, {Q5_K, 256, 176},
                                       {Q6_K, 256, 210}};
    bool known = false;
    for (const auto& s : sizes) known |= s[0] == kind && s[1] == block_size && s[2] == type_size;
    if (!fn || !known) return 1;
    return sdl::parallel_parts(blocks, threads, [&](int64_t begin, int64_t end) {
        float y[CHUNK];
        for (int64_t i = begin; i < end; i++) {
            fn(data + i * type_size, y);
            put(y, (int)block_size, out, i * block_size, to_bf16);
        }
        return 0;
    });
}

// The GPU engine's kernels (src/engine/gpu): everything of a LoRA training step except the
// frozen and adapter matrix products, which go to cuBLAS.
//
// Conventions: row-major buffers; `T` is the compute dtype (f32, bf16 or f16) and every kernel
// exists once per dtype with the suffix `_f32`, `_bf16` or `_f16`; reductions and softmax run in
// f32; token-level attention structure comes as inclusive key ranges `lo[i] ..= hi[i]` per token
// (empty when lo > hi), which covers causal, packed and padded rows alike.
//
// The same file is compiled by nvcc to PTX (build.rs, feature `cuda`) and, with -DRTUNE_EMU, by
// a C++ compiler against emu.h for the CPU emulator the tests run (crates/gpu-emu).

#ifdef RTUNE_EMU
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#define EMU_REGISTER(name)
#endif

typedef __nv_bfloat16 bf16;
typedef __half f16;

#define INF_F __int_as_float(0x7f800000)
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

// ------------------------------------------------------------------------------------------------
// Dtype helpers.

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(f16 x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ f16 from_f<f16>(float x) { return __float2half_rn(x); }

// `x` rounded to T's precision (an intermediate that PyTorch would store in T).
template <typename T>
__device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

__device__ __forceinline__ uint32_t bits16(bf16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint32_t bits16(f16 x) { return __half_as_ushort(x); }

// Two values in one 32-bit word, the first in the low half (the fragment layout of mma).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    return bits16(from_f<T>(lo)) | (bits16(from_f<T>(hi)) << 16);
}

template <typename T>
__device__ __forceinline__ uint32_t ld32(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }

template <typename T>
__device__ __forceinline__ void st32(T* p, uint32_t v) { *reinterpret_cast<uint32_t*>(p) = v; }

template <typename T>
__device__ __forceinline__ void unpack2(uint32_t w, T* a, T* b);
template <>
__device__ __forceinline__ void unpack2<bf16>(uint32_t w, bf16* a, bf16* b) {
    *a = __ushort_as_bfloat16((unsigned short)(w & 0xffff));
    *b = __ushort_as_bfloat16((unsigned short)(w >> 16));
}
template <>
__device__ __forceinline__ void unpack2<f16>(uint32_t w, f16* a, f16* b) {
    *a = __ushort_as_half((unsigned short)(w & 0xffff));
    *b = __ushort_as_half((unsigned short)(w >> 16));
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (or max) over the block; blockDim.x is a multiple of 32. `red` is 33 floats of shared
// memory, free again when this returns.
template <bool MAX>
__device__ float block_reduce(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < warps ? red[lane] : (MAX ? -INF_F : 0.0f);
        t = MAX ? warp_max(t) : warp_sum(t);
        if (lane == 0) red[32] = t;
    }
    __syncthreads();
    float r = red[32];
    __syncthreads();
    return r;
}

// Grid-stride loop over `n` elements.
#define FOR_EACH(i, n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); i += (long long)gridDim.x * blockDim.x)

// One kernel per compute dtype: NAME_f32, NAME_bf16 and NAME_f16 calling NAME<T>(ARGS), with
// PARAMS written in terms of `T` (each lives in a namespace where T is that dtype; extern "C"
// keeps the symbol names plain).
#define KERNEL_ONE(NAME, SUF, TY, PARAMS, ARGS)                      \
    namespace NAME##_##SUF##_ns {                                    \
    typedef TY T;                                                    \
    extern "C" __global__ void NAME##_##SUF PARAMS { NAME<T> ARGS; } \
    EMU_REGISTER(NAME##_##SUF)                                       \
    }
#define KERNEL_T(NAME, PARAMS, ARGS)              \
    KERNEL_ONE(NAME, f32, float, PARAMS, ARGS)    \
    KERNEL_ONE(NAME, bf16, bf16, PARAMS, ARGS)    \
    KERNEL_ONE(NAME, f16, f16, PARAMS, ARGS)

// ------------------------------------------------------------------------------------------------
// Embedding, row gather/scatter, residual and bias adds, casts.

// out = T(table[ids] · scale): Gemma scales its embeddings by √hidden (already rounded to T); 1
// copies them.
template <typename T>
__device__ void embed(const uint32_t* ids, const T* table, T* out, int n, int h, float scale) {
    FOR_EACH(i, (long long)n * h) {
        long long r = i / h, c = i % h;
        out[i] = from_f<T>(to_f(table[(long long)ids[r] * h + c]) * scale);
    }
}
KERNEL_T(embed, (const uint32_t* ids, const T* table, T* out, int n, int h, float scale),
         (ids, table, out, n, h, scale))

// dst[r] = src[idx[r]]
template <typename T>
__device__ void gather_rows(const T* src, const uint32_t* idx, T* dst, int rows, int width) {
    FOR_EACH(i, (long long)rows * width) {
        long long r = i / width, c = i % width;
        dst[i] = src[(long long)idx[r] * width + c];
    }
}
KERNEL_T(gather_rows, (const T* src, const uint32_t* idx, T* dst, int rows, int width), (src, idx, dst, rows, width))

// dst[idx[r]] += src[r]; the indices are distinct.
template <typename T>
__device__ void scatter_add_rows(const T* src, const uint32_t* idx, T* dst, int rows, int width) {
    FOR_EACH(i, (long long)rows * width) {
        long long r = i / width, c = i % width;
        T* d = dst + (long long)idx[r] * width + c;
        *d = from_f<T>(to_f(*d) + to_f(src[i]));
    }
}
KERNEL_T(scatter_add_rows, (const T* src, const uint32_t* idx, T* dst, int rows, int width), (src, idx, dst, rows, width))

template <typename T>
__device__ void add(T* dst, const T* src, int n) {
    FOR_EACH(i, n) dst[i] = from_f<T>(to_f(dst[i]) + to_f(src[i]));
}
KERNEL_T(add, (T * dst, const T* src, int n), (dst, src, n))

// y[r, c] += bias[c]
template <typename T>
__device__ void add_bias(T* y, const T* bias, int rows, int width) {
    FOR_EACH(i, (long long)rows * width) y[i] = from_f<T>(to_f(y[i]) + to_f(bias[i % width]));
}
KERNEL_T(add_bias, (T * y, const T* bias, int rows, int width), (y, bias, rows, width))

// A weight kept in 4-bit NormalFloat (src/model/nf4.rs, bitsandbytes' layout): value i's code
// index in the nibbles of the packed bytes (high nibble first), its scale per block of 64; `code`
// is the 16 NF4 values (nf4::CODE, uploaded by the engine).
template <typename T>
__device__ void nf4_dequant(const uint32_t* packed, const float* absmax, const float* code, T* out, int n) {
    FOR_EACH(i, n) {
        uint32_t byte = (packed[i >> 3] >> (((i >> 1) & 3) * 8)) & 0xffu;
        uint32_t idx = (i & 1) ? (byte & 15u) : (byte >> 4);
        out[i] = from_f<T>(code[idx] * absmax[i / 64]);
    }
}
KERNEL_T(nf4_dequant, (const uint32_t* packed, const float* absmax, const float* code, T* out, int n),
         (packed, absmax, code, out, n))

// Double quantization's block scales: scale b = code[8-bit index b] · scales[b / 256] + offset,
// rounded after the product and after the sum as src/model/nf4.rs computes them.
extern "C" __global__ void nf4_scales(const uint32_t* codes, const float* scales, const float* code, float offset,
                                      float* out, int n) {
    FOR_EACH(b, n) {
        uint32_t idx = (codes[b >> 2] >> ((b & 3) * 8)) & 0xffu;
        out[b] = __fadd_rn(__fmul_rn(code[idx], scales[b / 256]), offset);
    }
}
EMU_REGISTER(nf4_scales)

template <typename T>
__device__ void cast_from_f32(const float* src, T* dst, int n) {
    FOR_EACH(i, n) dst[i] = from_f<T>(src[i]);
}
KERNEL_T(cast_from_f32, (const float* src, T* dst, int n), (src, dst, n))

// ------------------------------------------------------------------------------------------------
// RMSNorm as transformers computes it: y = w · T(x · inv), inv = 1/√(mean(x²) + eps) in f32; with
// `offset` Gemma's y = T(x · inv · (1 + w)), all in f32. One block per row.

template <typename T>
__device__ __forceinline__ float normed(float x, float iv, const T* w, int j, int offset) {
    return offset ? x * iv * (1.0f + to_f(w[j])) : rnd<T>(x * iv) * to_f(w[j]);
}

template <typename T>
__device__ void rmsnorm_fwd(const T* x, const T* w, T* y, float* inv, int h, float eps, int offset) {
    __shared__ float red[33];
    const long long row = blockIdx.x;
    const T* xr = x + row * h;
    T* yr = y + row * h;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float v = to_f(xr[j]);
        ss += v * v;
    }
    ss = block_reduce<false>(ss, red);
    const float iv = 1.0f / sqrtf(ss / (float)h + eps);
    if (threadIdx.x == 0) inv[row] = iv;
    for (int j = threadIdx.x; j < h; j += blockDim.x) yr[j] = from_f<T>(normed(to_f(xr[j]), iv, w, j, offset));
}
KERNEL_T(rmsnorm_fwd, (const T* x, const T* w, T* y, float* inv, int h, float eps, int offset),
         (x, w, y, inv, h, eps, offset))

// The forward output again from the saved `inv` (the backward pass recomputes normed inputs).
template <typename T>
__device__ void rmsnorm_apply(const T* x, const float* inv, const T* w, T* y, int n, int h, int offset) {
    FOR_EACH(i, (long long)n * h) y[i] = from_f<T>(normed(to_f(x[i]), inv[i / h], w, (int)(i % h), offset));
}
KERNEL_T(rmsnorm_apply, (const T* x, const float* inv, const T* w, T* y, int n, int h, int offset),
         (x, inv, w, y, n, h, offset))

// dx [+]= inv·g − x·inv³·mean(g·x) with g = dy ⊙ w (g = dy ⊙ (1 + w) with `offset`). One block
// per row.
template <typename T>
__device__ void rmsnorm_bwd(const T* x, const float* inv, const T* w, const T* dy, T* dx, int h, int accumulate,
                            int offset) {
    const float one = offset ? 1.0f : 0.0f;
    __shared__ float red[33];
    const long long row = blockIdx.x;
    const T* xr = x + row * h;
    const T* dyr = dy + row * h;
    T* dxr = dx + row * h;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) dot += to_f(xr[j]) * to_f(dyr[j]) * (one + to_f(w[j]));
    dot = block_reduce<false>(dot, red) / (float)h;
    const float iv = inv[row], c = iv * iv * iv * dot;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float g = iv * (to_f(dyr[j]) * (one + to_f(w[j]))) - to_f(xr[j]) * c;
        dxr[j] = from_f<T>(accumulate ? to_f(dxr[j]) + g : g);
    }
}
KERNEL_T(rmsnorm_bwd,
         (const T* x, const float* inv, const T* w, const T* dy, T* dx, int h, int accumulate, int offset),
         (x, inv, w, dy, dx, h, accumulate, offset))

// ------------------------------------------------------------------------------------------------
// Rotary embeddings in place on [n, heads, d] rows: x·cos + rotate_half(x)·sin, or with
// `inverse` its transpose (the backward pass). cos/sin: [positions, d] f32 tables.

template <typename T>
__device__ void rope(T* x, const uint32_t* pos, const float* cos, const float* sin, int n, int heads, int d,
                     int inverse) {
    const int half = d / 2;
    FOR_EACH(i, (long long)n * heads * half) {
        long long row = i / ((long long)heads * half);
        int rem = (int)(i % ((long long)heads * half)), hh = rem / half, j = rem % half;
        T* xr = x + (row * heads + hh) * d;
        const long long p = pos[row];
        const float c1 = cos[p * d + j], c2 = cos[p * d + j + half];
        const float s1 = sin[p * d + j], s2 = sin[p * d + j + half];
        const float a = to_f(xr[j]), b = to_f(xr[j + half]);
        if (!inverse) {
            xr[j] = from_f<T>(a * c1 - b * s1);
            xr[j + half] = from_f<T>(b * c2 + a * s2);
        } else {
            xr[j] = from_f<T>(a * c1 + b * s2);
            xr[j + half] = from_f<T>(b * c2 - a * s1);
        }
    }
}
KERNEL_T(rope, (T * x, const uint32_t* pos, const float* cos, const float* sin, int n, int heads, int d, int inverse),
         (x, pos, cos, sin, n, heads, d, inverse))

// ------------------------------------------------------------------------------------------------
// Gated MLP product a = T(act(g)) · u, and its derivative: `gelu` 0 is SiLU (Llama, Qwen), 1 is
// GELU's tanh approximation (Gemma's gelu_pytorch_tanh).

__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

// act(z) and act'(z).
__device__ __forceinline__ void gate_act(float z, int gelu, float* a, float* da) {
    if (gelu) {
        const float k = 0.7978845608028654f, c = 0.044715f;
        const float t = tanhf(k * (z + c * z * z * z));
        *a = 0.5f * z * (1.0f + t);
        *da = 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * k * (1.0f + 3.0f * c * z * z);
    } else {
        const float sg = sigmoid(z);
        *a = z * sg;
        *da = sg * (1.0f + z * (1.0f - sg));
    }
}

template <typename T>
__device__ void swiglu(const T* g, const T* u, T* a, int n, int gelu) {
    FOR_EACH(i, n) {
        float act, dact;
        gate_act(to_f(g[i]), gelu, &act, &dact);
        a[i] = from_f<T>(rnd<T>(act) * to_f(u[i]));
    }
}
KERNEL_T(swiglu, (const T* g, const T* u, T* a, int n, int gelu), (g, u, a, n, gelu))

// dg and du may be g and u themselves.
template <typename T>
__device__ void swiglu_bwd(const T* g, const T* u, const T* da, T* dg, T* du, int n, int gelu) {
    FOR_EACH(i, n) {
        const float up = to_f(u[i]), d = to_f(da[i]);
        float act, dact;
        gate_act(to_f(g[i]), gelu, &act, &dact);
        du[i] = from_f<T>(d * act);
        dg[i] = from_f<T>(d * up * dact);
    }
}
KERNEL_T(swiglu_bwd, (const T* g, const T* u, const T* da, T* dg, T* du, int n, int gelu), (g, u, da, dg, du, n, gelu))

// ------------------------------------------------------------------------------------------------
// LoRA dropout from a counter-based generator: element i of the input of the linear layer with
// key `key` is dropped iff the top 24 bits of splitmix64(key + (i + 1)·φ) are below `threshold`
// (= round(p · 2²⁴)). src/model/lora.rs computes the same bits on the CPU.

__device__ __forceinline__ bool dropout_keep(uint64_t key, uint64_t i, uint32_t threshold) {
    uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)(z >> 40) >= threshold;
}

// y = x ⊙ mask over elements `offset .. offset + n` of the adapter's whole input.
template <typename T>
__device__ void dropout(const T* x, T* y, uint64_t key, uint64_t offset, uint32_t threshold, float scale, int n) {
    FOR_EACH(i, n) y[i] = dropout_keep(key, offset + i, threshold) ? from_f<T>(to_f(x[i]) * scale) : from_f<T>(0.0f);
}
KERNEL_T(dropout, (const T* x, T* y, uint64_t key, uint64_t offset, uint32_t threshold, float scale, int n),
         (x, y, key, offset, threshold, scale, n))

// dst += src ⊙ mask (the input gradient through the adapter's dropout).
template <typename T>
__device__ void dropout_acc(const T* src, T* dst, uint64_t key, uint64_t offset, uint32_t threshold, float scale,
                            int n) {
    FOR_EACH(i, n) {
        if (dropout_keep(key, offset + i, threshold))
            dst[i] = from_f<T>(to_f(dst[i]) + rnd<T>(to_f(src[i]) * scale));
    }
}
KERNEL_T(dropout_acc, (const T* src, T* dst, uint64_t key, uint64_t offset, uint32_t threshold, float scale, int n),
         (src, dst, key, offset, threshold, scale, n))

// ------------------------------------------------------------------------------------------------
// Cross-entropy of one row of logits per block: loss[r] = logsumexp(z) − z[target]; with a
// non-zero `grad_scale` the row becomes (softmax − onehot) · grad_scale.

// Gemma 2's tanh cap: `c · tanh(x / c)` (none where `c` is 0), and the factor its derivative
// puts on a gradient, from the capped value `y`: `1 − (y / c)²`.
__device__ __forceinline__ float capped(float x, float c) { return c > 0.0f ? c * tanhf(x / c) : x; }
__device__ __forceinline__ float capped_grad(float y, float c) {
    if (c <= 0.0f) return 1.0f;
    const float t = y / c;
    return 1.0f - t * t;
}

template <typename T>
__device__ void cross_entropy(T* logits, const uint32_t* targets, float* loss, int vocab, float grad_scale,
                              float cap) {
    __shared__ float red[33];
    const long long row = blockIdx.x;
    T* z = logits + row * vocab;
    const uint32_t tgt = targets[row];
    float m = -INF_F;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, capped(to_f(z[j]), cap));
    m = block_reduce<true>(m, red);
    float s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(capped(to_f(z[j]), cap) - m);
    s = block_reduce<false>(s, red);
    const float zt = capped(to_f(z[tgt]), cap);
    __syncthreads();  // every thread has read z[tgt] before it is overwritten
    if (threadIdx.x == 0) loss[row] = logf(s) - (zt - m);
    if (grad_scale != 0.0f) {
        const float c = grad_scale / s;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float x = to_f(z[j]), zc = capped(x, cap);
            float g = expf(zc - m) * c;
            if (j == (int)tgt) g -= grad_scale;
            z[j] = from_f<T>(g * capped_grad(zc, cap));
        }
    }
}
KERNEL_T(cross_entropy, (T * logits, const uint32_t* targets, float* loss, int vocab, float grad_scale, float cap),
         (logits, targets, loss, vocab, grad_scale, cap))

// ------------------------------------------------------------------------------------------------
// Gradients of trained base weights (full fine-tuning) that are not matrix products, into the
// f32 gradients. Each sums in a fixed order, without atomics, so a step is deterministic.

// partial[c, j] = Σ over rows r of chunk c (rows c·chunk ..) of dy[r, j] · T(x[r, j] · inv[r])
// with `norm` (an RMSNorm weight's gradient, y = w · T(x · inv)), else of dy[r, j] (a bias's).
// The chunks spread a [n, w] column sum over n / chunk times more threads than w.
template <typename T>
__device__ void col_grad(const T* dy, const T* x, const float* inv, float* partial, int n, int w, int chunk, int norm) {
    const int chunks = (n + chunk - 1) / chunk;
    FOR_EACH(i, (long long)chunks * w) {
        const int c = (int)(i / w), j = (int)(i % w);
        const int end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        float s = 0.0f;
        for (int r = c * chunk; r < end; r++) {
            const float g = to_f(dy[(long long)r * w + j]);
            s += norm ? g * rnd<T>(to_f(x[(long long)r * w + j]) * inv[r]) : g;
        }
        partial[i] = s;
    }
}
KERNEL_T(col_grad, (const T* dy, const T* x, const float* inv, float* partial, int n, int w, int chunk, int norm),
         (dy, x, inv, partial, n, w, chunk, norm))

// out[j] += Σ_c partial[c, j], the chunks in order.
extern "C" __global__ void col_sum(const float* partial, float* out, int chunks, int w) {
    FOR_EACH(j, w) {
        float s = 0.0f;
        for (int c = 0; c < chunks; c++) s += partial[(long long)c * w + j];
        out[j] += s;
    }
}
EMU_REGISTER(col_sum)

// grad[tokens[u], j] += scale · Σ_{k = starts[u] .. starts[u + 1]} dx[rows[k], j]: an embedding
// table's gradient (`scale` that of its forward), the rows of each distinct token (listed in order
// by the host) summed by one thread per element of its table row, so no two threads add to the
// same element.
template <typename T>
__device__ void embed_bwd(const T* dx, const uint32_t* rows, const uint32_t* starts, const uint32_t* tokens,
                          float* grad, int uniq, int h, float scale) {
    FOR_EACH(i, (long long)uniq * h) {
        const int u = (int)(i / h), j = (int)(i % h);
        float s = 0.0f;
        for (uint32_t k = starts[u]; k < starts[u + 1]; k++) s += to_f(dx[(long long)rows[k] * h + j]);
        grad[(long long)tokens[u] * h + j] += s * scale;
    }
}
KERNEL_T(embed_bwd,
         (const T* dx, const uint32_t* rows, const uint32_t* starts, const uint32_t* tokens, float* grad, int uniq,
          int h, float scale),
         (dx, rows, starts, tokens, grad, uniq, h, scale))

// ------------------------------------------------------------------------------------------------
// Optimizer and reductions over f32 buffers.

// out[0] += weight · Σ x (f64), e.g. a micro-batch's per-row losses into the step's loss.
extern "C" __global__ void sum_scaled(const float* x, int n, float weight, double* out) {
    __shared__ float red[33];
    float s = 0.0f;
    FOR_EACH(i, n) s += x[i];
    s = block_reduce<false>(s, red);
    if (threadIdx.x == 0) atomicAdd(out, (double)s * (double)weight);
}
EMU_REGISTER(sum_scaled)

// out[0] += Σ x² (f64).
extern "C" __global__ void sum_squares(const float* x, int n, double* out) {
    __shared__ float red[33];
    float s = 0.0f;
    FOR_EACH(i, n) s += x[i] * x[i];
    s = block_reduce<false>(s, red);
    if (threadIdx.x == 0) atomicAdd(out, (double)s);
}
EMU_REGISTER(sum_squares)

// One AdamW step in torch.optim.AdamW's operation order (src/train/optim.rs), on gradients
// scaled by `gscale` (clipping); rounded operations keep the compiler from fusing them.
extern "C" __global__ void adamw(float* w, const float* g, float* m, float* v, int n, float decay,
                                 float one_minus_b1, float b2, float one_minus_b2, float step_size, float bc2_sqrt,
                                 float eps, float gscale) {
    FOR_EACH(i, n) {
        const float gi = gscale == 1.0f ? g[i] : __fmul_rn(g[i], gscale);
        const float wi = __fmul_rn(w[i], decay);
        const float mi = __fadd_rn(m[i], __fmul_rn(__fadd_rn(gi, -m[i]), one_minus_b1));
        const float vi = __fadd_rn(__fmul_rn(v[i], b2), __fmul_rn(__fmul_rn(gi, gi), one_minus_b2));
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        w[i] = __fadd_rn(wi, __fmul_rn(__fdiv_rn(mi, denom), -step_size));
        m[i] = mi;
        v[i] = vi;
    }
}
EMU_REGISTER(adamw)

// e = e·decay + w·mix, mix = 1 − decay (rounded on the host from f64)
extern "C" __global__ void ema(float* e, const float* w, float decay, float mix, int n) {
    FOR_EACH(i, n) e[i] = __fadd_rn(__fmul_rn(e[i], decay), __fmul_rn(w[i], mix));
}
EMU_REGISTER(ema)

// ------------------------------------------------------------------------------------------------
// Attention. q: [b·t, hq·d], k and v: [b·t, hk·d] (rotary embeddings applied), o: like q,
// lse: [b, hq, t] (natural log; +inf for a row that sees no key), lo/hi: [b·t] key ranges.
// Probabilities are never stored: the backward pass recomputes them from q, k and lse.
//
// The scalar kernels (one warp per row, any d ≤ 256 and any dtype) are the reference and the
// fallback; the tensor-core kernels below take bf16/f16 with d = 64 or 128.

#define ATT_DMAX 256
#define ATT_ROWS 4   // rows (warps) per block in the scalar kernels
#define ATT_TILE 16  // keys or queries staged in shared memory at a time

// Block-wide [min lo, max hi] over this block's rows `r0 .. r0 + rows`.
__device__ void key_span(const int* lo, const int* hi, int r0, int rows, int t, int* out) {
    if (threadIdx.x == 0) {
        out[0] = INT_MAX;
        out[1] = -1;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        int i = r0 + r;
        if (i < t && lo[i] <= hi[i]) {
            atomicMin(&out[0], lo[i]);
            atomicMax(&out[1], hi[i]);
        }
    }
    __syncthreads();
}

template <typename T>
__device__ void attn_fwd(const T* q, const T* k, const T* v, T* o, float* lse, const int* lo, const int* hi, int t,
                         int hq, int hk, int d, float scale, float cap) {
    __shared__ float ks[ATT_TILE][ATT_DMAX];
    __shared__ float vs[ATT_TILE][ATT_DMAX];
    __shared__ int span[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bi = blockIdx.z, h = blockIdx.y, r0 = blockIdx.x * ATT_ROWS, qi = r0 + warp;
    const int g = h / (hq / hk);
    const long long qs = (long long)hq * d, kvs = (long long)hk * d, base = (long long)bi * t;
    const int* lob = lo + base;
    const int* hib = hi + base;
    key_span(lob, hib, r0, ATT_ROWS, t, span);
    const bool row = qi < t;
    const int mylo = row ? lob[qi] : 1, myhi = row ? hib[qi] : 0;
    float qv[ATT_DMAX / 32], acc[ATT_DMAX / 32];
    for (int c = 0; c < ATT_DMAX / 32; c++) {
        int j = lane + 32 * c;
        qv[c] = (row && j < d) ? to_f(q[(base + qi) * qs + (long long)h * d + j]) : 0.0f;
        acc[c] = 0.0f;
    }
    float m = -INF_F, l = 0.0f;
    for (int k0 = span[0]; k0 <= span[1]; k0 += ATT_TILE) {
        __syncthreads();
        for (int e = threadIdx.x; e < ATT_TILE * d; e += blockDim.x) {
            int kr = k0 + e / d, j = e % d;
            bool ok = kr < t;
            ks[e / d][j] = ok ? to_f(k[(base + kr) * kvs + (long long)g * d + j]) : 0.0f;
            vs[e / d][j] = ok ? to_f(v[(base + kr) * kvs + (long long)g * d + j]) : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < ATT_TILE; kk++) {
            const int key = k0 + kk;
            if (key < mylo || key > myhi) continue;  // uniform across the warp
            float s = 0.0f;
            for (int c = 0; c < ATT_DMAX / 32; c++) {
                int j = lane + 32 * c;
                if (j < d) s += qv[c] * ks[kk][j];
            }
            s = capped(warp_sum(s) * scale, cap);
            const float mn = fmaxf(m, s), corr = expf(m - mn), p = expf(s - mn);
            l = l * corr + p;
            for (int c = 0; c < ATT_DMAX / 32; c++) {
                int j = lane + 32 * c;
                if (j < d) acc[c] = acc[c] * corr + p * vs[kk][j];
            }
            m = mn;
        }
    }
    if (row) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int c = 0; c < ATT_DMAX / 32; c++) {
            int j = lane + 32 * c;
            if (j < d) o[(base + qi) * qs + (long long)h * d + j] = from_f<T>(acc[c] * inv);
        }
        if (lane == 0) lse[((long long)bi * hq + h) * t + qi] = l > 0.0f ? m + logf(l) : INF_F;
    }
}
KERNEL_T(attn_fwd,
         (const T* q, const T* k, const T* v, T* o, float* lse, const int* lo, const int* hi, int t, int hq, int hk,
          int d, float scale, float cap),
         (q, k, v, o, lse, lo, hi, t, hq, hk, d, scale, cap))

// delta[b, h, i] = Σ_j dO[i, j] · O[i, j], one warp per row; grid (⌈t/4⌉, hq, b).
template <typename T>
__device__ void attn_bwd_pre(const T* o, const T* dout, float* delta, int t, int hq, int d) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bi = blockIdx.z, h = blockIdx.y, qi = blockIdx.x * ATT_ROWS + warp;
    if (qi >= t) return;  // whole warps only: no barrier below
    const long long off = ((long long)bi * t + qi) * hq * d + (long long)h * d;
    float s = 0.0f;
    for (int j = lane; j < d; j += 32) s += to_f(o[off + j]) * to_f(dout[off + j]);
    s = warp_sum(s);
    if (lane == 0) delta[((long long)bi * hq + h) * t + qi] = s;
}
KERNEL_T(attn_bwd_pre, (const T* o, const T* dout, float* delta, int t, int hq, int d), (o, dout, delta, t, hq, d))

// dq = scale · Σ_k P ⊙ (dO·v − delta) · k (times the cap's derivative where scores are capped),
// one warp per query row; grid (⌈t/4⌉, hq, b).
template <typename T>
__device__ void attn_bwd_dq(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                            T* dq, const int* lo, const int* hi, int t, int hq, int hk, int d, float scale,
                            float cap) {
    __shared__ float ks[ATT_TILE][ATT_DMAX];
    __shared__ float vs[ATT_TILE][ATT_DMAX];
    __shared__ int span[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bi = blockIdx.z, h = blockIdx.y, r0 = blockIdx.x * ATT_ROWS, qi = r0 + warp;
    const int g = h / (hq / hk);
    const long long qs = (long long)hq * d, kvs = (long long)hk * d, base = (long long)bi * t;
    key_span(lo + base, hi + base, r0, ATT_ROWS, t, span);
    const bool row = qi < t;
    const int mylo = row ? lo[base + qi] : 1, myhi = row ? hi[base + qi] : 0;
    const float L = row ? lse[((long long)bi * hq + h) * t + qi] : 0.0f;
    const float D = row ? delta[((long long)bi * hq + h) * t + qi] : 0.0f;
    float qv[ATT_DMAX / 32], dov[ATT_DMAX / 32], acc[ATT_DMAX / 32];
    for (int c = 0; c < ATT_DMAX / 32; c++) {
        int j = lane + 32 * c;
        bool ok = row && j < d;
        qv[c] = ok ? to_f(q[(base + qi) * qs + (long long)h * d + j]) : 0.0f;
        dov[c] = ok ? to_f(dout[(base + qi) * qs + (long long)h * d + j]) : 0.0f;
        acc[c] = 0.0f;
    }
    for (int k0 = span[0]; k0 <= span[1]; k0 += ATT_TILE) {
        __syncthreads();
        for (int e = threadIdx.x; e < ATT_TILE * d; e += blockDim.x) {
            int kr = k0 + e / d, j = e % d;
            bool ok = kr < t;
            ks[e / d][j] = ok ? to_f(k[(base + kr) * kvs + (long long)g * d + j]) : 0.0f;
            vs[e / d][j] = ok ? to_f(v[(base + kr) * kvs + (long long)g * d + j]) : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < ATT_TILE; kk++) {
            const int key = k0 + kk;
            if (key < mylo || key > myhi) continue;
            float s = 0.0f, dp = 0.0f;
            for (int c = 0; c < ATT_DMAX / 32; c++) {
                int j = lane + 32 * c;
                if (j < d) {
                    s += qv[c] * ks[kk][j];
                    dp += dov[c] * vs[kk][j];
                }
            }
            s = capped(warp_sum(s) * scale, cap);
            dp = warp_sum(dp);
            const float p = expf(s - L), ds = p * (dp - D) * capped_grad(s, cap);
            for (int c = 0; c < ATT_DMAX / 32; c++) {
                int j = lane + 32 * c;
                if (j < d) acc[c] += ds * ks[kk][j];
            }
        }
    }
    if (row) {
        for (int c = 0; c < ATT_DMAX / 32; c++) {
            int j = lane + 32 * c;
            if (j < d) dq[(base + qi) * qs + (long long)h * d + j] = from_f<T>(acc[c] * scale);
        }
    }
}
KERNEL_T(attn_bwd_dq,
         (const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dq, const int* lo,
          const int* hi, int t, int hq, int hk, int d, float scale, float cap),
         (q, k, v, dout, lse, delta, dq, lo, hi, t, hq, hk, d, scale, cap))

// dk and dv of one kv head, summed over the query heads that share it, one warp per key row;
// grid (⌈t/4⌉, hk, b). A query i sees key j iff lo[i] ≤ j ≤ hi[i], and hi[i] ≤ i, so only
// queries from this block's first key on are visited.
template <typename T>
__device__ void attn_bwd_dkv(const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta,
                             T* dk, T* dv, const int* lo, const int* hi, int t, int hq, int hk, int d, float scale,
                             float cap) {
    __shared__ float qsh[ATT_TILE][ATT_DMAX];
    __shared__ float dosh[ATT_TILE][ATT_DMAX];
    __shared__ float lsh[ATT_TILE], dsh[ATT_TILE];
    __shared__ int losh[ATT_TILE], hish[ATT_TILE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bi = blockIdx.z, g = blockIdx.y, r0 = blockIdx.x * ATT_ROWS, kj = r0 + warp;
    const int rep = hq / hk;
    const long long qs = (long long)hq * d, kvs = (long long)hk * d, base = (long long)bi * t;
    const bool row = kj < t;
    float kv[ATT_DMAX / 32], vv[ATT_DMAX / 32], gk[ATT_DMAX / 32], gv[ATT_DMAX / 32];
    for (int c = 0; c < ATT_DMAX / 32; c++) {
        int j = lane + 32 * c;
        bool ok = row && j < d;
        kv[c] = ok ? to_f(k[(base + kj) * kvs + (long long)g * d + j]) : 0.0f;
        vv[c] = ok ? to_f(v[(base + kj) * kvs + (long long)g * d + j]) : 0.0f;
        gk[c] = 0.0f;
        gv[c] = 0.0f;
    }
    for (int hh = 0; hh < rep; hh++) {
        const int h = g * rep + hh;
        const float* lseh = lse + ((long long)bi * hq + h) * t;
        const float* delh = delta + ((long long)bi * hq + h) * t;
        for (int q0 = r0; q0 < t; q0 += ATT_TILE) {
            __syncthreads();
            for (int e = threadIdx.x; e < ATT_TILE * d; e += blockDim.x) {
                int qr = q0 + e / d, j = e % d;
                bool ok = qr < t;
                qsh[e / d][j] = ok ? to_f(q[(base + qr) * qs + (long long)h * d + j]) : 0.0f;
                dosh[e / d][j] = ok ? to_f(dout[(base + qr) * qs + (long long)h * d + j]) : 0.0f;
            }
            for (int e = threadIdx.x; e < ATT_TILE; e += blockDim.x) {
                int qr = q0 + e;
                bool ok = qr < t;
                lsh[e] = ok ? lseh[qr] : 0.0f;
                dsh[e] = ok ? delh[qr] : 0.0f;
                losh[e] = ok ? lo[base + qr] : 1;
                hish[e] = ok ? hi[base + qr] : 0;
            }
            __syncthreads();
            if (!row) continue;  // no barrier until the loop's next turn, which all warps reach
            for (int qq = 0; qq < ATT_TILE; qq++) {
                if (kj < losh[qq] || kj > hish[qq]) continue;
                float s = 0.0f, dp = 0.0f;
                for (int c = 0; c < ATT_DMAX / 32; c++) {
                    int j = lane + 32 * c;
                    if (j < d) {
                        s += qsh[qq][j] * kv[c];
                        dp += dosh[qq][j] * vv[c];
                    }
                }
                s = capped(warp_sum(s) * scale, cap);
                dp = warp_sum(dp);
                const float p = expf(s - lsh[qq]), ds = p * (dp - dsh[qq]) * capped_grad(s, cap);
                for (int c = 0; c < ATT_DMAX / 32; c++) {
                    int j = lane + 32 * c;
                    if (j < d) {
                        gv[c] += p * dosh[qq][j];
                        gk[c] += ds * qsh[qq][j];
                    }
                }
            }
        }
    }
    if (row) {
        for (int c = 0; c < ATT_DMAX / 32; c++) {
            int j = lane + 32 * c;
            if (j < d) {
                dk[(base + kj) * kvs + (long long)g * d + j] = from_f<T>(gk[c] * scale);
                dv[(base + kj) * kvs + (long long)g * d + j] = from_f<T>(gv[c]);
            }
        }
    }
}
KERNEL_T(attn_bwd_dkv,
         (const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dk, T* dv,
          const int* lo, const int* hi, int t, int hq, int hk, int d, float scale, float cap),
         (q, k, v, dout, lse, delta, dk, dv, lo, hi, t, hq, hk, d, scale, cap))

// ------------------------------------------------------------------------------------------------
// Tensor-core attention (FlashAttention-2's structure) for bf16/f16 and d ∈ {64, 128}.
//
// A block is 4 warps; each warp owns 16 rows, so a block covers 64 rows. Products use
// mma.sync.m16n8k16 (f32 accumulators). Fragment layout, with g = lane/4 and c = lane%4:
//   A (16×16, row-major): a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g, 2c+8..), a3 = (g+8, 2c+8..)
//   B (16×8, k × n):      b0 = (k 2c..2c+1, n g), b1 = (k 2c+8..2c+9, n g)
//   C (16×8):             c0, c1 = (g, 2c), (g, 2c+1); c2, c3 = (g+8, 2c), (g+8, 2c+1)
// so the accumulators of two neighbouring 8-column tiles, rounded to T, are the A fragment of
// the next product (P·V, dS·K, ...) without a trip through shared memory. Tiles are staged
// row-major in shared memory with cp.async; B fragments come from them with ldmatrix — plain
// for products with the tile's rows as n (Q·Kᵀ), transposed for products with them as k (P·V).

template <typename T>
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, const uint32_t* b);

// Four 8×8 matrices of 16-bit values from shared memory; `row` is this lane's row address
// (lanes 8m..8m+7 address the rows of matrix m).
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* row);

// A 16-byte copy from global to shared memory that completes at the next cp_async_wait (zeros
// when `valid` is false).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid);
__device__ __forceinline__ void cp_async_wait();

#ifdef RTUNE_EMU
template <>
__device__ __forceinline__ void mma16816<bf16>(float* d, const uint32_t* a, const uint32_t* b) {
    emu_mma16816<bf16>(d, a, b);
}
template <>
__device__ __forceinline__ void mma16816<f16>(float* d, const uint32_t* a, const uint32_t* b) {
    emu_mma16816<f16>(d, a, b);
}
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* row) {
    emu_ldmatrix_x4<TRANS>(r, row);
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    if (valid) std::memcpy(dst, src, 16);
    else std::memset(dst, 0, 16);
}
__device__ __forceinline__ void cp_async_wait() {}
#else
template <>
__device__ __forceinline__ void mma16816<bf16>(float* d, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16816<f16>(float* d, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void ldsm_x4<false>(uint32_t* r, const void* row) {
    unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
template <>
__device__ __forceinline__ void ldsm_x4<true>(uint32_t* r, const void* row) {
    unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::);
}
#endif

#define MMA_BM 64  // rows per block
#define MMA_PAD 8  // elements of padding per shared row: conflict-free ldmatrix rows

// A fragments of 16 rows × D columns starting at row `r` of a [rows, stride] matrix (rows ≥ t
// read as zeros).
template <typename T, int D>
__device__ __forceinline__ void load_a(uint32_t (*a)[4], const T* m, long long stride, int r, int t) {
    const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    const bool ok0 = r + g < t, ok1 = r + g + 8 < t;
    const T* p0 = m + (long long)(r + g) * stride + 2 * c;
    const T* p1 = m + (long long)(r + g + 8) * stride + 2 * c;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        a[kk][0] = ok0 ? ld32(p0 + 16 * kk) : 0u;
        a[kk][1] = ok1 ? ld32(p1 + 16 * kk) : 0u;
        a[kk][2] = ok0 ? ld32(p0 + 16 * kk + 8) : 0u;
        a[kk][3] = ok1 ? ld32(p1 + 16 * kk + 8) : 0u;
    }
}

// Stage `rows` rows × D of a [.., stride] matrix from row `r` into shared memory, row pitch
// D + pad (rows ≥ t are zeros). Every thread of the block takes part.
template <typename T, int D>
__device__ __forceinline__ void stage(T* sm, const T* m, long long stride, int r, int rows, int t) {
    constexpr int CHUNKS = D / 8;  // 16-byte pieces per row
    for (int e = threadIdx.x; e < rows * CHUNKS; e += blockDim.x) {
        const int i = e / CHUNKS, j = (e % CHUNKS) * 8;
        const bool ok = r + i < t;
        cp_async16(sm + i * (D + MMA_PAD) + j, m + (long long)(ok ? r + i : 0) * stride + j, ok);
    }
}

// s[N/8][4] = A (16 × D, fragments) · Bᵀ, B staged row-major [N][D + pad] in shared memory.
template <typename T, int D, int N>
__device__ __forceinline__ void mma_abt(float (*s)[4], const uint32_t (*a)[4], const T* b) {
    const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
#pragma unroll
    for (int j = 0; j < N / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
        // Matrices: (rows 8j.., cols 16kk..), (8j.., 16kk+8..), (8j+8.., 16kk..), (8j+8.., 16kk+8..).
        const T* row = b + (8 * j + 8 * (m >> 1) + r) * (D + MMA_PAD) + 8 * (m & 1);
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t bb[4];
            ldsm_x4<false>(bb, row + 16 * kk);
            mma16816<T>(s[j], a[kk], bb);
            mma16816<T>(s[j + 1], a[kk], bb + 2);
        }
    }
}

// acc[D/8][4] += P (16 × N, accumulator layout, rounded to T) · B, B staged row-major
// [N][D + pad] in shared memory (its rows are the products' k).
template <typename T, int D, int N>
__device__ __forceinline__ void mma_pb(float (*acc)[4], const float (*p)[4], const T* b) {
    const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        const uint32_t a[4] = {pack2<T>(p[2 * kk][0], p[2 * kk][1]), pack2<T>(p[2 * kk][2], p[2 * kk][3]),
                               pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                               pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        // Matrices: (k 16kk.., n 8jd..), (16kk+8.., 8jd..), (16kk.., 8jd+8..), (16kk+8.., 8jd+8..).
        const T* row = b + (16 * kk + 8 * (m & 1) + r) * (D + MMA_PAD) + 8 * (m >> 1);
#pragma unroll
        for (int jd = 0; jd < D / 8; jd += 2) {
            uint32_t bb[4];
            ldsm_x4<true>(bb, row + 8 * jd);
            mma16816<T>(acc[jd], a, bb);
            mma16816<T>(acc[jd + 1], a, bb + 2);
        }
    }
}

// Forward: O = softmax(QKᵀ·scale, masked) V and the log-sum-exp, one block per 64 query rows of
// one head; grid (⌈t/64⌉, hq, b), 128 threads. Online softmax in the log2 domain.
template <typename T, int D>
__device__ void attn_fwd_mma(const T* q, const T* k, const T* v, T* o, float* lse, const int* lo, const int* hi, int t,
                             int hq, int hk, float scale) {
    constexpr int BN = 64;
    __shared__ __align__(16) T ks[BN * (D + MMA_PAD)];
    __shared__ __align__(16) T vs[BN * (D + MMA_PAD)];
    __shared__ int span[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int bi = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * MMA_BM, kvh = h / (hq / hk);
    const long long qs = (long long)hq * D, kvs = (long long)hk * D, base = (long long)bi * t;
    const T* qb = q + base * qs + (long long)h * D;
    const T* kb = k + base * kvs + (long long)kvh * D;
    const T* vb = v + base * kvs + (long long)kvh * D;
    const int* lob = lo + base;
    const int* hib = hi + base;
    key_span(lob, hib, q0, MMA_BM, t, span);
    const int ra = q0 + warp * 16 + g, rb = ra + 8;
    const int loa = ra < t ? lob[ra] : 1, hia = ra < t ? hib[ra] : 0;
    const int lob_ = rb < t ? lob[rb] : 1, hib_ = rb < t ? hib[rb] : 0;
    uint32_t qa[D / 16][4];
    load_a<T, D>(qa, qb, qs, q0 + warp * 16, t);
    float acc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    float ma = -INF_F, mb = -INF_F, la = 0.0f, lb = 0.0f;
    const float sl2 = scale * LOG2E_F;
    const int first = span[1] < 0 ? 1 : (span[0] / BN) * BN;
    for (int k0 = first; k0 <= span[1]; k0 += BN) {
        __syncthreads();
        stage<T, D>(ks, kb, kvs, k0, BN, t);
        stage<T, D>(vs, vb, kvs, k0, BN, t);
        cp_async_wait();
        __syncthreads();
        float s[BN / 8][4];
        mma_abt<T, D, BN>(s, qa, ks);
        float mxa = -INF_F, mxb = -INF_F;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = k0 + 8 * j + 2 * c + e;
                s[j][e] = (col >= loa && col <= hia) ? s[j][e] * sl2 : -INF_F;
                s[j][2 + e] = (col >= lob_ && col <= hib_) ? s[j][2 + e] * sl2 : -INF_F;
                mxa = fmaxf(mxa, s[j][e]);
                mxb = fmaxf(mxb, s[j][2 + e]);
            }
        }
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
        const float na = fmaxf(ma, mxa), nb = fmaxf(mb, mxb);
        // With nothing visible yet the maximum is -inf: shift by 0 so that exp2 gives zeros.
        const float ba = na == -INF_F ? 0.0f : na, bbb = nb == -INF_F ? 0.0f : nb;
        const float ca = exp2f(ma - ba), cb = exp2f(mb - bbb);
        ma = na;
        mb = nb;
        float pa = 0.0f, pb = 0.0f;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            s[j][0] = exp2f(s[j][0] - ba);
            s[j][1] = exp2f(s[j][1] - ba);
            s[j][2] = exp2f(s[j][2] - bbb);
            s[j][3] = exp2f(s[j][3] - bbb);
            pa += s[j][0] + s[j][1];
            pb += s[j][2] + s[j][3];
        }
        la = la * ca + pa;
        lb = lb * cb + pb;
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            acc[j][0] *= ca;
            acc[j][1] *= ca;
            acc[j][2] *= cb;
            acc[j][3] *= cb;
        }
        mma_pb<T, D, BN>(acc, s, vs);
    }
    la += __shfl_xor_sync(0xffffffffu, la, 1);
    la += __shfl_xor_sync(0xffffffffu, la, 2);
    lb += __shfl_xor_sync(0xffffffffu, lb, 1);
    lb += __shfl_xor_sync(0xffffffffu, lb, 2);
    const float ia = la > 0.0f ? 1.0f / la : 0.0f, ib = lb > 0.0f ? 1.0f / lb : 0.0f;
    T* ob = o + base * qs + (long long)h * D;
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        if (ra < t) st32(ob + (long long)ra * qs + 8 * j + 2 * c, pack2<T>(acc[j][0] * ia, acc[j][1] * ia));
        if (rb < t) st32(ob + (long long)rb * qs + 8 * j + 2 * c, pack2<T>(acc[j][2] * ib, acc[j][3] * ib));
    }
    if (c == 0) {
        float* lh = lse + ((long long)bi * hq + h) * t;
        if (ra < t) lh[ra] = la > 0.0f ? ma * LN2_F + logf(la) : INF_F;
        if (rb < t) lh[rb] = lb > 0.0f ? mb * LN2_F + logf(lb) : INF_F;
    }
}

// dQ = scale · dS K with dS = P ⊙ (dO Vᵀ − delta), one block per 64 query rows of one head.
template <typename T, int D>
__device__ void attn_bwd_dq_mma(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                const float* delta, T* dq, const int* lo, const int* hi, int t, int hq, int hk,
                                float scale) {
    constexpr int BN = 64;
    __shared__ __align__(16) T ks[BN * (D + MMA_PAD)];
    __shared__ __align__(16) T vs[BN * (D + MMA_PAD)];
    __shared__ int span[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int bi = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * MMA_BM, kvh = h / (hq / hk);
    const long long qs = (long long)hq * D, kvs = (long long)hk * D, base = (long long)bi * t;
    const T* kb = k + base * kvs + (long long)kvh * D;
    const T* vb = v + base * kvs + (long long)kvh * D;
    const int* lob = lo + base;
    const int* hib = hi + base;
    key_span(lob, hib, q0, MMA_BM, t, span);
    const int ra = q0 + warp * 16 + g, rb = ra + 8;
    const int loa = ra < t ? lob[ra] : 1, hia = ra < t ? hib[ra] : 0;
    const int lob_ = rb < t ? lob[rb] : 1, hib_ = rb < t ? hib[rb] : 0;
    const float* lh = lse + ((long long)bi * hq + h) * t;
    const float* dh = delta + ((long long)bi * hq + h) * t;
    const float La = ra < t ? lh[ra] * LOG2E_F : 0.0f, Lb = rb < t ? lh[rb] * LOG2E_F : 0.0f;
    const float Da = ra < t ? dh[ra] : 0.0f, Db = rb < t ? dh[rb] : 0.0f;
    uint32_t qa[D / 16][4], da[D / 16][4];
    load_a<T, D>(qa, q + base * qs + (long long)h * D, qs, q0 + warp * 16, t);
    load_a<T, D>(da, dout + base * qs + (long long)h * D, qs, q0 + warp * 16, t);
    float acc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const float sl2 = scale * LOG2E_F;
    const int first = span[1] < 0 ? 1 : (span[0] / BN) * BN;
    for (int k0 = first; k0 <= span[1]; k0 += BN) {
        __syncthreads();
        stage<T, D>(ks, kb, kvs, k0, BN, t);
        stage<T, D>(vs, vb, kvs, k0, BN, t);
        cp_async_wait();
        __syncthreads();
        float s[BN / 8][4], dp[BN / 8][4];
        mma_abt<T, D, BN>(s, qa, ks);
        mma_abt<T, D, BN>(dp, da, vs);
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = k0 + 8 * j + 2 * c + e;
                const float pa = (col >= loa && col <= hia) ? exp2f(s[j][e] * sl2 - La) : 0.0f;
                const float pb = (col >= lob_ && col <= hib_) ? exp2f(s[j][2 + e] * sl2 - Lb) : 0.0f;
                s[j][e] = pa * (dp[j][e] - Da);
                s[j][2 + e] = pb * (dp[j][2 + e] - Db);
            }
        }
        mma_pb<T, D, BN>(acc, s, ks);
    }
    T* qb = dq + base * qs + (long long)h * D;
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        if (ra < t) st32(qb + (long long)ra * qs + 8 * j + 2 * c, pack2<T>(acc[j][0] * scale, acc[j][1] * scale));
        if (rb < t) st32(qb + (long long)rb * qs + 8 * j + 2 * c, pack2<T>(acc[j][2] * scale, acc[j][3] * scale));
    }
}

// One query head's share of dK = scale · Σ dSᵀ Q and dV = Σ Pᵀ dO, one block per 64 key rows;
// the products are formed transposed (rows = keys), so Sᵀ = K Qᵀ. Written as f32 partials
// [b·t, hq, D] (`part_k`, `part_v`); attn_reduce_heads sums the query heads of each kv head.
template <typename T, int D>
__device__ void attn_bwd_dkv_mma(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                 const float* delta, float* part_k, float* part_v, const int* lo, const int* hi, int t,
                                 int hq, int hk, float scale) {
    constexpr int BN = D == 128 ? 32 : 64;
    __shared__ __align__(16) T qsm[BN * (D + MMA_PAD)];
    __shared__ __align__(16) T dsm[BN * (D + MMA_PAD)];
    __shared__ float lsh[BN], dlt[BN];
    __shared__ int losh[BN], hish[BN];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int bi = blockIdx.z, h = blockIdx.y, k0 = blockIdx.x * MMA_BM, kvh = h / (hq / hk);
    const long long qs = (long long)hq * D, kvs = (long long)hk * D, base = (long long)bi * t;
    const int ra = k0 + warp * 16 + g, rb = ra + 8;  // this thread's key rows
    uint32_t ka[D / 16][4], va[D / 16][4];
    load_a<T, D>(ka, k + base * kvs + (long long)kvh * D, kvs, k0 + warp * 16, t);
    load_a<T, D>(va, v + base * kvs + (long long)kvh * D, kvs, k0 + warp * 16, t);
    float gk[D / 8][4], gv[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        gk[j][0] = gk[j][1] = gk[j][2] = gk[j][3] = 0.0f;
        gv[j][0] = gv[j][1] = gv[j][2] = gv[j][3] = 0.0f;
    }
    const float sl2 = scale * LOG2E_F;
    const T* qb = q + base * qs + (long long)h * D;
    const T* db = dout + base * qs + (long long)h * D;
    const float* lh = lse + ((long long)bi * hq + h) * t;
    const float* dh = delta + ((long long)bi * hq + h) * t;
    // A query i sees key j only if j ≤ hi[i] ≤ i: queries before this block's keys see none.
    for (int q0 = (k0 / BN) * BN; q0 < t; q0 += BN) {
        __syncthreads();
        stage<T, D>(qsm, qb, qs, q0, BN, t);
        stage<T, D>(dsm, db, qs, q0, BN, t);
        for (int e = threadIdx.x; e < BN; e += blockDim.x) {
            const int qr = q0 + e;
            const bool ok = qr < t;
            lsh[e] = ok ? lh[qr] * LOG2E_F : 0.0f;
            dlt[e] = ok ? dh[qr] : 0.0f;
            losh[e] = ok ? lo[base + qr] : 1;
            hish[e] = ok ? hi[base + qr] : 0;
        }
        cp_async_wait();
        __syncthreads();
        float s[BN / 8][4], dp[BN / 8][4];
        mma_abt<T, D, BN>(s, ka, qsm);  // Sᵀ: rows are keys, columns queries
        mma_abt<T, D, BN>(dp, va, dsm);  // dPᵀ = V dOᵀ
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = 8 * j + 2 * c + e;  // query within the tile
                const int l_ = losh[col], h_ = hish[col];
                const float pa = (ra >= l_ && ra <= h_) ? exp2f(s[j][e] * sl2 - lsh[col]) : 0.0f;
                const float pb = (rb >= l_ && rb <= h_) ? exp2f(s[j][2 + e] * sl2 - lsh[col]) : 0.0f;
                s[j][e] = pa;
                s[j][2 + e] = pb;
                dp[j][e] = pa * (dp[j][e] - dlt[col]);
                dp[j][2 + e] = pb * (dp[j][2 + e] - dlt[col]);
            }
        }
        mma_pb<T, D, BN>(gv, s, dsm);   // dV += Pᵀ dO
        mma_pb<T, D, BN>(gk, dp, qsm);  // dK += dSᵀ Q
    }
    float* kout = part_k + base * qs + (long long)h * D;
    float* vout = part_v + base * qs + (long long)h * D;
#pragma unroll
    for (int j = 0; j < D / 8; j++) {
        const int col = 8 * j + 2 * c;
        if (ra < t) {
            kout[(long long)ra * qs + col] = gk[j][0] * scale;
            kout[(long long)ra * qs + col + 1] = gk[j][1] * scale;
            vout[(long long)ra * qs + col] = gv[j][0];
            vout[(long long)ra * qs + col + 1] = gv[j][1];
        }
        if (rb < t) {
            kout[(long long)rb * qs + col] = gk[j][2] * scale;
            kout[(long long)rb * qs + col + 1] = gk[j][3] * scale;
            vout[(long long)rb * qs + col] = gv[j][2];
            vout[(long long)rb * qs + col + 1] = gv[j][3];
        }
    }
}

// dk[i, g, :] = Σ over the query heads h of kv head g of part_k[i, h, :] (and dv likewise), in
// head order: deterministic, unlike atomics.
template <typename T>
__device__ void attn_reduce_heads(const float* part_k, const float* part_v, T* dk, T* dv, int n, int hq, int hk,
                                  int d) {
    const int rep = hq / hk;
    FOR_EACH(i, (long long)n * hk * d) {
        const long long row = i / ((long long)hk * d);
        const int rem = (int)(i % ((long long)hk * d)), g = rem / d, j = rem % d;
        float sk = 0.0f, sv = 0.0f;
        for (int r = 0; r < rep; r++) {
            const long long at = (row * hq + g * rep + r) * d + j;
            sk += part_k[at];
            sv += part_v[at];
        }
        dk[i] = from_f<T>(sk);
        dv[i] = from_f<T>(sv);
    }
}
KERNEL_T(attn_reduce_heads, (const float* part_k, const float* part_v, T* dk, T* dv, int n, int hq, int hk, int d),
         (part_k, part_v, dk, dv, n, hq, hk, d))

// ------------------------------------------------------------------------------------------------
// Attention through matrix products (ops.rs, `attn_*_products`): a chunk of `rows` query rows
// r0 .. r0 + rows sees keys 0 .. kn − 1 (kn = r0 + rows: no query sees a later key). For product
// z = b · hq + h of the batch, S (f32) and P (T) hold its rows × kn scores and probabilities,
// packed: element (z, r, j) at (z · rows + r) · kn + j.

// P from S = scale · Q Kᵀ (capped where `cap` is not 0), zero outside each row's keys lo ..= hi.
// Forward (`fwd` ≠ 0): the softmax of each row, and its log-sum-exp into lse (∞ for a row that
// sees no key); backward: exp(S − lse) with the forward pass's lse. Grid (rows, b · hq); one
// block per row.
template <typename T>
__device__ void attn_probs(const float* s, T* pr, float* lse, const int* lo, const int* hi, int t, int hq, int r0,
                           int rows, int kn, int fwd, float cap) {
    __shared__ float red[33];
    const int r = blockIdx.x, z = blockIdx.y, qi = r0 + r;
    const long long tok = (long long)(z / hq) * t + qi, row = ((long long)z * rows + r) * kn;
    const long long lrow = (long long)z * t + qi;
    const int l0 = lo[tok], h0 = hi[tok] < kn - 1 ? hi[tok] : kn - 1;
    float m, scale;
    if (fwd) {
        m = -INF_F;
        for (int j = l0 + threadIdx.x; j <= h0; j += blockDim.x) m = fmaxf(m, capped(s[row + j], cap));
        m = block_reduce<true>(m, red);
        float l = 0.0f;
        if (m != -INF_F)
            for (int j = l0 + threadIdx.x; j <= h0; j += blockDim.x) l += expf(capped(s[row + j], cap) - m);
        l = block_reduce<false>(l, red);
        if (threadIdx.x == 0) lse[lrow] = l > 0.0f ? m + logf(l) : INF_F;
        scale = l > 0.0f ? 1.0f / l : 0.0f;
    } else {
        m = lse[lrow];
        scale = m == INF_F ? 0.0f : 1.0f;
    }
    for (int j = threadIdx.x; j < kn; j += blockDim.x)
        pr[row + j] = from_f<T>(j >= l0 && j <= h0 ? expf(capped(s[row + j], cap) - m) * scale : 0.0f);
}
KERNEL_T(attn_probs,
         (const float* s, T* pr, float* lse, const int* lo, const int* hi, int t, int hq, int r0, int rows, int kn,
          int fwd, float cap),
         (s, pr, lse, lo, hi, t, hq, r0, rows, kn, fwd, cap))

// dS = P ⊙ (dP − delta) in place of P (dP = dO Vᵀ in f32, delta = Σ dO ⊙ O of each row), times
// the cap's derivative at the scores S (f32, uncapped; read only where `cap` is not 0); the scale
// of S goes into the products that take dS.
template <typename T>
__device__ void attn_dscores(T* pr, const float* dp, const float* delta, const float* s, int t, int r0, int rows,
                             int kn, int n, float cap) {
    FOR_EACH(i, n) {
        const long long zr = i / kn, z = zr / rows, r = zr % rows;
        const float g = cap > 0.0f ? capped_grad(capped(s[i], cap), cap) : 1.0f;
        pr[i] = from_f<T>(to_f(pr[i]) * (dp[i] - delta[z * t + r0 + r]) * g);
    }
}
KERNEL_T(attn_dscores,
         (T * pr, const float* dp, const float* delta, const float* s, int t, int r0, int rows, int kn, int n,
          float cap),
         (pr, dp, delta, s, t, r0, rows, kn, n, cap))

#define MMA_KERNELS(T, SUF, D)                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_mma_##SUF##_##D(                                      \
        const T* q, const T* k, const T* v, T* o, float* lse, const int* lo, const int* hi, int t, int hq, int hk,   \
        float scale) {                                                                                               \
        attn_fwd_mma<T, D>(q, k, v, o, lse, lo, hi, t, hq, hk, scale);                                               \
    }                                                                                                                \
    EMU_REGISTER(attn_fwd_mma_##SUF##_##D)                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dq_mma_##SUF##_##D(                                   \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dq, const int* lo, \
        const int* hi, int t, int hq, int hk, float scale) {                                                         \
        attn_bwd_dq_mma<T, D>(q, k, v, dout, lse, delta, dq, lo, hi, t, hq, hk, scale);                              \
    }                                                                                                                \
    EMU_REGISTER(attn_bwd_dq_mma_##SUF##_##D)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dkv_mma_##SUF##_##D(                                  \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, float* part_k,      \
        float* part_v, const int* lo, const int* hi, int t, int hq, int hk, float scale) {                           \
        attn_bwd_dkv_mma<T, D>(q, k, v, dout, lse, delta, part_k, part_v, lo, hi, t, hq, hk, scale);                 \
    }                                                                                                                \
    EMU_REGISTER(attn_bwd_dkv_mma_##SUF##_##D)

MMA_KERNELS(bf16, bf16, 64)
MMA_KERNELS(bf16, bf16, 128)
MMA_KERNELS(f16, f16, 64)
MMA_KERNELS(f16, f16, 128)

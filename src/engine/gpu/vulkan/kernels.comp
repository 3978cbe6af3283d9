#version 460
// The GPU engine's kernels for Vulkan: the kernels of ../kernels.cu that a LoRA step needs,
// written once in GLSL and compiled to SPIR-V ahead of time (scripts/toolchain/build-spirv.sh), one
// module per kernel and compute dtype: `-DK_<kernel>` picks the kernel, `-DT_F32`, `-DT_BF16` or
// `-DT_F16` the dtype (the `_f32`/`_bf16`/`_f16` suffix of its name, as in kernels.cu).
//
// The argument list of every kernel is a push-constant block in the order src/engine/gpu/ops.rs
// passes it; pointers are buffer device addresses (GL_EXT_buffer_reference), so the engine's
// raw-pointer model carries over unchanged. The workgroup size is specialisation constant 0 (the
// launch's block size); constant 1, where a kernel has one, is the `_<n>` suffix of the name it
// is launched under (gemm_sg's column groups, the `_sg` attention kernels' head size in vec4s).
// The `_sg` kernels at the end are the forms for CPU implementations of Vulkan (lavapipe).
//
// Differences from kernels.cu, all numerically equivalent up to summation order:
// - reductions go through shared memory (subgroup sizes vary between 4 and 128 across vendors,
//   so nothing assumes a 32-lane warp);
// - attention processes a tile of keys per workgroup in three phases (scores, online softmax
//   per row, weighted sums), so every barrier is in uniform control flow;
// - sum_scaled and sum_squares reduce in one workgroup (no 64-bit float atomics in Vulkan core),
//   in float-float pairs, adding to the f64 accumulator with integer arithmetic: no kernel
//   needs shaderFloat64;
// - the attention kernels on the matrix units (`attn_*_mma`, cooperative matrices) walk the keys
//   twice in the forward pass instead of rescaling their accumulators per row (see there).

#extension GL_EXT_buffer_reference : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#if defined(T_BF16) || defined(T_F16) || defined(K_zero16)
#extension GL_EXT_shader_16bit_storage : require
#endif
#if defined(T_F16)
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#endif
#if defined(K_gemm_sg) || defined(K_attn_fwd_sg) || defined(K_attn_bwd_dq_sg) || defined(K_attn_bwd_dkv_sg)
#extension GL_KHR_shader_subgroup_ballot : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_vote : require
#endif

layout(local_size_x_id = 0) in;

layout(buffer_reference, std430, buffer_reference_align = 4) buffer F32 { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer U32 { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer I32 { int v[]; };

// ------------------------------------------------------------------------------------------------
// The compute dtype T: `TB` is a pointer to T; ld/st convert to and from f32 (round to nearest
// even, as __float2bfloat16_rn and __float2half_rn do).

#if defined(T_F32)
#define TB F32
#define TSIZE 4
float ld(TB b, int i) { return b.v[i]; }
void st(TB b, int i, float x) { b.v[i] = x; }
float rnd(float x) { return x; }
#elif defined(T_BF16)
layout(buffer_reference, std430, buffer_reference_align = 2) buffer TB { uint16_t v[]; };
#define TSIZE 2
uint bf16_bits(float x) {
    uint u = floatBitsToUint(x);
    if (isnan(x)) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
float ld(TB b, int i) { return uintBitsToFloat(uint(b.v[i]) << 16); }
void st(TB b, int i, float x) { b.v[i] = uint16_t(bf16_bits(x)); }
float rnd(float x) { return uintBitsToFloat(bf16_bits(x) << 16); }
#elif defined(T_F16)
layout(buffer_reference, std430, buffer_reference_align = 2) buffer TB { float16_t v[]; };
#define TSIZE 2
float ld(TB b, int i) { return float(b.v[i]); }
void st(TB b, int i, float x) { b.v[i] = float16_t(x); }
float rnd(float x) { return float(float16_t(x)); }
#endif

const float INF = 1.0 / 0.0;

// Gemma 2's tanh cap: `c · tanh(x / c)` (none where `c` is 0), and the factor its derivative puts
// on a gradient, from the capped value `y`: `1 − (y / c)²`.
float capped(float x, float c) { return c > 0.0 ? c * tanh(x / c) : x; }
float capped_grad(float y, float c) { return c > 0.0 ? 1.0 - (y / c) * (y / c) : 1.0; }

#define TID int(gl_LocalInvocationID.x)
#define BLOCK int(gl_WorkGroupSize.x)
// Grid-stride loop over `n` elements.
#define FOR_EACH(i, n) for (int i = int(gl_GlobalInvocationID.x); i < (n); i += int(gl_NumWorkGroups.x * gl_WorkGroupSize.x))

#if defined(NEEDS_REDUCE) || defined(K_rmsnorm_fwd) || defined(K_rmsnorm_bwd) || defined(K_cross_entropy) || defined(K_attn_probs)
// Sum or max over the workgroup (a power of two of at most 1024 invocations); every invocation
// must call it (uniform control flow).
shared float red[1024];
float block_reduce(float v, bool is_max) {
    red[TID] = v;
    memoryBarrierShared();
    barrier();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (TID < s) red[TID] = is_max ? max(red[TID], red[TID + s]) : red[TID] + red[TID + s];
        memoryBarrierShared();
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}
#endif

// ------------------------------------------------------------------------------------------------
// Embedding, row gather/scatter, residual and bias adds, casts.

// dst = T(table[ids] · scale) (Gemma's √hidden, already rounded to T; 1 copies).
#ifdef K_embed
layout(push_constant) uniform P { U32 ids; TB table; TB dst; int n; int h; float scale; } p;
void main() {
    FOR_EACH(i, p.n * p.h) {
        int r = i / p.h, c = i % p.h;
        st(p.dst, i, ld(p.table, int(p.ids.v[r]) * p.h + c) * p.scale);
    }
}
#endif

#ifdef K_gather_rows
layout(push_constant) uniform P { TB src; U32 idx; TB dst; int rows; int width; } p;
void main() {
    FOR_EACH(i, p.rows * p.width) {
        int r = i / p.width, c = i % p.width;
        st(p.dst, i, ld(p.src, int(p.idx.v[r]) * p.width + c));
    }
}
#endif

#ifdef K_scatter_add_rows
layout(push_constant) uniform P { TB src; U32 idx; TB dst; int rows; int width; } p;
void main() {
    FOR_EACH(i, p.rows * p.width) {
        int r = i / p.width, c = i % p.width;
        int d = int(p.idx.v[r]) * p.width + c;
        st(p.dst, d, ld(p.dst, d) + ld(p.src, i));
    }
}
#endif

#ifdef K_add
layout(push_constant) uniform P { TB dst; TB src; int n; } p;
void main() {
    FOR_EACH(i, p.n) st(p.dst, i, ld(p.dst, i) + ld(p.src, i));
}
#endif

#ifdef K_add_bias
layout(push_constant) uniform P { TB y; TB bias; int rows; int width; } p;
void main() {
    FOR_EACH(i, p.rows * p.width) st(p.y, i, ld(p.y, i) + ld(p.bias, i % p.width));
}
#endif

// A weight kept in 4-bit NormalFloat (src/model/nf4.rs, bitsandbytes' layout): value i's code
// index in the nibbles of the packed bytes (high nibble first), its scale per block of 64; `code`
// is the 16 NF4 values (nf4::CODE, uploaded by the engine).
#ifdef K_nf4_dequant
layout(push_constant) uniform P { U32 packed; F32 absmax; F32 code; TB out_; int n; } p;
void main() {
    FOR_EACH(i, p.n) {
        uint byte_ = (p.packed.v[i >> 3] >> (((i >> 1) & 3) * 8)) & 0xffu;
        uint idx = (i & 1) != 0 ? (byte_ & 15u) : (byte_ >> 4);
        st(p.out_, i, p.code.v[idx] * p.absmax.v[i / 64]);
    }
}
#endif

// Double quantization's block scales: scale b = code[8-bit index b] · scales[b / 256] + offset,
// rounded after the product and after the sum as src/model/nf4.rs computes them.
#ifdef K_nf4_scales
layout(push_constant) uniform P { U32 codes; F32 scales; F32 code; float offset; F32 out_; int n; } p;
void main() {
    FOR_EACH(b, p.n) {
        uint idx = (p.codes.v[b >> 2] >> ((b & 3) * 8)) & 0xffu;
        precise float s = p.code.v[idx] * p.scales.v[b / 256];
        p.out_.v[b] = s + p.offset;
    }
}
#endif

#ifdef K_cast_from_f32
layout(push_constant) uniform P { F32 src; TB dst; int n; } p;
void main() {
    FOR_EACH(i, p.n) st(p.dst, i, p.src.v[i]);
}
#endif

// The end of a product split over its inner dimension (gemm_cm with `k_split`): C (m × n, row
// pitch ldc, in T) = alpha · Σ_z parts[z] + beta · C, the parts (m × n, f32, packed) summed in
// order of z.
#ifdef K_split_sum
layout(push_constant) uniform P { F32 parts; TB c; int m; int n; int ldc; int splits; float alpha; float beta; } p;
void main() {
    FOR_EACH(i, p.m * p.n) {
        float s = 0.0;
        for (int z = 0; z < p.splits; z++) s += p.parts.v[z * p.m * p.n + i];
        int at = (i / p.n) * p.ldc + i % p.n;
        float out_ = p.alpha * s;
        if (p.beta != 0.0) out_ += p.beta * ld(p.c, at);
        st(p.c, at, out_);
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// RMSNorm as transformers computes it: y = w · T(x · inv), inv = 1/√(mean(x²) + eps) in f32; with
// `offset` Gemma's y = T(x · inv · (1 + w)), all in f32. One workgroup per row.

#if defined(K_rmsnorm_fwd) || defined(K_rmsnorm_apply)
float normed(float x, float iv, float w, int offset) { return offset != 0 ? x * iv * (1.0 + w) : rnd(x * iv) * w; }
#endif

#ifdef K_rmsnorm_fwd
layout(push_constant) uniform P { TB x; TB w; TB y; F32 inv; int h; float eps; int offset; } p;
void main() {
    int row = int(gl_WorkGroupID.x), base = row * p.h;
    float ss = 0.0;
    for (int j = TID; j < p.h; j += BLOCK) {
        float v = ld(p.x, base + j);
        ss += v * v;
    }
    ss = block_reduce(ss, false);
    float iv = 1.0 / sqrt(ss / float(p.h) + p.eps);
    if (TID == 0) p.inv.v[row] = iv;
    for (int j = TID; j < p.h; j += BLOCK) st(p.y, base + j, normed(ld(p.x, base + j), iv, ld(p.w, j), p.offset));
}
#endif

#ifdef K_rmsnorm_apply
layout(push_constant) uniform P { TB x; F32 inv; TB w; TB y; int n; int h; int offset; } p;
void main() {
    FOR_EACH(i, p.n * p.h) st(p.y, i, normed(ld(p.x, i), p.inv.v[i / p.h], ld(p.w, i % p.h), p.offset));
}
#endif

// dx [+]= inv·g − x·inv³·mean(g·x) with g = dy ⊙ w (g = dy ⊙ (1 + w) with `offset`). One
// workgroup per row.
#ifdef K_rmsnorm_bwd
layout(push_constant) uniform P { TB x; F32 inv; TB w; TB dy; TB dx; int h; int accumulate; int offset; } p;
void main() {
    int row = int(gl_WorkGroupID.x), base = row * p.h;
    float one = p.offset != 0 ? 1.0 : 0.0;
    float dot_ = 0.0;
    for (int j = TID; j < p.h; j += BLOCK) dot_ += ld(p.x, base + j) * ld(p.dy, base + j) * (one + ld(p.w, j));
    dot_ = block_reduce(dot_, false) / float(p.h);
    float iv = p.inv.v[row], c = iv * iv * iv * dot_;
    for (int j = TID; j < p.h; j += BLOCK) {
        float g = iv * (ld(p.dy, base + j) * (one + ld(p.w, j))) - ld(p.x, base + j) * c;
        st(p.dx, base + j, p.accumulate != 0 ? ld(p.dx, base + j) + g : g);
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// Gradients of trained base weights (full fine-tuning) that are not products, into f32
// gradients, each summed in a fixed order without atomics.

// partial[c, j] = Σ over chunk c's rows of dy[r, j] · T(x[r, j] · inv[r]) (`norm`: an RMSNorm
// weight) or of dy[r, j] (a bias).
#ifdef K_col_grad
layout(push_constant) uniform P { TB dy; TB x; F32 inv; F32 partial; int n; int w; int chunk; int norm; } p;
void main() {
    int chunks = (p.n + p.chunk - 1) / p.chunk;
    FOR_EACH(i, chunks * p.w) {
        int c = i / p.w, j = i % p.w;
        int end = min(p.n, (c + 1) * p.chunk);
        float s = 0.0;
        for (int r = c * p.chunk; r < end; r++) {
            float g = ld(p.dy, r * p.w + j);
            s += p.norm != 0 ? g * rnd(ld(p.x, r * p.w + j) * p.inv.v[r]) : g;
        }
        p.partial.v[i] = s;
    }
}
#endif

// grad[tokens[u], j] += scale · Σ_{k = starts[u] .. starts[u + 1]} dx[rows[k], j]: an embedding
// table's gradient (`scale` that of its forward), each distinct token's rows summed by one
// invocation per element of its table row.
#ifdef K_embed_bwd
layout(push_constant) uniform P { TB dx; U32 rows; U32 starts; U32 tokens; F32 grad; int uniq; int h; float scale; } p;
void main() {
    FOR_EACH(i, p.uniq * p.h) {
        int u = i / p.h, j = i % p.h;
        float s = 0.0;
        for (uint k = p.starts.v[u]; k < p.starts.v[u + 1]; k++) s += ld(p.dx, int(p.rows.v[k]) * p.h + j);
        int d = int(p.tokens.v[u]) * p.h + j;
        p.grad.v[d] += s * p.scale;
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// Rotary embeddings in place on [n, heads, d] rows (or their transpose with `inverse`).

#ifdef K_rope
layout(push_constant) uniform P { TB x; U32 pos; F32 cos_; F32 sin_; int n; int heads; int d; int inverse; } p;
void main() {
    int half_ = p.d / 2;
    FOR_EACH(i, p.n * p.heads * half_) {
        int row = i / (p.heads * half_);
        int rem = i % (p.heads * half_), hh = rem / half_, j = rem % half_;
        int xr = (row * p.heads + hh) * p.d;
        int ps = int(p.pos.v[row]) * p.d;
        float c1 = p.cos_.v[ps + j], c2 = p.cos_.v[ps + j + half_];
        float s1 = p.sin_.v[ps + j], s2 = p.sin_.v[ps + j + half_];
        float a = ld(p.x, xr + j), b = ld(p.x, xr + j + half_);
        if (p.inverse == 0) {
            st(p.x, xr + j, a * c1 - b * s1);
            st(p.x, xr + j + half_, b * c2 + a * s2);
        } else {
            st(p.x, xr + j, a * c1 + b * s2);
            st(p.x, xr + j + half_, b * c2 - a * s1);
        }
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// Gated MLP product a = T(act(g)) · u, and its derivative: `gelu` 0 is SiLU (Llama, Qwen), 1 is
// GELU's tanh approximation (Gemma's gelu_pytorch_tanh).

float sigmoid(float z) { return 1.0 / (1.0 + exp(-z)); }

#if defined(K_swiglu) || defined(K_swiglu_bwd)
// act(z) in x, act'(z) in y. tanh through exp (GLSL's tanh may lose accuracy near 0 on some
// drivers): tanh(y) = 1 − 2 / (exp(2y) + 1), which saturates cleanly at ±1.
vec2 gate_act(float z, int gelu) {
    if (gelu != 0) {
        const float k = 0.7978845608028654, c = 0.044715;
        float t = 1.0 - 2.0 / (exp(2.0 * k * (z + c * z * z * z)) + 1.0);
        return vec2(0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * c * z * z));
    }
    float sg = sigmoid(z);
    return vec2(z * sg, sg * (1.0 + z * (1.0 - sg)));
}
#endif

#ifdef K_swiglu
layout(push_constant) uniform P { TB g; TB u; TB a; int n; int gelu; } p;
void main() {
    FOR_EACH(i, p.n) st(p.a, i, rnd(gate_act(ld(p.g, i), p.gelu).x) * ld(p.u, i));
}
#endif

// dg and du may be g and u themselves.
#ifdef K_swiglu_bwd
layout(push_constant) uniform P { TB g; TB u; TB da; TB dg; TB du; int n; int gelu; } p;
void main() {
    FOR_EACH(i, p.n) {
        float up = ld(p.u, i), d = ld(p.da, i);
        vec2 a = gate_act(ld(p.g, i), p.gelu);
        st(p.du, i, d * a.x);
        st(p.dg, i, d * up * a.y);
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// LoRA dropout from a counter-based generator (the bits src/model/lora.rs computes on the CPU).

bool dropout_keep(uint64_t key, uint64_t i, uint threshold) {
    uint64_t z = key + (i + 1ul) * 0x9E3779B97F4A7C15ul;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ul;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBul;
    z ^= z >> 31;
    return uint(z >> 40) >= threshold;
}

#ifdef K_dropout
layout(push_constant) uniform P { TB x; TB y; uint64_t key; uint64_t offset_; uint threshold; float scale; int n; } p;
void main() {
    FOR_EACH(i, p.n) st(p.y, i, dropout_keep(p.key, p.offset_ + uint64_t(i), p.threshold) ? ld(p.x, i) * p.scale : 0.0);
}
#endif

#ifdef K_dropout_acc
layout(push_constant) uniform P { TB src; TB dst; uint64_t key; uint64_t offset_; uint threshold; float scale; int n; } p;
void main() {
    FOR_EACH(i, p.n) {
        if (dropout_keep(p.key, p.offset_ + uint64_t(i), p.threshold)) st(p.dst, i, ld(p.dst, i) + rnd(ld(p.src, i) * p.scale));
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// Cross-entropy of one row of logits per workgroup: loss[r] = logsumexp(z) − z[target], z the
// logits capped where `cap` is not 0; with a non-zero `grad_scale` the row becomes
// (softmax − onehot) · grad_scale (times the cap's derivative).

#ifdef K_cross_entropy
layout(push_constant) uniform P { TB logits; U32 targets; F32 loss; int vocab; float grad_scale; float cap; } p;
void main() {
    int row = int(gl_WorkGroupID.x), base = row * p.vocab;
    int tgt = int(p.targets.v[row]);
    float m = -INF;
    for (int j = TID; j < p.vocab; j += BLOCK) m = max(m, capped(ld(p.logits, base + j), p.cap));
    m = block_reduce(m, true);
    float s = 0.0;
    for (int j = TID; j < p.vocab; j += BLOCK) s += exp(capped(ld(p.logits, base + j), p.cap) - m);
    s = block_reduce(s, false);
    float zt = capped(ld(p.logits, base + tgt), p.cap);
    barrier();  // every invocation has read z[tgt] before it is overwritten
    if (TID == 0) p.loss.v[row] = log(s) - (zt - m);
    if (p.grad_scale != 0.0) {
        float c = p.grad_scale / s;
        for (int j = TID; j < p.vocab; j += BLOCK) {
            float zc = capped(ld(p.logits, base + j), p.cap);
            float g = exp(zc - m) * c;
            if (j == tgt) g -= p.grad_scale;
            st(p.logits, base + j, g * capped_grad(zc, p.cap));
        }
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// Optimizer and reductions over f32 buffers (no dtype suffix).

#if defined(K_sum_scaled) || defined(K_sum_squares)
// The accumulator is an f64 in memory, but the shaders use no 64-bit floats (Intel's Xe and Arc
// GPUs and Apple's, through MoltenVK, have none): every invocation sums its elements as a
// float-float pair (hi + lo, ~48 significant bits), the workgroup adds the pairs, and the first
// invocation adds the total to the f64's bits with 64-bit integer arithmetic, rounding once.
layout(buffer_reference, std430, buffer_reference_align = 8) buffer U64 { uint64_t v[]; };
#ifdef K_sum_scaled
layout(push_constant) uniform P { F32 x; int n; float weight; U64 dst; } p;
#else
layout(push_constant) uniform P { F32 x; int n; U64 dst; } p;
#endif
shared vec2 red2[1024];

// a + b as a float-float pair: Knuth's two-sum of the high parts, then the low parts. `precise`
// keeps the compiler from reassociating or fusing what the error terms depend on.
vec2 ff_add(vec2 a, vec2 b) {
    precise float s = a.x + b.x;
    precise float v = s - a.x;
    precise float e = (a.x - (s - v)) + (b.x - v);
    precise float t = e + (a.y + b.y);
    precise float hi = s + t;
    precise float lo = t - (hi - s);
    return isinf(s) ? vec2(s, 0.0) : vec2(hi, lo); // an infinite sum stays one (not NaN)
}

// A finite number exactly, as m · 2^e.
struct Exact { int64_t m; int e; };
Exact exact_f32(float f) {
    uint b = floatBitsToUint(f);
    int e = int((b >> 23) & 0xffu);
    int64_t m = int64_t(b & 0x7fffffu);
    if (e == 0) e = 1; else m |= int64_t(0x800000);
    return Exact((b >> 31) != 0u ? -m : m, e - 150);
}
Exact exact_f64(uint64_t u) {
    int e = int((u >> 52) & 0x7fful);
    int64_t m = int64_t(u & 0xffffffffffffful);
    if (e == 0) e = 1; else m |= int64_t(1) << 52;
    return Exact((u >> 63) != 0ul ? -m : m, e - 1075);
}
int msb64(uint64_t a) {
    uint h = uint(a >> 32);
    return h != 0u ? 32 + findMSB(h) : findMSB(uint(a));
}
// The f64 bits of t[0] + t[1] + t[2] (each |m| < 2^53), rounded once to nearest even. The terms
// are aligned 60 bits below the largest one's leading bit: what falls below that is 2^-60 of
// the total, far under the f64's own rounding.
uint64_t f64_sum(Exact t[3]) {
    int top = -100000;
    for (int i = 0; i < 3; i++) {
        if (t[i].m != int64_t(0)) top = max(top, t[i].e + msb64(uint64_t(abs(t[i].m))));
    }
    if (top == -100000) return 0ul;
    int e = top - 60;
    int64_t n = int64_t(0);
    for (int i = 0; i < 3; i++) {
        int shift = t[i].e - e;
        if (shift >= 0) n += t[i].m << shift;
        else if (shift > -63) n += t[i].m >> -shift;
    }
    if (n == int64_t(0)) return 0ul;
    uint64_t sign = n < int64_t(0) ? 1ul << 63 : 0ul;
    uint64_t a = uint64_t(abs(n));
    int lead = msb64(a);
    if (lead > 52) {
        int s = lead - 52;
        uint64_t rest = a & ((1ul << s) - 1ul), mid = 1ul << (s - 1);
        a >>= s;
        e += s;
        if (rest > mid || (rest == mid && (a & 1ul) != 0ul)) a += 1ul;
        if (a == 1ul << 53) { a >>= 1; e += 1; }
    } else {
        a <<= 52 - lead;
        e -= 52 - lead;
    }
    int biased = e + 52 + 1023;
    if (biased >= 2047) return sign | 0x7ff0000000000000ul;
    if (biased <= 0) return sign; // below f64's normal range: zero
    return sign | (uint64_t(biased) << 52) | (a & 0xffffffffffffful);
}

// out[0] += weight · Σ x (or Σ x²): the first workgroup does it all, the others return. A
// non-finite sum makes the accumulator non-finite (inf or NaN), and it stays so.
void main() {
    if (gl_WorkGroupID.x != 0) return;
    vec2 s = vec2(0.0);
    for (int i = TID; i < p.n; i += BLOCK) {
        float v = p.x.v[i];
#ifdef K_sum_squares
        v = v * v;
#endif
        s = ff_add(s, vec2(v, 0.0));
    }
    red2[TID] = s;
    memoryBarrierShared();
    barrier();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (TID < k) red2[TID] = ff_add(red2[TID], red2[TID + k]);
        memoryBarrierShared();
        barrier();
    }
    if (TID != 0) return;
    vec2 r = red2[0];
    uint64_t d = p.dst.v[0];
    if (((d >> 52) & 0x7fful) == 0x7fful) return;
    if (isnan(r.x) || isnan(r.y) || isinf(r.x)) {
        p.dst.v[0] = isinf(r.x) ? (r.x < 0.0 ? 0xfff0000000000000ul : 0x7ff0000000000000ul) : 0x7ff8000000000000ul;
        return;
    }
    Exact t[3] = Exact[3](exact_f64(d), exact_f32(r.x), exact_f32(r.y));
#ifdef K_sum_scaled
    // Products of two 24-bit significands are exact in 48 bits.
    Exact w = exact_f32(p.weight);
    t[1] = Exact(t[1].m * w.m, t[1].e + w.e);
    t[2] = Exact(t[2].m * w.m, t[2].e + w.e);
#endif
    p.dst.v[0] = f64_sum(t);
}
#endif

// Correctly rounded division and square root, as kernels.cu's __fdiv_rn and __fsqrt_rn. Vulkan
// rounds adds and multiplies correctly but lets a driver divide within 2.5 ulp and take sqrt as
// 1 / inversesqrt (GPU drivers use reciprocal approximations), while AdamW must equal the CPU
// optimizer (torch's) bit for bit. Each result starts from the driver's and moves, one ulp at a
// time, to the float whose rounding interval holds the exact value: the midpoints between
// neighbouring floats are compared with the exact value through integer arithmetic on the
// significands (no midpoint is ever hit exactly: for normal floats an exact quotient or root
// would need 25 significant bits). Normal operands and results only; others keep the driver's
// value (Vulkan lets drivers flush subnormals anyway).
#if defined(K_adamw) || defined(K_rounding_probe)
// m · 2^e of a normal float's magnitude, m < 2^24.
void parts(float x, out uint64_t m, out int e) {
    uint u = floatBitsToUint(x);
    m = uint64_t((u & 0x7fffffu) | 0x800000u);
    e = int((u >> 23) & 0xffu) - 150;
}
// x · 2^d < y, exactly, for 1 ≤ x < 2^26 and 1 ≤ y < 2^51.
bool less_scaled(uint64_t x, int d, uint64_t y) {
    if (d >= 52) return false;
    if (d >= 0) return x < ((y + (uint64_t(1) << d) - 1ul) >> d); // x < ⌈y / 2^d⌉
    if (d <= -32) return true;
    return (x >> (-d)) < y; // ⌊x / 2^-d⌋ < y
}
bool is_normal(float x) {
    uint e = (floatBitsToUint(x) >> 23) & 0xffu;
    return e != 0u && e != 0xffu;
}
// Far enough inside the normal range that 16 steps of one ulp stay in it.
bool is_inner(float x) {
    uint e = (floatBitsToUint(x) >> 23) & 0xffu;
    return e > 1u && e < 254u;
}
float ulp_up(float x) { return uintBitsToFloat(floatBitsToUint(x) + 1u); }
float ulp_down(float x) { return uintBitsToFloat(floatBitsToUint(x) - 1u); }
// |a / b| below the midpoint between q and the next float up (q > 0):
// ma·2^ea / (mb·2^eb) < (2mq + 1)·2^(eq − 1)  ⇔  ma·2^(ea − eq − eb + 1) < (2mq + 1)·mb.
bool quotient_below(uint64_t ma, int ea, uint64_t mb, int eb, float q) {
    uint64_t mq;
    int eq;
    parts(q, mq, eq);
    return less_scaled(ma, ea - eq - eb + 1, (2ul * mq + 1ul) * mb);
}
// √x below the midpoint above s: x < ((2ms + 1)·2^(es − 1))²  ⇔  mx·2^(ex − 2es + 2) < (2ms + 1)².
bool root_below(uint64_t mx, int ex, float s) {
    uint64_t ms;
    int es;
    parts(s, ms, es);
    return less_scaled(mx, ex - 2 * es + 2, (2ul * ms + 1ul) * (2ul * ms + 1ul));
}
// a / b rounded to nearest from an estimate q0 within 16 ulp of it.
float div_fix(float a, float b, float q0) {
    float q = abs(q0);
    if (!is_normal(a) || !is_normal(b) || !is_inner(q)) return q0;
    uint64_t ma, mb;
    int ea, eb;
    parts(a, ma, ea);
    parts(b, mb, eb);
    for (int i = 0; i < 16 && !quotient_below(ma, ea, mb, eb, q); i++) q = ulp_up(q);
    for (int i = 0; i < 16 && quotient_below(ma, ea, mb, eb, ulp_down(q)); i++) q = ulp_down(q);
    return ((floatBitsToUint(a) ^ floatBitsToUint(b)) & 0x80000000u) != 0u ? -q : q;
}
// √x rounded to nearest from an estimate s0 within 16 ulp of it.
float sqrt_fix(float x, float s0) {
    float s = s0;
    if (!is_normal(x) || x < 0.0 || !is_inner(s)) return s0;
    uint64_t mx;
    int ex;
    parts(x, mx, ex);
    for (int i = 0; i < 16 && !root_below(mx, ex, s); i++) s = ulp_up(s);
    for (int i = 0; i < 16 && root_below(mx, ex, ulp_down(s)); i++) s = ulp_down(s);
    return s;
}
float div_rn(float a, float b) { return div_fix(a, b, a / b); }
float sqrt_rn(float x) { return sqrt_fix(x, sqrt(x)); }
#endif

// The rounding above from estimates moved `nudge` ulps away from the driver's, so that the tests
// (tests/gpu_engine.rs) reach its corrections on drivers whose own division and square root are
// already correctly rounded (lavapipe). q = a / b, s = √|a|.
#ifdef K_rounding_probe
layout(push_constant) uniform P { F32 a; F32 b; F32 q; F32 s; int n; int nudge; } p;
void main() {
    FOR_EACH(i, p.n) {
        float a = p.a.v[i], b = p.b.v[i];
        float q0 = uintBitsToFloat(uint(int(floatBitsToUint(a / b)) + p.nudge));
        float s0 = uintBitsToFloat(uint(int(floatBitsToUint(sqrt(abs(a)))) + p.nudge));
        p.q.v[i] = div_fix(a, b, q0);
        p.s.v[i] = sqrt_fix(abs(a), s0);
    }
}
#endif

// One AdamW step in torch.optim.AdamW's operation order (src/train/optim.rs); `precise` keeps
// the compiler from fusing multiplies and adds, div_rn and sqrt_rn round as the CPU does.
#ifdef K_adamw
layout(push_constant) uniform P {
    F32 w; F32 g; F32 m; F32 v; int n; float decay; float one_minus_b1; float b2; float one_minus_b2;
    float step_size; float bc2_sqrt; float eps; float gscale;
} p;
void main() {
    FOR_EACH(i, p.n) {
        precise float gi = p.gscale == 1.0 ? p.g.v[i] : p.g.v[i] * p.gscale;
        precise float wi = p.w.v[i] * p.decay;
        precise float m0 = p.m.v[i];
        precise float mi = m0 + (gi - m0) * p.one_minus_b1;
        precise float vi = p.v.v[i] * p.b2 + (gi * gi) * p.one_minus_b2;
        precise float denom = div_rn(sqrt_rn(vi), p.bc2_sqrt) + p.eps;
        precise float wn = wi + div_rn(mi, denom) * (-p.step_size);
        p.w.v[i] = wn;
        p.m.v[i] = mi;
        p.v.v[i] = vi;
    }
}
#endif

// e = e·decay + w·mix
#ifdef K_ema
layout(push_constant) uniform P { F32 e; F32 w; float decay; float mix_; int n; } p;
void main() {
    FOR_EACH(i, p.n) {
        precise float r = p.e.v[i] * p.decay + p.w.v[i] * p.mix_;
        p.e.v[i] = r;
    }
}
#endif

// out[j] += Σ_c partial[c, j], the chunks in order (col_grad's second half).
#ifdef K_col_sum
layout(push_constant) uniform P { F32 partial; F32 dst; int chunks; int w; } p;
void main() {
    FOR_EACH(j, p.w) {
        float s = 0.0;
        for (int c = 0; c < p.chunks; c++) s += p.partial.v[c * p.w + j];
        p.dst.v[j] += s;
    }
}
#endif

// Zero `n` 16-bit elements (fills whose address or length is not a multiple of 4 bytes).
#ifdef K_zero16
layout(buffer_reference, std430, buffer_reference_align = 2) buffer U16 { uint16_t v[]; };
layout(push_constant) uniform P { U16 dst; int n; } p;
void main() {
    FOR_EACH(i, p.n) p.dst.v[i] = uint16_t(0u);
}
#endif

// ------------------------------------------------------------------------------------------------
// Attention. q: [b·t, hq·d], k and v: [b·t, hk·d] (rotary embeddings applied), o: like q,
// lse: [b, hq, t] (natural log; +inf for a row that sees no key), lo/hi: [b·t] inclusive key
// ranges. Grid (⌈t/ROWS⌉, heads, b); 128 invocations per workgroup; any even d ≤ 256.
// A workgroup walks tiles of TILE keys (or queries) staged in shared memory: each of the
// ROWS × TILE pairs gets one invocation for its dot products, then per-row softmax state is
// updated by one invocation per row, then the weighted sums are spread over all invocations.

#if defined(K_attn_fwd) || defined(K_attn_bwd_pre) || defined(K_attn_bwd_dq) || defined(K_attn_bwd_dkv)
#define DMAX 256
#define ROWS 4
#define TILE 8
#define PAIRS (ROWS * TILE)
// Elements of a ROWS × d accumulator held per invocation (128 invocations).
#define PER (ROWS * DMAX / 128)
shared float tile_a[TILE * DMAX];
shared float tile_b[TILE * DMAX];
shared float pair_p[PAIRS];
shared int span_[2];

// [min lo, max hi] over rows r0 .. r0 + ROWS (a workgroup-uniform key range).
void key_span(I32 lo, I32 hi, int base, int r0, int t) {
    if (TID == 0) {
        int a = 0x7fffffff, b = -1;
        for (int r = 0; r < ROWS; r++) {
            int i = r0 + r;
            if (i < t && lo.v[base + i] <= hi.v[base + i]) {
                a = min(a, lo.v[base + i]);
                b = max(b, hi.v[base + i]);
            }
        }
        span_[0] = a;
        span_[1] = b;
    }
    memoryBarrierShared();
    barrier();
}
#endif

#ifdef K_attn_fwd
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB o; F32 lse; I32 lo; I32 hi; int t; int hq; int hk; int d; float scale; float cap;
} p;
shared float q_sh[ROWS * DMAX];
shared float m_sh[ROWS], l_sh[ROWS], corr_sh[ROWS];
void main() {
    int bi = int(gl_WorkGroupID.z), h = int(gl_WorkGroupID.y), r0 = int(gl_WorkGroupID.x) * ROWS;
    int d = p.d, t = p.t, g = h / (p.hq / p.hk);
    int qs = p.hq * d, kvs = p.hk * d, base = bi * t;
    key_span(p.lo, p.hi, base, r0, t);
    for (int e = TID; e < ROWS * d; e += 128) {
        int r = e / d, j = e % d, qi = r0 + r;
        q_sh[r * DMAX + j] = qi < t ? ld(p.q, (base + qi) * qs + h * d + j) : 0.0;
    }
    if (TID < ROWS) {
        m_sh[TID] = -INF;
        l_sh[TID] = 0.0;
    }
    float acc[PER];
    for (int c = 0; c < PER; c++) acc[c] = 0.0;
    for (int k0 = span_[0]; k0 <= span_[1]; k0 += TILE) {
        barrier();
        for (int e = TID; e < TILE * d; e += 128) {
            int kr = k0 + e / d, j = e % d;
            bool ok = kr < t;
            tile_a[(e / d) * DMAX + j] = ok ? ld(p.k, (base + kr) * kvs + g * d + j) : 0.0;
            tile_b[(e / d) * DMAX + j] = ok ? ld(p.v, (base + kr) * kvs + g * d + j) : 0.0;
        }
        memoryBarrierShared();
        barrier();
        if (TID < PAIRS) {
            int r = TID / TILE, kk = TID % TILE;
            float s = 0.0;
            for (int j = 0; j < d; j++) s += q_sh[r * DMAX + j] * tile_a[kk * DMAX + j];
            pair_p[TID] = capped(s * p.scale, p.cap);
        }
        memoryBarrierShared();
        barrier();
        if (TID < ROWS) {
            int r = TID, qi = r0 + r;
            int mylo = qi < t ? p.lo.v[base + qi] : 1, myhi = qi < t ? p.hi.v[base + qi] : 0;
            float mt = -INF;
            for (int kk = 0; kk < TILE; kk++) {
                int key = k0 + kk;
                if (key >= mylo && key <= myhi) mt = max(mt, pair_p[r * TILE + kk]);
            }
            if (mt == -INF) {
                corr_sh[r] = 1.0;
                for (int kk = 0; kk < TILE; kk++) pair_p[r * TILE + kk] = 0.0;
            } else {
                float m = m_sh[r], mn = max(m, mt), sum = 0.0;
                for (int kk = 0; kk < TILE; kk++) {
                    int key = k0 + kk;
                    float pk = (key >= mylo && key <= myhi) ? exp(pair_p[r * TILE + kk] - mn) : 0.0;
                    pair_p[r * TILE + kk] = pk;
                    sum += pk;
                }
                float corr = exp(m - mn);
                corr_sh[r] = corr;
                l_sh[r] = l_sh[r] * corr + sum;
                m_sh[r] = mn;
            }
        }
        memoryBarrierShared();
        barrier();
        for (int c = 0; c < PER; c++) {
            int e = TID + 128 * c;
            if (e < ROWS * d) {
                int r = e / d, j = e % d;
                float a = acc[c] * corr_sh[r];
                for (int kk = 0; kk < TILE; kk++) a += pair_p[r * TILE + kk] * tile_b[kk * DMAX + j];
                acc[c] = a;
            }
        }
    }
    barrier();
    for (int c = 0; c < PER; c++) {
        int e = TID + 128 * c;
        if (e < ROWS * d) {
            int r = e / d, j = e % d, qi = r0 + r;
            float l = l_sh[r];
            if (qi < t) st(p.o, (base + qi) * qs + h * d + j, acc[c] * (l > 0.0 ? 1.0 / l : 0.0));
        }
    }
    if (TID < ROWS && r0 + TID < t) {
        float l = l_sh[TID];
        p.lse.v[(bi * p.hq + h) * t + r0 + TID] = l > 0.0 ? m_sh[TID] + log(l) : INF;
    }
}
#endif

// delta[b, h, i] = Σ_j dO[i, j] · O[i, j]; grid (⌈t/4⌉, hq, b), 32 invocations per row.
#ifdef K_attn_bwd_pre
layout(push_constant) uniform P { TB o; TB dout; F32 delta; int t; int hq; int d; } p;
shared float part[128];
void main() {
    int bi = int(gl_WorkGroupID.z), h = int(gl_WorkGroupID.y);
    int r = TID / 32, lane = TID % 32, qi = int(gl_WorkGroupID.x) * ROWS + r;
    float s = 0.0;
    if (qi < p.t) {
        int off = (bi * p.t + qi) * p.hq * p.d + h * p.d;
        for (int j = lane; j < p.d; j += 32) s += ld(p.o, off + j) * ld(p.dout, off + j);
    }
    part[TID] = s;
    memoryBarrierShared();
    barrier();
    if (lane == 0 && qi < p.t) {
        float sum = 0.0;
        for (int l = 0; l < 32; l++) sum += part[r * 32 + l];
        p.delta.v[(bi * p.hq + h) * p.t + qi] = sum;
    }
}
#endif

// dq = scale · Σ_k P ⊙ (dO·v − delta) · k; grid (⌈t/4⌉, hq, b).
#ifdef K_attn_bwd_dq
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB dout; F32 lse; F32 delta; TB dq; I32 lo; I32 hi; int t; int hq; int hk; int d; float scale;
    float cap;
} p;
shared float q_sh[ROWS * DMAX];
shared float do_sh[ROWS * DMAX];
void main() {
    int bi = int(gl_WorkGroupID.z), h = int(gl_WorkGroupID.y), r0 = int(gl_WorkGroupID.x) * ROWS;
    int d = p.d, t = p.t, g = h / (p.hq / p.hk);
    int qs = p.hq * d, kvs = p.hk * d, base = bi * t;
    key_span(p.lo, p.hi, base, r0, t);
    for (int e = TID; e < ROWS * d; e += 128) {
        int r = e / d, j = e % d, qi = r0 + r;
        bool ok = qi < t;
        q_sh[r * DMAX + j] = ok ? ld(p.q, (base + qi) * qs + h * d + j) : 0.0;
        do_sh[r * DMAX + j] = ok ? ld(p.dout, (base + qi) * qs + h * d + j) : 0.0;
    }
    float acc[PER];
    for (int c = 0; c < PER; c++) acc[c] = 0.0;
    for (int k0 = span_[0]; k0 <= span_[1]; k0 += TILE) {
        barrier();
        for (int e = TID; e < TILE * d; e += 128) {
            int kr = k0 + e / d, j = e % d;
            bool ok = kr < t;
            tile_a[(e / d) * DMAX + j] = ok ? ld(p.k, (base + kr) * kvs + g * d + j) : 0.0;
            tile_b[(e / d) * DMAX + j] = ok ? ld(p.v, (base + kr) * kvs + g * d + j) : 0.0;
        }
        memoryBarrierShared();
        barrier();
        if (TID < PAIRS) {
            int r = TID / TILE, kk = TID % TILE, qi = r0 + r, key = k0 + kk;
            float ds = 0.0;
            if (qi < t && key >= p.lo.v[base + qi] && key <= p.hi.v[base + qi]) {
                float s = 0.0, dp = 0.0;
                for (int j = 0; j < d; j++) {
                    s += q_sh[r * DMAX + j] * tile_a[kk * DMAX + j];
                    dp += do_sh[r * DMAX + j] * tile_b[kk * DMAX + j];
                }
                int row = (bi * p.hq + h) * t + qi;
                float sc = capped(s * p.scale, p.cap);
                ds = exp(sc - p.lse.v[row]) * (dp - p.delta.v[row]) * capped_grad(sc, p.cap);
            }
            pair_p[TID] = ds;
        }
        memoryBarrierShared();
        barrier();
        for (int c = 0; c < PER; c++) {
            int e = TID + 128 * c;
            if (e < ROWS * d) {
                int r = e / d, j = e % d;
                float a = acc[c];
                for (int kk = 0; kk < TILE; kk++) a += pair_p[r * TILE + kk] * tile_a[kk * DMAX + j];
                acc[c] = a;
            }
        }
    }
    for (int c = 0; c < PER; c++) {
        int e = TID + 128 * c;
        if (e < ROWS * d) {
            int r = e / d, j = e % d, qi = r0 + r;
            if (qi < t) st(p.dq, (base + qi) * qs + h * d + j, acc[c] * p.scale);
        }
    }
}
#endif

// dk and dv of one kv head, summed over the query heads that share it; grid (⌈t/4⌉, hk, b).
// A query i sees key j iff lo[i] ≤ j ≤ hi[i], and hi[i] ≤ i, so only queries from this
// workgroup's first key on are visited.
#ifdef K_attn_bwd_dkv
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB dout; F32 lse; F32 delta; TB dk; TB dv; I32 lo; I32 hi; int t; int hq; int hk; int d;
    float scale; float cap;
} p;
shared float k_sh[ROWS * DMAX];
shared float v_sh[ROWS * DMAX];
shared float ds_p[PAIRS];
shared float q_l[TILE], q_d[TILE];
shared int q_lo[TILE], q_hi[TILE];
void main() {
    int bi = int(gl_WorkGroupID.z), g = int(gl_WorkGroupID.y), r0 = int(gl_WorkGroupID.x) * ROWS;
    int d = p.d, t = p.t, rep = p.hq / p.hk;
    int qs = p.hq * d, kvs = p.hk * d, base = bi * t;
    for (int e = TID; e < ROWS * d; e += 128) {
        int r = e / d, j = e % d, kj = r0 + r;
        bool ok = kj < t;
        k_sh[r * DMAX + j] = ok ? ld(p.k, (base + kj) * kvs + g * d + j) : 0.0;
        v_sh[r * DMAX + j] = ok ? ld(p.v, (base + kj) * kvs + g * d + j) : 0.0;
    }
    float gk[PER], gv[PER];
    for (int c = 0; c < PER; c++) {
        gk[c] = 0.0;
        gv[c] = 0.0;
    }
    for (int hh = 0; hh < rep; hh++) {
        int h = g * rep + hh;
        int lrow = (bi * p.hq + h) * t;
        for (int q0 = r0; q0 < t; q0 += TILE) {
            barrier();
            for (int e = TID; e < TILE * d; e += 128) {
                int qr = q0 + e / d, j = e % d;
                bool ok = qr < t;
                tile_a[(e / d) * DMAX + j] = ok ? ld(p.q, (base + qr) * qs + h * d + j) : 0.0;
                tile_b[(e / d) * DMAX + j] = ok ? ld(p.dout, (base + qr) * qs + h * d + j) : 0.0;
            }
            if (TID < TILE) {
                int qr = q0 + TID;
                bool ok = qr < t;
                q_l[TID] = ok ? p.lse.v[lrow + qr] : 0.0;
                q_d[TID] = ok ? p.delta.v[lrow + qr] : 0.0;
                q_lo[TID] = ok ? p.lo.v[base + qr] : 1;
                q_hi[TID] = ok ? p.hi.v[base + qr] : 0;
            }
            memoryBarrierShared();
            barrier();
            if (TID < PAIRS) {
                int r = TID / TILE, qq = TID % TILE, kj = r0 + r;
                float pr = 0.0, ds = 0.0;
                if (kj < t && kj >= q_lo[qq] && kj <= q_hi[qq]) {
                    float s = 0.0, dp = 0.0;
                    for (int j = 0; j < d; j++) {
                        s += tile_a[qq * DMAX + j] * k_sh[r * DMAX + j];
                        dp += tile_b[qq * DMAX + j] * v_sh[r * DMAX + j];
                    }
                    float sc = capped(s * p.scale, p.cap);
                    pr = exp(sc - q_l[qq]);
                    ds = pr * (dp - q_d[qq]) * capped_grad(sc, p.cap);
                }
                pair_p[TID] = pr;
                ds_p[TID] = ds;
            }
            memoryBarrierShared();
            barrier();
            for (int c = 0; c < PER; c++) {
                int e = TID + 128 * c;
                if (e < ROWS * d) {
                    int r = e / d, j = e % d;
                    float a = gv[c], b = gk[c];
                    for (int qq = 0; qq < TILE; qq++) {
                        a += pair_p[r * TILE + qq] * tile_b[qq * DMAX + j];
                        b += ds_p[r * TILE + qq] * tile_a[qq * DMAX + j];
                    }
                    gv[c] = a;
                    gk[c] = b;
                }
            }
        }
    }
    for (int c = 0; c < PER; c++) {
        int e = TID + 128 * c;
        if (e < ROWS * d) {
            int r = e / d, j = e % d, kj = r0 + r;
            if (kj < t) {
                st(p.dk, (base + kj) * kvs + g * d + j, gk[c] * p.scale);
                st(p.dv, (base + kj) * kvs + g * d + j, gv[c]);
            }
        }
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// Matrix products: C = alpha · op(A) · op(B) + beta · C, row-major with row pitches, A and B in
// the compute dtype T, C in f32 (`-DC_F32`) or T; f32 accumulation. 64×64 tiles of C per
// workgroup of 256 invocations, 4×4 outputs each. Grid (⌈n/64⌉, ⌈m/64⌉).

#if defined(K_gemm) || defined(K_gemm_sg) || defined(K_gemm_cm) || defined(K_gemm_cm1)
// C is f32 (`-DC_F32`) or the compute dtype.
#ifdef C_F32
#define CB F32
#define CSIZE 4
float ldc_(CB b, int i) { return b.v[i]; }
void stc_(CB b, int i, float x) { b.v[i] = x; }
#else
#define CB TB
#define CSIZE TSIZE
float ldc_(CB b, int i) { return ld(b, i); }
void stc_(CB b, int i, float x) { st(b, i, x); }
#endif
// A batch of products of one shape, one per workgroup z (gemm_cm: when not split): product
// z = o · heads + h takes A at element o · sa_o + (h / a_group) · sa_i, B likewise and C at
// o · sc_o + h · sc_i — attention's products over a batch's rows and heads, a group of query
// heads sharing a key/value head. One product: heads 1, groups 1, strides 0. The fields end
// every product kernel's push constants (BATCH); BATCHED(ptr, z, x, size) is the address of
// product z's operand x (a, b or c) of `size`-byte elements.
#define BATCH int heads; int a_group; int b_group; int sa_o; int sa_i; int sb_o; int sb_i; int sc_o; int sc_i
#define BATCHED(ptr, z, so, si, group, size) \
    (uint64_t(ptr) + uint64_t(int64_t((z) / p.heads) * (so) + int64_t(((z) % p.heads) / (group)) * (si)) * (size))
#define BATCH_A(z) TB(BATCHED(p.a, z, p.sa_o, p.sa_i, p.a_group, TSIZE))
#define BATCH_B(z) TB(BATCHED(p.b, z, p.sb_o, p.sb_i, p.b_group, TSIZE))
#define BATCH_C(z) CB(BATCHED(p.c, z, p.sc_o, p.sc_i, 1, CSIZE))
#endif

#ifdef K_gemm
layout(push_constant) uniform P {
    TB a; TB b; CB c; int m; int n; int k; int lda; int ldb; int ldc; int a_trans; int b_trans; float alpha;
    float beta; BATCH;
} p;
#define GT 64
#define GK 32
// Shared tiles as vec4 rows: sa[kk][r/4] holds op(A)[row0 + r .. r+3][k0 + kk], sb[kk][c/4]
// holds op(B)[k0 + kk][col0 + c .. c+3], so each invocation reads its 4 × 4 operands as two vec4.
shared vec4 sa[GK * GT / 4];
shared vec4 sb[GK * GT / 4];
void main() {
    int row0 = int(gl_WorkGroupID.y) * GT, col0 = int(gl_WorkGroupID.x) * GT, z = int(gl_WorkGroupID.z);
    TB pa = BATCH_A(z), pb = BATCH_B(z);
    CB pc = BATCH_C(z);
    int tx = TID % 16, ty = TID / 16;
    vec4 acc0 = vec4(0.0), acc1 = vec4(0.0), acc2 = vec4(0.0), acc3 = vec4(0.0);
    bool at = p.a_trans != 0, bt = p.b_trans != 0;
    for (int k0 = 0; k0 < p.k; k0 += GK) {
        [[unroll]] for (int l = 0; l < GK * GT / 256; l++) {
            int e = TID + l * 256;
            // A's tile: GT rows × GK columns of op(A); B's: GK rows × GT columns of op(B).
            int ar = at ? e % GT : e / GK, ak = at ? e / GT : e % GK;
            int gr = row0 + ar, gk = k0 + ak;
            float av = 0.0;
            if (gr < p.m && gk < p.k) av = ld(pa, at ? gk * p.lda + gr : gr * p.lda + gk);
            sa[ak * (GT / 4) + ar / 4][ar % 4] = av;
            int bk = bt ? e % GK : e / GT, bc = bt ? e / GK : e % GT;
            int hk = k0 + bk, hc = col0 + bc;
            float bv = 0.0;
            if (hk < p.k && hc < p.n) bv = ld(pb, bt ? hc * p.ldb + hk : hk * p.ldb + hc);
            sb[bk * (GT / 4) + bc / 4][bc % 4] = bv;
        }
        memoryBarrierShared();
        barrier();
        [[unroll]] for (int kk = 0; kk < GK; kk++) {
            vec4 a = sa[kk * (GT / 4) + ty], b = sb[kk * (GT / 4) + tx];
            acc0 = fma(vec4(a.x), b, acc0);
            acc1 = fma(vec4(a.y), b, acc1);
            acc2 = fma(vec4(a.z), b, acc2);
            acc3 = fma(vec4(a.w), b, acc3);
        }
        barrier();
    }
    vec4 acc[4] = vec4[4](acc0, acc1, acc2, acc3);
    [[unroll]] for (int i = 0; i < 4; i++)
        [[unroll]] for (int j = 0; j < 4; j++) {
            int r = row0 + ty * 4 + i, cc = col0 + tx * 4 + j;
            if (r < p.m && cc < p.n) {
                int at_ = r * p.ldc + cc;
                float out_ = p.alpha * acc[i][j];
                if (p.beta != 0.0) out_ += p.beta * ldc_(pc, at_);
                stc_(pc, at_, out_);
            }
        }
}
#endif

// The same product for devices that run a subgroup as one SIMD vector on a CPU and access memory
// lane by lane (lavapipe: a load costs as much as a few hundred multiply-adds, shared memory
// included). A workgroup is one subgroup; it computes GR rows × (BLOCK · GC) columns of C. Each
// lane loads GR / BLOCK values of A's column k and GC values of B's row k, and the A values reach
// every lane through subgroupBroadcast (a register move there), so each load feeds BLOCK · GC or
// GR products. `c_trans` stores Cᵀ (the host swaps A and B when m is the smaller side).
#if defined(K_gemm_sg)
layout(push_constant) uniform P {
    TB a; TB b; CB c; int m; int n; int k; int lda; int ldb; int ldc; int a_trans; int b_trans; float alpha;
    float beta; int c_trans; BATCH;
} p;
#define GR 32
layout(constant_id = 1) const int GC = 4;
void main() {
    int lane = TID;
    int row0 = int(gl_WorkGroupID.y) * GR, col0 = int(gl_WorkGroupID.x) * BLOCK * GC;
    int z = int(gl_WorkGroupID.z);
    TB pa = BATCH_A(z), pb = BATCH_B(z);
    CB pc = BATCH_C(z);
    bool at = p.a_trans != 0, bt = p.b_trans != 0;
    // Element (r, k) of op(A) is at ra[q] + k·sa for r = row0 + lane + BLOCK·q; rows and columns
    // past the edge read the last valid one (no branches) and are not stored.
    int ra[GR / BLOCK], cb[GC];
    [[unroll]] for (int q = 0; q < GR / BLOCK; q++) {
        int r = min(row0 + lane + BLOCK * q, p.m - 1);
        ra[q] = at ? r : r * p.lda;
    }
    [[unroll]] for (int c = 0; c < GC; c++) {
        int cc = min(col0 + lane + BLOCK * c, p.n - 1);
        cb[c] = bt ? cc * p.ldb : cc;
    }
    int sa = at ? p.lda : 1, sb = bt ? 1 : p.ldb;
    float acc[GR * GC];
    [[unroll]] for (int i = 0; i < GR * GC; i++) acc[i] = 0.0;
    for (int k = 0; k < p.k; k++) {
        float av[GR / BLOCK], bv[GC];
        [[unroll]] for (int q = 0; q < GR / BLOCK; q++) av[q] = ld(pa, ra[q] + k * sa);
        [[unroll]] for (int c = 0; c < GC; c++) bv[c] = ld(pb, cb[c] + k * sb);
        [[unroll]] for (int i = 0; i < GR; i++) {
            float a = subgroupBroadcast(av[i / BLOCK], i % BLOCK);
            [[unroll]] for (int c = 0; c < GC; c++) acc[i * GC + c] = fma(a, bv[c], acc[i * GC + c]);
        }
    }
    [[unroll]] for (int i = 0; i < GR; i++)
        [[unroll]] for (int c = 0; c < GC; c++) {
            int r = row0 + i, cc = col0 + lane + BLOCK * c;
            if (r < p.m && cc < p.n) {
                int at_ = p.c_trans != 0 ? cc * p.ldc + r : r * p.ldc + cc;
                float out_ = p.alpha * acc[i * GC + c];
                if (p.beta != 0.0) out_ += p.beta * ldc_(pc, at_);
                stc_(pc, at_, out_);
            }
        }
}
#endif

// ------------------------------------------------------------------------------------------------
// Attention for CPU implementations of Vulkan (see gemm_sg): a workgroup is one subgroup, one
// lane per query row (or key row for dK/dV) with the head's values in registers as D4 = d/4
// vec4s (D4 is specialisation constant 1). A block of BLOCK keys (queries) is loaded one row per
// lane and reaches every lane through subgroupBroadcast, so nothing goes through shared memory
// and there are no barriers. Loops over the head stay loops (unrolling them for d = 128 takes
// llvmpipe minutes to compile); loops over a block's keys are unrolled (broadcasts need constant
// lanes to be cheap). Same arguments and math as the kernels above; grids (⌈t/BLOCK⌉, heads, b).

#if defined(K_attn_fwd_sg) || defined(K_attn_bwd_dq_sg) || defined(K_attn_bwd_dkv_sg)
layout(constant_id = 1) const int D4 = 16;
vec4 ld4(TB b, int i) { return vec4(ld(b, i), ld(b, i + 1), ld(b, i + 2), ld(b, i + 3)); }
void st4(TB b, int i, vec4 x) {
    st(b, i, x.x);
    st(b, i + 1, x.y);
    st(b, i + 2, x.z);
    st(b, i + 3, x.w);
}
#define BC(x, i) subgroupBroadcast(x, i)
#endif

#ifdef K_attn_fwd_sg
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB o; F32 lse; I32 lo; I32 hi; int t; int hq; int hk; int d; float scale; float cap;
} p;
void main() {
    int bi = int(gl_WorkGroupID.z), h = int(gl_WorkGroupID.y), qi = int(gl_WorkGroupID.x) * BLOCK + TID;
    int t = p.t, d = 4 * D4, g = h / (p.hq / p.hk), qs = p.hq * d, kvs = p.hk * d, base = bi * t;
    int qc = min(qi, t - 1);
    int lo = p.lo.v[base + qc], hi = p.hi.v[base + qc];
    if (qi >= t) {
        lo = 1;
        hi = 0;
    }
    int first = subgroupMin(lo <= hi ? lo : 0x7fffffff), last = subgroupMax(lo <= hi ? hi : -1);
    vec4 q[D4], acc[D4];
    [[dont_unroll]] for (int j = 0; j < D4; j++) {
        q[j] = ld4(p.q, (base + qc) * qs + h * d + 4 * j);
        acc[j] = vec4(0.0);
    }
    float m = -INF, l = 0.0;
    for (int k0 = first; k0 <= last; k0 += BLOCK) {
        int kr = min(k0 + TID, t - 1);
        vec4 kv[D4], vv[D4];
        [[dont_unroll]] for (int j = 0; j < D4; j++) {
            kv[j] = ld4(p.k, (base + kr) * kvs + g * d + 4 * j);
            vv[j] = ld4(p.v, (base + kr) * kvs + g * d + 4 * j);
        }
        float sc[BLOCK], pk[BLOCK];
        float mt = -INF;
        [[unroll]] for (int kk = 0; kk < BLOCK; kk++) {
            float s = 0.0;
            [[dont_unroll]] for (int j = 0; j < D4; j++) s += dot(q[j], BC(kv[j], kk));
            int key = k0 + kk;
            sc[kk] = key >= lo && key <= hi ? capped(s * p.scale, p.cap) : -INF;
            mt = max(mt, sc[kk]);
            pk[kk] = 0.0;
        }
        if (mt > -INF) {
            float mn = max(m, mt), corr = exp(m - mn), sum = 0.0;
            [[unroll]] for (int kk = 0; kk < BLOCK; kk++) {
                pk[kk] = sc[kk] == -INF ? 0.0 : exp(sc[kk] - mn);
                sum += pk[kk];
            }
            [[dont_unroll]] for (int j = 0; j < D4; j++) acc[j] *= corr;
            l = l * corr + sum;
            m = mn;
        }
        [[unroll]] for (int kk = 0; kk < BLOCK; kk++)
            [[dont_unroll]] for (int j = 0; j < D4; j++) acc[j] += pk[kk] * BC(vv[j], kk);
    }
    if (qi < t) {
        float inv = l > 0.0 ? 1.0 / l : 0.0;
        [[dont_unroll]] for (int j = 0; j < D4; j++) st4(p.o, (base + qi) * qs + h * d + 4 * j, acc[j] * inv);
        p.lse.v[(bi * p.hq + h) * t + qi] = l > 0.0 ? m + log(l) : INF;
    }
}
#endif

#ifdef K_attn_bwd_dq_sg
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB dout; F32 lse; F32 delta; TB dq; I32 lo; I32 hi; int t; int hq; int hk; int d; float scale;
    float cap;
} p;
void main() {
    int bi = int(gl_WorkGroupID.z), h = int(gl_WorkGroupID.y), qi = int(gl_WorkGroupID.x) * BLOCK + TID;
    int t = p.t, d = 4 * D4, g = h / (p.hq / p.hk), qs = p.hq * d, kvs = p.hk * d, base = bi * t;
    int qc = min(qi, t - 1), row = (bi * p.hq + h) * t + qc;
    int lo = p.lo.v[base + qc], hi = p.hi.v[base + qc];
    if (qi >= t) {
        lo = 1;
        hi = 0;
    }
    int first = subgroupMin(lo <= hi ? lo : 0x7fffffff), last = subgroupMax(lo <= hi ? hi : -1);
    float lse = p.lse.v[row], delta = p.delta.v[row];
    vec4 q[D4], dout[D4], acc[D4];
    [[dont_unroll]] for (int j = 0; j < D4; j++) {
        q[j] = ld4(p.q, (base + qc) * qs + h * d + 4 * j);
        dout[j] = ld4(p.dout, (base + qc) * qs + h * d + 4 * j);
        acc[j] = vec4(0.0);
    }
    for (int k0 = first; k0 <= last; k0 += BLOCK) {
        int kr = min(k0 + TID, t - 1);
        vec4 kv[D4], vv[D4];
        [[dont_unroll]] for (int j = 0; j < D4; j++) {
            kv[j] = ld4(p.k, (base + kr) * kvs + g * d + 4 * j);
            vv[j] = ld4(p.v, (base + kr) * kvs + g * d + 4 * j);
        }
        float ds[BLOCK];
        [[unroll]] for (int kk = 0; kk < BLOCK; kk++) {
            float s = 0.0, dp = 0.0;
            [[dont_unroll]] for (int j = 0; j < D4; j++) {
                s += dot(q[j], BC(kv[j], kk));
                dp += dot(dout[j], BC(vv[j], kk));
            }
            int key = k0 + kk;
            float sc = capped(s * p.scale, p.cap);
            ds[kk] = key >= lo && key <= hi ? exp(sc - lse) * (dp - delta) * capped_grad(sc, p.cap) : 0.0;
        }
        [[unroll]] for (int kk = 0; kk < BLOCK; kk++)
            [[dont_unroll]] for (int j = 0; j < D4; j++) acc[j] += ds[kk] * BC(kv[j], kk);
    }
    if (qi < t)
        [[dont_unroll]] for (int j = 0; j < D4; j++) st4(p.dq, (base + qi) * qs + h * d + 4 * j, acc[j] * p.scale);
}
#endif

// dK and dV of a lane's key, summed over the query heads that share its kv head. A query i sees
// key j iff lo[i] ≤ j ≤ hi[i] and hi[i] ≤ i, so query blocks start at the workgroup's first key;
// blocks whose queries see none of the workgroup's keys are skipped.
#ifdef K_attn_bwd_dkv_sg
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB dout; F32 lse; F32 delta; TB dk; TB dv; I32 lo; I32 hi; int t; int hq; int hk; int d;
    float scale; float cap;
} p;
void main() {
    int bi = int(gl_WorkGroupID.z), g = int(gl_WorkGroupID.y), r0 = int(gl_WorkGroupID.x) * BLOCK, kj = r0 + TID;
    int t = p.t, d = 4 * D4, rep = p.hq / p.hk, qs = p.hq * d, kvs = p.hk * d, base = bi * t;
    int kc = min(kj, t - 1), r1 = min(r0 + BLOCK, t) - 1;
    vec4 k[D4], v[D4], gk[D4], gv[D4];
    [[dont_unroll]] for (int j = 0; j < D4; j++) {
        k[j] = ld4(p.k, (base + kc) * kvs + g * d + 4 * j);
        v[j] = ld4(p.v, (base + kc) * kvs + g * d + 4 * j);
        gk[j] = vec4(0.0);
        gv[j] = vec4(0.0);
    }
    for (int q0 = r0; q0 < t; q0 += BLOCK) {
        int qr = min(q0 + TID, t - 1);
        int lo = p.lo.v[base + qr], hi = p.hi.v[base + qr];
        if (q0 + TID >= t) {
            lo = 1;
            hi = 0;
        }
        if (!subgroupAny(lo <= hi && lo <= r1 && hi >= r0)) continue;
        for (int hh = 0; hh < rep; hh++) {
            int h = g * rep + hh, row = (bi * p.hq + h) * t + qr;
            float lse = p.lse.v[row], delta = p.delta.v[row];
            vec4 qv[D4], dov[D4];
            [[dont_unroll]] for (int j = 0; j < D4; j++) {
                qv[j] = ld4(p.q, (base + qr) * qs + h * d + 4 * j);
                dov[j] = ld4(p.dout, (base + qr) * qs + h * d + 4 * j);
            }
            [[unroll]] for (int qq = 0; qq < BLOCK; qq++) {
                float s = 0.0, dp = 0.0;
                [[dont_unroll]] for (int j = 0; j < D4; j++) {
                    s += dot(BC(qv[j], qq), k[j]);
                    dp += dot(BC(dov[j], qq), v[j]);
                }
                bool in_ = kj < t && kj >= BC(lo, qq) && kj <= BC(hi, qq);
                float sc = capped(s * p.scale, p.cap);
                float pr = in_ ? exp(sc - BC(lse, qq)) : 0.0;
                float ds = pr * (dp - BC(delta, qq)) * capped_grad(sc, p.cap);
                [[dont_unroll]] for (int j = 0; j < D4; j++) {
                    gv[j] += pr * BC(dov[j], qq);
                    gk[j] += ds * BC(qv[j], qq);
                }
            }
        }
    }
    if (kj < t)
        [[dont_unroll]] for (int j = 0; j < D4; j++) {
            st4(p.dk, (base + kj) * kvs + g * d + 4 * j, gk[j] * p.scale);
            st4(p.dv, (base + kj) * kvs + g * d + 4 * j, gv[j]);
        }
}
#endif

// ------------------------------------------------------------------------------------------------
// The product on the device's matrix units (tensor cores, WMMA, XMX) through
// GL_KHR_cooperative_matrix, for f16 and bf16 inputs with f32 accumulation: the same arguments
// and result as K_gemm (C in f32 or T). A workgroup of four subgroups computes a 64 × 64 tile of
// C, each subgroup a 32 × 32 quarter as (32/TM) × (32/TN) accumulators of the device's TM × TN ×
// TK shape (specialisation constants 2, 3, 4; the host picks one the device lists and runs the
// workgroup at the subgroup size it assumes, so gl_NumSubgroups is 4). Tiles of op(A) and op(B)
// are staged in shared memory in the input type, BK deep, rows padded by 8 elements (16 bytes,
// the alignment of matrix loads); the accumulators pass through shared memory one at a time on
// their way out, where α, β, the bounds and the conversion of C are applied.
// Matrix loads and stores need 16-byte aligned addresses and strides
// (VUID-RuntimeSpirv-OpCooperativeMatrixLoadKHR-08986), and GLSL cannot place a shared array:
// the driver lays them out in an order of its own. So every shared array of the kernels on the
// matrix units is a whole number of 16 bytes long (a unit test in vulkan/mod.rs reads the sizes
// from the SPIR-V), and each then starts 16-byte aligned whatever the order.
// Built by tools/glslc (glslang with GL_KHR_cooperative_matrix and GL_EXT_bfloat16).
#if defined(K_gemm_cm) || defined(K_gemm_cm1) || defined(K_attn_fwd_mma) || defined(K_attn_bwd_dq_mma) || defined(K_attn_bwd_dkv_mma) || defined(K_cm_probe)
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#if defined(T_BF16)
#extension GL_EXT_bfloat16 : require
#define ET bfloat16_t
#else
#define ET float16_t
#endif
layout(constant_id = 2) const uint TM = 16;
layout(constant_id = 3) const uint TN = 16;
layout(constant_id = 4) const uint TK = 16;
#endif

#if defined(K_gemm_cm)
// `k_split` > 0: workgroup z takes the inner dimension's values z·k_split .. (z + 1)·k_split − 1
// (a multiple of BK) and writes its part of the product at C + z·m·ldc (split_sum adds them);
// else z is the product of a batch.
layout(push_constant) uniform P {
    TB a; TB b; CB c; int m; int n; int k; int lda; int ldb; int ldc; int a_trans; int b_trans; float alpha;
    float beta; int k_split; BATCH;
} p;
// The tile: four subgroups in a 2 × 2 grid, each computing WM × WN of C (constants 1 and 6, the
// `_<WM>x<WN>` suffix the host launches it under), so a workgroup computes BM × BN, walking the
// inner dimension BK at a time. A subgroup's part is FM × FN accumulators of the device's
// TM × TN shape: at 64 × 64, sixteen of 16 × 16, so each matrix load from shared memory feeds
// four products.
layout(constant_id = 1) const uint WM = 32;
layout(constant_id = 6) const uint WN = 32;
const uint BM = 2 * WM;
const uint BN = 2 * WN;
const uint FM = WM / TM;
const uint FN = WN / TN;
#define BK 32
// The shared tiles hold the 16-bit values eight to a uvec4, so they are written 16 bytes at a
// time (as NVIDIA's vk_cooperative_matrix_perf does): A as BM rows of BK values, B as BK rows of
// BN, each row padded by eight values against bank conflicts; matrix loads read them row-major,
// with offsets and pitches in uvec4s.
const uint PA = (BK + 8) / 8;
const uint PB = (BN + 8) / 8;
shared uvec4 sa[BM * PA];
shared uvec4 sb[BK * PB];
shared float sc[4 * TM * TN];
// Each invocation carries NA uvec4s of A's tile and NB of B's from global to shared memory,
// loaded one tile ahead so that the loads overlap the products of the tile before.
const uint NA = BM * BK / 8 / gl_WorkGroupSize.x;
const uint NB = BN * BK / 8 / gl_WorkGroupSize.x;
const uint NP = NA > NB ? NA : NB;
layout(buffer_reference, std430, buffer_reference_align = 2) buffer U16 { uint16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer W32 { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer V4 { uvec4 v[]; };

// An operand's part of a tile S (`rows` × `cols`, S[r][c] at element `base` + r·`rs` + c·`cs`
// of `buf`, zero outside the first `r_valid` rows and `c_valid` columns) into `pre`, `count`
// uvec4s per invocation. Stored along S's rows (`cs` = 1), each uvec4 is eight consecutive
// values of a row: one 16-byte load inside the matrix where the operand is aligned (`vec`: its
// address and pitch multiples of 16 bytes). Stored across them (`rs` = 1, a transposed
// operand), an invocation takes two rows × eight columns at a time, loading eight pairs of
// values (consecutive invocations read consecutive pairs) and transposing them into two rows of
// eight, so shared memory is still written 16 bytes at a time and read row-major.
void fetch(uint64_t buf, bool vec, int base, int rs, int cs, int rows, int cols, int r_valid, int c_valid,
           uint count, inout uvec4 pre[NP]) {
    U16 h = U16(buf);
    if (cs == 1) {
        [[unroll]] for (uint l = 0; l < count; l++) {
            int e = TID + int(l) * BLOCK;
            int r = e / (cols / 8), c = (e % (cols / 8)) * 8;
            int at = base + r * rs + c;
            if (vec && r < r_valid && c + 8 <= c_valid) {
                pre[l] = V4(buf).v[at / 8];
            } else {
                uint w[8];
                [[unroll]] for (int i = 0; i < 8; i++) w[i] = r < r_valid && c + i < c_valid ? uint(h.v[at + i]) : 0u;
                pre[l] = uvec4(w[0] | (w[1] << 16), w[2] | (w[3] << 16), w[4] | (w[5] << 16), w[6] | (w[7] << 16));
            }
        }
    } else {
        [[unroll]] for (uint l = 0; l < count; l += 2) {
            int e = TID + int(l / 2) * BLOCK;
            int r = (e % (rows / 2)) * 2, c = (e / (rows / 2)) * 8;
            // w[i]: S[r][c + i] in the low half, S[r + 1][c + i] in the high half.
            uint w[8];
            [[unroll]] for (int i = 0; i < 8; i++) {
                int at = base + r + (c + i) * cs;
                if (c + i >= c_valid || r >= r_valid) {
                    w[i] = 0u;
                } else if (vec && r + 1 < r_valid) {
                    w[i] = W32(buf).v[at / 2];
                } else {
                    w[i] = uint(h.v[at]) | (r + 1 < r_valid ? uint(h.v[at + 1]) << 16 : 0u);
                }
            }
            pre[l] = uvec4((w[0] & 0xffffu) | (w[1] << 16), (w[2] & 0xffffu) | (w[3] << 16),
                           (w[4] & 0xffffu) | (w[5] << 16), (w[6] & 0xffffu) | (w[7] << 16));
            pre[l + 1] = uvec4((w[0] >> 16) | (w[1] & 0xffff0000u), (w[2] >> 16) | (w[3] & 0xffff0000u),
                               (w[4] >> 16) | (w[5] & 0xffff0000u), (w[6] >> 16) | (w[7] & 0xffff0000u));
        }
    }
}

// Where `fetch` put each uvec4 of `pre`: its index in a shared tile of `cols` + 8 values a row.
uint slot(bool along, uint l, int rows, int cols) {
    if (along) {
        int e = TID + int(l) * BLOCK;
        return uint(e / (cols / 8) * (cols + 8) / 8 + e % (cols / 8));
    }
    int e = TID + int(l / 2) * BLOCK;
    int r = (e % (rows / 2)) * 2 + int(l % 2), c = (e / (rows / 2)) * 8;
    return uint((r * (cols + 8) + c) / 8);
}

void main() {
    int row0 = int(gl_WorkGroupID.y * BM), col0 = int(gl_WorkGroupID.x * BN);
    uint sg = gl_SubgroupID;
    uint wr = (sg / 2) * WM, wc = (sg % 2) * WN;
    bool at = p.a_trans != 0, bt = p.b_trans != 0;
    int split = p.k_split > 0 ? int(gl_WorkGroupID.z) : 0, z = p.k_split > 0 ? 0 : int(gl_WorkGroupID.z);
    uint64_t pa = uint64_t(BATCH_A(z)), pb = uint64_t(BATCH_B(z));
    CB pc = BATCH_C(z);
    bool va = (pa & 15ul) == 0ul && p.lda % 8 == 0, vb = (pb & 15ul) == 0ul && p.ldb % 8 == 0;
    // op(A)[row0 + r][k0 + c] and op(B)[k0 + r][col0 + c] as S[r][c] of each tile.
    int ars = at ? 1 : p.lda, acs = at ? p.lda : 1, brs = bt ? 1 : p.ldb, bcs = bt ? p.ldb : 1;
    uvec4 ra[NP], rb[NP];
    coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator> acc[FM * FN];
    [[unroll]] for (uint i = 0; i < FM * FN; i++) acc[i] = coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator>(0.0);
    int kb = split * p.k_split;
    int ke = p.k_split > 0 ? min(p.k, kb + p.k_split) : p.k;
    fetch(pa, va, row0 * ars + kb * acs, ars, acs, int(BM), BK, p.m - row0, ke - kb, NA, ra);
    fetch(pb, vb, kb * brs + col0 * bcs, brs, bcs, BK, int(BN), ke - kb, p.n - col0, NB, rb);
    for (int k0 = kb; k0 < ke; k0 += BK) {
        barrier();
        [[unroll]] for (uint l = 0; l < NA; l++) sa[slot(!at, l, int(BM), BK)] = ra[l];
        [[unroll]] for (uint l = 0; l < NB; l++) sb[slot(!bt, l, BK, int(BN))] = rb[l];
        barrier();
        int k1 = k0 + BK;
        if (k1 < ke) {
            fetch(pa, va, row0 * ars + k1 * acs, ars, acs, int(BM), BK, p.m - row0, ke - k1, NA, ra);
            fetch(pb, vb, k1 * brs + col0 * bcs, brs, bcs, BK, int(BN), ke - k1, p.n - col0, NB, rb);
        }
        [[unroll]] for (uint kk = 0; kk < BK; kk += TK) {
            coopmat<ET, gl_ScopeSubgroup, TM, TK, gl_MatrixUseA> fa[FM];
            [[unroll]] for (uint i = 0; i < FM; i++)
                coopMatLoad(fa[i], sa, ((wr + i * TM) * (BK + 8) + kk) / 8, PA, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0; j < FN; j++) {
                coopmat<ET, gl_ScopeSubgroup, TK, TN, gl_MatrixUseB> fb;
                coopMatLoad(fb, sb, (kk * (BN + 8) + wc + j * TN) / 8, PB, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (uint i = 0; i < FM; i++) acc[i * FN + j] = coopMatMulAdd(fa[i], fb, acc[i * FN + j]);
            }
        }
    }
    uint own = sg * TM * TN;
    [[unroll]] for (uint i = 0; i < FM; i++)
        [[unroll]] for (uint j = 0; j < FN; j++) {
            coopMatStore(acc[i * FN + j], sc, own, TN, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint e = gl_SubgroupInvocationID; e < TM * TN; e += gl_SubgroupSize) {
                int r = row0 + int(wr + i * TM + e / TN), cc = col0 + int(wc + j * TN + e % TN);
                if (r < p.m && cc < p.n) {
                    int at_ = split * p.m * p.ldc + r * p.ldc + cc;
                    float out_ = p.alpha * sc[own + e];
                    if (p.beta != 0.0) out_ += p.beta * ldc_(pc, at_);
                    stc_(pc, at_, out_);
                }
            }
            subgroupBarrier();
        }
}
#endif

// The first form of gemm_cm (`gemm_cm1`), kept as the stand-in where the form above fails its
// first-use check on a driver: a 64 × 64 tile of C per workgroup, each subgroup a 32 × 32
// quarter, operands loaded value by value, nothing loaded ahead (13–22 TFLOP/s on an H200, where
// it passed its check).
#if defined(K_gemm_cm1)
layout(push_constant) uniform P {
    TB a; TB b; CB c; int m; int n; int k; int lda; int ldb; int ldc; int a_trans; int b_trans; float alpha;
    float beta; BATCH;
} p;
#define BM 64
#define BN 64
#define BK 32
#define SA (BK + 8)
#define SB (BN + 8)
const uint FM = 32 / TM;
const uint FN = 32 / TN;
shared ET sa[BM * SA];
shared ET sb[BK * SB];
shared float sc[4 * TM * TN];
void main() {
    int row0 = int(gl_WorkGroupID.y) * BM, col0 = int(gl_WorkGroupID.x) * BN;
    int z = int(gl_WorkGroupID.z);
    TB pa = BATCH_A(z), pb = BATCH_B(z);
    CB pc = BATCH_C(z);
    uint sg = gl_SubgroupID;
    uint wr = (sg / 2) * 32, wc = (sg % 2) * 32;
    bool at = p.a_trans != 0, bt = p.b_trans != 0;
    coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator> acc[FM * FN];
    [[unroll]] for (uint i = 0; i < FM * FN; i++) acc[i] = coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator>(0.0);
    for (int k0 = 0; k0 < p.k; k0 += BK) {
        // Consecutive invocations read consecutive addresses of A and B whichever way each is
        // stored.
        for (int e = TID; e < BM * BK; e += BLOCK) {
            int r = at ? e % BM : e / BK, kk = at ? e / BM : e % BK;
            int gr = row0 + r, gk = k0 + kk;
            float v = 0.0;
            if (gr < p.m && gk < p.k) v = ld(pa, at ? gk * p.lda + gr : gr * p.lda + gk);
            sa[r * SA + kk] = ET(v);
        }
        for (int e = TID; e < BK * BN; e += BLOCK) {
            int kk = bt ? e % BK : e / BN, c = bt ? e / BK : e % BN;
            int gk = k0 + kk, gc = col0 + c;
            float v = 0.0;
            if (gk < p.k && gc < p.n) v = ld(pb, bt ? gc * p.ldb + gk : gk * p.ldb + gc);
            sb[kk * SB + c] = ET(v);
        }
        barrier();
        [[unroll]] for (uint kk = 0; kk < BK; kk += TK) {
            coopmat<ET, gl_ScopeSubgroup, TM, TK, gl_MatrixUseA> fa[FM];
            coopmat<ET, gl_ScopeSubgroup, TK, TN, gl_MatrixUseB> fb[FN];
            [[unroll]] for (uint i = 0; i < FM; i++)
                coopMatLoad(fa[i], sa, (wr + i * TM) * SA + kk, SA, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0; j < FN; j++)
                coopMatLoad(fb[j], sb, kk * SB + wc + j * TN, SB, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint i = 0; i < FM; i++)
                [[unroll]] for (uint j = 0; j < FN; j++) acc[i * FN + j] = coopMatMulAdd(fa[i], fb[j], acc[i * FN + j]);
        }
        barrier();
    }
    uint own = sg * TM * TN;
    [[unroll]] for (uint i = 0; i < FM; i++)
        [[unroll]] for (uint j = 0; j < FN; j++) {
            coopMatStore(acc[i * FN + j], sc, own, TN, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint e = gl_SubgroupInvocationID; e < TM * TN; e += gl_SubgroupSize) {
                int r = row0 + int(wr + i * TM + e / TN), cc = col0 + int(wc + j * TN + e % TN);
                if (r < p.m && cc < p.n) {
                    int at_ = r * p.ldc + cc;
                    float out_ = p.alpha * sc[own + e];
                    if (p.beta != 0.0) out_ += p.beta * ldc_(pc, at_);
                    stc_(pc, at_, out_);
                }
            }
            subgroupBarrier();
        }
}
#endif

// A probe of the matrix loads the attention kernels use, for a driver on which they fail their
// check: C = I · B with B (TK × TN) loaded from a 32 × 32 matrix staged in shared memory (row
// pitch 40), row-major (`col` = 0: B = its top-left corner) or column-major (`col` = 1: B = the
// transpose of that corner, as the attention kernels read K to form QKᵀ). Each subgroup writes
// its C (TM × TN, f32, row-major) at `c` + sg · TM · TN; the host compares (vulkan/mod.rs,
// `matrix_load_probe`).
#ifdef K_cm_probe
layout(push_constant) uniform P { TB v; F32 c; int col; } p;
#define PP 40
shared ET pm[32 * PP];
shared ET pa[TM * (TK + 8)];
shared float pc[4 * TM * TN];
void main() {
    uint sg = gl_SubgroupID;
    for (int e = TID; e < 32 * 32; e += BLOCK) pm[(e / 32) * PP + e % 32] = ET(ld(p.v, e));
    for (int e = TID; e < int(TM * TK); e += BLOCK) {
        int r = e / int(TK), k = e % int(TK);
        pa[r * int(TK + 8) + k] = ET(r == k ? 1.0 : 0.0);
    }
    memoryBarrierShared();
    barrier();
    coopmat<ET, gl_ScopeSubgroup, TM, TK, gl_MatrixUseA> a;
    coopMatLoad(a, pa, 0, TK + 8, gl_CooperativeMatrixLayoutRowMajor);
    coopmat<ET, gl_ScopeSubgroup, TK, TN, gl_MatrixUseB> b;
    if (p.col != 0) {
        coopMatLoad(b, pm, 0, PP, gl_CooperativeMatrixLayoutColumnMajor);
    } else {
        coopMatLoad(b, pm, 0, PP, gl_CooperativeMatrixLayoutRowMajor);
    }
    coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator> c =
        coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator>(0.0);
    c = coopMatMulAdd(a, b, c);
    uint own = sg * TM * TN;
    coopMatStore(c, pc, own, TN, gl_CooperativeMatrixLayoutRowMajor);
    subgroupMemoryBarrierShared();
    subgroupBarrier();
    for (uint e = gl_SubgroupInvocationID; e < TM * TN; e += gl_SubgroupSize) p.c.v[own + e] = pc[own + e];
}
#endif

// ------------------------------------------------------------------------------------------------
// Attention on the matrix units: kernels.cu's `attn_fwd_mma`, `attn_bwd_dq_mma` and
// `attn_bwd_dkv_mma` (same arguments and results; bf16 and f16 with f32 accumulation; the head
// size D is specialisation constant 1, the `_64`/`_128` suffix; the matrix shape constants 2–4 as
// in gemm_cm; the tile width BC, 32 or 16, constant 5). A workgroup of four subgroups takes 64
// query rows of one head (key rows for dK and dV), 16 per subgroup, whose fragments stay in
// registers; tiles of BC keys (queries) are staged in shared memory, and a tile's products go
// through shared memory as f32, where the softmax steps run element by element before the next
// product takes them as inputs. Which lane holds which element of an accumulator is the
// driver's choice, so nothing is scaled per row in registers: the forward pass walks the keys twice, first for each row's maximum and sum
// (the log-sum-exp), then for O = Σ exp(s − lse)·V, which needs no rescaling. Every subgroup
// runs the products of every tile the workgroup visits, including tiles none of its rows sees
// (about a tenth of the work at t = 512 under a causal mask): skipping them in one subgroup gave
// wrong results on lavapipe 26.1, and a branch around matrix operations is not worth a driver
// bug that the tests could not see on hardware.
// Shared memory: 64·(D + 8) + 4·16·(BC + 8) values of the input type, 4·16·BC f32 (twice that
// in the backward passes) and 1 KiB: at most 32 KiB for D = 64 with BC = 32 and for D = 128 with
// BC = 16, 39 KiB for D = 128 with BC = 32 (vulkan/mod.rs, `attention_shared_bytes`).

#if defined(K_attn_fwd_mma) || defined(K_attn_bwd_dq_mma) || defined(K_attn_bwd_dkv_mma)
layout(constant_id = 1) const uint D = 64;
layout(constant_id = 5) const int BC = 32;
#define BR 64
#define RS 16
const int SP = BC + 8;
const uint SD = D + 8;    // row pitch of staged rows: 16-byte aligned, as matrix loads want
const uint FM = RS / TM;  // row blocks per subgroup
const uint FD = D / TK;   // steps over the head in a score product
const uint FC = BC / TN;  // column blocks of a tile's scores
const uint FO = D / TN;   // column blocks of a subgroup's output rows
const uint FP = BC / TK;  // steps over the tile in an output product
#define MA coopmat<ET, gl_ScopeSubgroup, TM, TK, gl_MatrixUseA>
#define MB coopmat<ET, gl_ScopeSubgroup, TK, TN, gl_MatrixUseB>
#define MC coopmat<float, gl_ScopeSubgroup, TM, TN, gl_MatrixUseAccumulator>
#define ROW_MAJOR gl_CooperativeMatrixLayoutRowMajor
// Staged rows: the workgroup's own 64 (loaded into registers once), then per tile BC rows of K
// (Q) from row 0 and BC rows of V (dO) from row BC.
shared ET kv[BR * SD];
// Each subgroup's part: a tile's scores (and on the way out its outputs), its probabilities.
shared float s_sh[4 * RS * BC];
shared ET p_sh[4 * RS * SP];
shared int span_sh[4];  // two used; four keep every shared array a multiple of 16 bytes

// Rows r0 .. r0 + n of a [.., stride] matrix of T from column `col` into kv from element `at`;
// rows at or past t are zeros.
void stage(TB m, int base, int r0, int n, int t, int stride, int col, uint at) {
    for (int e = TID; e < n * int(D); e += BLOCK) {
        int i = e / int(D), j = e % int(D), r = r0 + i;
        kv[at + uint(i) * SD + uint(j)] = ET(r < t ? ld(m, (base + r) * stride + col + j) : 0.0);
    }
}

// With ROW_LOADS (the `_rows` modules, for a driver whose column-major matrix loads are wrong:
// vulkan/mod.rs, `matrix_load_probe`): the BC rows of a tile that a score product reads as its
// second operand are staged transposed — column j of the rows at element `at` + j · BC — so that
// the product loads them row-major; rows at or past t are zeros. D · BC fits in the BC · SD
// elements the rows take.
void stage_t(TB m, int base, int r0, int t, int stride, int col, uint at) {
    for (int e = TID; e < BC * int(D); e += BLOCK) {
        int i = e / int(D), j = e % int(D), r = r0 + i;
        kv[at + uint(j) * uint(BC) + uint(i)] = ET(r < t ? ld(m, (base + r) * stride + col + j) : 0.0);
    }
}

// span_sh = [min lo, max hi] over rows r0 .. r0 + n that see a key.
void row_span(I32 lo, I32 hi, int base, int r0, int n, int t) {
    if (TID == 0) {
        span_sh[0] = 0x7fffffff;
        span_sh[1] = -1;
    }
    memoryBarrierShared();
    barrier();
    for (int r = TID; r < n; r += BLOCK) {
        int i = r0 + r;
        if (i < t && lo.v[base + i] <= hi.v[base + i]) {
            atomicMin(span_sh[0], lo.v[base + i]);
            atomicMax(span_sh[1], hi.v[base + i]);
        }
    }
    memoryBarrierShared();
    barrier();
}

// Fragment (kk, j) of the transpose of the BC rows staged from row `brow`: read column-major
// from the rows, or, with ROW_LOADS, row-major from their transpose (stage_t).
#ifdef ROW_LOADS
#define LOAD_KT(b_, brow, j, kk) coopMatLoad(b_, kv, (brow) * SD + kk * TK * uint(BC) + j * TN, uint(BC), ROW_MAJOR)
#else
#define LOAD_KT(b_, brow, j, kk)                                                                     \
    coopMatLoad(b_, kv, ((brow) + j * TN) * SD + kk * TK, SD, gl_CooperativeMatrixLayoutColumnMajor)
#endif

// DST[at ..] (RS × BC, row-major) = A · Bᵀ for this subgroup's RS rows of fragments A (FM × FD)
// and BC staged rows of kv from row `brow` (B, their transpose, read by LOAD_KT).
#define SCORES(A, brow, DST, at)                                                                     \
    [[unroll]] for (uint j = 0; j < FC; j++) {                                                       \
        MC c_[FM];                                                                                   \
        [[unroll]] for (uint i = 0; i < FM; i++) c_[i] = MC(0.0);                                    \
        [[unroll]] for (uint kk = 0; kk < FD; kk++) {                                                \
            MB b_;                                                                                   \
            LOAD_KT(b_, brow, j, kk);                                                                \
            [[unroll]] for (uint i = 0; i < FM; i++) c_[i] = coopMatMulAdd(A[i * FD + kk], b_, c_[i]);   \
        }                                                                                            \
        [[unroll]] for (uint i = 0; i < FM; i++)                                                     \
            coopMatStore(c_[i], DST, (at) + i * TM * BC + j * TN, BC, ROW_MAJOR);                    \
    }

// A tile read only as a score product's second operand, staged as the driver's loads allow
// (STAGE_B, read by LOAD_KT in SCORES); RESTAGE(...) stages a tile the same pass then reads as
// rows, after every subgroup is done with its transpose (without ROW_LOADS the rows are there).
#ifdef ROW_LOADS
#define STAGE_B(m, base, r0, t, stride, col, at) stage_t(m, base, r0, t, stride, col, at)
#define RESTAGE(m, base, r0, t, stride, col, at)                                                     \
    barrier();                                                                                       \
    stage(m, base, r0, BC, t, stride, col, at);                                                      \
    memoryBarrierShared();                                                                           \
    barrier();
#else
#define STAGE_B(m, base, r0, t, stride, col, at) stage(m, base, r0, BC, t, stride, col, at)
#define RESTAGE(m, base, r0, t, stride, col, at)
#endif

// ACC (FM × FO) += PS[at ..] (RS × BC, pitch SP) · BC staged rows of kv from row `brow`.
#define OUTPUT(ACC, PS, at, brow)                                                                    \
    [[unroll]] for (uint kk = 0; kk < FP; kk++) {                                                    \
        MA a_[FM];                                                                                   \
        [[unroll]] for (uint i = 0; i < FM; i++) coopMatLoad(a_[i], PS, (at) + i * TM * SP + kk * TK, SP, ROW_MAJOR); \
        [[unroll]] for (uint o = 0; o < FO; o++) {                                                   \
            MB b_;                                                                                   \
            coopMatLoad(b_, kv, ((brow) + kk * TK) * SD + o * TN, SD, ROW_MAJOR);                    \
            [[unroll]] for (uint i = 0; i < FM; i++) ACC[i * FO + o] = coopMatMulAdd(a_[i], b_, ACC[i * FO + o]); \
        }                                                                                            \
    }

// This subgroup's fragments of 16 rows × D staged in kv.
#define LOAD_ROWS(A)                                                                                 \
    [[unroll]] for (uint i = 0; i < FM; i++)                                                         \
        [[unroll]] for (uint kk = 0; kk < FD; kk++)                                                  \
            coopMatLoad(A[i * FD + kk], kv, (sg * RS + i * TM) * SD + kk * TK, SD, ROW_MAJOR);

// Each element x of ACC (FM × FO), at row r (0 .. 64, of the workgroup's) and column j, passes
// through this subgroup's part of s_sh to the statement STORE.
#define WRITE_OUT(ACC, STORE)                                                                        \
    [[unroll]] for (uint i = 0; i < FM; i++)                                                         \
        [[unroll]] for (uint o = 0; o < FO; o++) {                                                   \
            coopMatStore(ACC[i * FO + o], s_sh, own, TN, ROW_MAJOR);                                 \
            subgroupMemoryBarrierShared();                                                           \
            subgroupBarrier();                                                                       \
            for (uint e = lane; e < TM * TN; e += nl) {                                              \
                int r = int(sg * RS + i * TM + e / TN), j = int(o * TN + e % TN);                    \
                float x = s_sh[own + e];                                                             \
                STORE;                                                                               \
            }                                                                                        \
            subgroupMemoryBarrierShared();                                                           \
            subgroupBarrier();                                                                       \
        }

#define ZERO(ACC, n) [[unroll]] for (uint i = 0; i < (n); i++) ACC[i] = MC(0.0);

#define SUBGROUP_SYNC()                                                                              \
    subgroupMemoryBarrierShared();                                                                   \
    subgroupBarrier();
#endif

#if defined(K_attn_fwd_mma) || defined(K_attn_bwd_dq_mma)
shared int lo_sh[BR], hi_sh[BR];
#endif

#ifdef K_attn_fwd_mma
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB o; F32 lse; I32 lo; I32 hi; int t; int hq; int hk; float scale;
} p;
shared float m_sh[BR], l_sh[BR];
void main() {
    int bi = int(gl_WorkGroupID.z), h = int(gl_WorkGroupID.y), q0 = int(gl_WorkGroupID.x) * BR;
    int t = p.t, g = h / (p.hq / p.hk), qs = p.hq * int(D), kvs = p.hk * int(D), base = bi * t;
    uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, nl = gl_SubgroupSize;
    uint own = sg * RS * BC, ownp = sg * RS * SP;
    float sc = p.scale;
    for (int r = TID; r < BR; r += BLOCK) {
        int i = q0 + r;
        lo_sh[r] = i < t ? p.lo.v[base + i] : 1;
        hi_sh[r] = i < t ? p.hi.v[base + i] : 0;
        m_sh[r] = -INF;
        l_sh[r] = 0.0;
    }
    stage(p.q, base, q0, BR, t, qs, h * int(D), 0);
    row_span(p.lo, p.hi, base, q0, BR, t);
    int first = span_sh[0], last = span_sh[1];
    MA qa[FM * FD];
    LOAD_ROWS(qa)
    // Pass 1: each row's maximum and sum of exponentials, online over the tiles.
    for (int k0 = first; k0 <= last; k0 += BC) {
        barrier();
        STAGE_B(p.k, base, k0, t, kvs, g * int(D), 0);
        memoryBarrierShared();
        barrier();
        SCORES(qa, 0, s_sh, own)
        SUBGROUP_SYNC()
        for (uint r = lane; r < RS; r += nl) {
            uint rr = sg * RS + r;
            int lo_ = lo_sh[rr], hi_ = hi_sh[rr];
            float mt = -INF;
            for (int c = 0; c < BC; c++)
                if (k0 + c >= lo_ && k0 + c <= hi_) mt = max(mt, s_sh[own + r * BC + c] * sc);
            if (mt > -INF) {
                float m = m_sh[rr], mn = max(m, mt), sum = 0.0;
                for (int c = 0; c < BC; c++)
                    if (k0 + c >= lo_ && k0 + c <= hi_) sum += exp(s_sh[own + r * BC + c] * sc - mn);
                l_sh[rr] = l_sh[rr] * exp(m - mn) + sum;
                m_sh[rr] = mn;
            }
        }
        SUBGROUP_SYNC()
    }
    // The log-sum-exp (+inf for a row that sees no key), kept in m_sh for pass 2.
    for (uint r = lane; r < RS; r += nl) {
        uint rr = sg * RS + r;
        float l = l_sh[rr], lse = l > 0.0 ? m_sh[rr] + log(l) : INF;
        m_sh[rr] = lse;
        if (q0 + int(rr) < t) p.lse.v[(bi * p.hq + h) * t + q0 + int(rr)] = lse;
    }
    SUBGROUP_SYNC()
    // Pass 2: O = Σ exp(s − lse) · V.
    MC acc[FM * FO];
    ZERO(acc, FM * FO)
    for (int k0 = first; k0 <= last; k0 += BC) {
        barrier();
        STAGE_B(p.k, base, k0, t, kvs, g * int(D), 0);
        stage(p.v, base, k0, BC, t, kvs, g * int(D), BC * SD);
        memoryBarrierShared();
        barrier();
        SCORES(qa, 0, s_sh, own)
        SUBGROUP_SYNC()
        for (uint e = lane; e < RS * BC; e += nl) {
            uint r = e / BC, c = e % BC, rr = sg * RS + r;
            int key = k0 + int(c);
            bool sees = key >= lo_sh[rr] && key <= hi_sh[rr];
            p_sh[ownp + r * SP + c] = ET(sees ? exp(s_sh[own + e] * sc - m_sh[rr]) : 0.0);
        }
        SUBGROUP_SYNC()
        OUTPUT(acc, p_sh, ownp, BC)
    }
    WRITE_OUT(acc, if (q0 + r < t) st(p.o, (base + q0 + r) * qs + h * int(D) + j, x))
}
#endif

// dQ = scale · dS K with dS = P ⊙ (dO Vᵀ − delta).
#ifdef K_attn_bwd_dq_mma
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB dout; F32 lse; F32 delta; TB dq; I32 lo; I32 hi; int t; int hq; int hk; float scale;
} p;
shared float d_sh[4 * RS * BC];
shared float lse_sh[BR], delta_sh[BR];
void main() {
    int bi = int(gl_WorkGroupID.z), h = int(gl_WorkGroupID.y), q0 = int(gl_WorkGroupID.x) * BR;
    int t = p.t, g = h / (p.hq / p.hk), qs = p.hq * int(D), kvs = p.hk * int(D), base = bi * t;
    uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, nl = gl_SubgroupSize;
    uint own = sg * RS * BC, ownp = sg * RS * SP;
    float sc = p.scale;
    int lrow = (bi * p.hq + h) * t;
    for (int r = TID; r < BR; r += BLOCK) {
        int i = q0 + r;
        bool ok = i < t;
        lo_sh[r] = ok ? p.lo.v[base + i] : 1;
        hi_sh[r] = ok ? p.hi.v[base + i] : 0;
        lse_sh[r] = ok ? p.lse.v[lrow + i] : 0.0;
        delta_sh[r] = ok ? p.delta.v[lrow + i] : 0.0;
    }
    stage(p.q, base, q0, BR, t, qs, h * int(D), 0);
    row_span(p.lo, p.hi, base, q0, BR, t);
    int first = span_sh[0], last = span_sh[1];
    MA qa[FM * FD], da[FM * FD];
    LOAD_ROWS(qa)
    barrier();
    stage(p.dout, base, q0, BR, t, qs, h * int(D), 0);
    memoryBarrierShared();
    barrier();
    LOAD_ROWS(da)
    MC acc[FM * FO];
    ZERO(acc, FM * FO)
    for (int k0 = first; k0 <= last; k0 += BC) {
        barrier();
        STAGE_B(p.k, base, k0, t, kvs, g * int(D), 0);
        STAGE_B(p.v, base, k0, t, kvs, g * int(D), BC * SD);
        memoryBarrierShared();
        barrier();
        SCORES(qa, 0, s_sh, own)
        SCORES(da, BC, d_sh, own)
        SUBGROUP_SYNC()
        for (uint e = lane; e < RS * BC; e += nl) {
            uint r = e / BC, c = e % BC, rr = sg * RS + r;
            int key = k0 + int(c);
            float ds = 0.0;
            if (key >= lo_sh[rr] && key <= hi_sh[rr])
                ds = exp(s_sh[own + e] * sc - lse_sh[rr]) * (d_sh[own + e] - delta_sh[rr]);
            p_sh[ownp + r * SP + c] = ET(ds);
        }
        SUBGROUP_SYNC()
        RESTAGE(p.k, base, k0, t, kvs, g * int(D), 0)
        OUTPUT(acc, p_sh, ownp, 0)
    }
    WRITE_OUT(acc, if (q0 + r < t) st(p.dq, (base + q0 + r) * qs + h * int(D) + j, x * sc))
}
#endif

// One query head's share of dK = scale · Σ dSᵀ Q and dV = Σ Pᵀ dO, for 64 key rows, written as
// f32 partials [b·t, hq, D] that attn_reduce_heads sums over the query heads of each kv head.
// The products are formed transposed (rows are keys): Sᵀ = K Qᵀ, dPᵀ = V dOᵀ. A query i sees
// key j only if j ≤ hi[i] ≤ i, so tiles of queries before this workgroup's keys are not visited.
#ifdef K_attn_bwd_dkv_mma
layout(push_constant) uniform P {
    TB q; TB k; TB v; TB dout; F32 lse; F32 delta; F32 part_k; F32 part_v; I32 lo; I32 hi; int t; int hq;
    int hk; float scale;
} p;
shared float d_sh[4 * RS * BC];
shared float lse_sh[BC], delta_sh[BC];
shared int lo_sh[BC], hi_sh[BC];
// This subgroup's Pᵀ (or dSᵀ) for its keys kf .. kf + 16 and the staged queries, into p_sh.
void probabilities(uint own, uint ownp, int kf, int t, float sc, bool ds) {
    for (uint e = gl_SubgroupInvocationID; e < RS * BC; e += gl_SubgroupSize) {
        uint r = e / BC, c = e % BC;
        int key = kf + int(r);
        float x = 0.0;
        if (key < t && key >= lo_sh[c] && key <= hi_sh[c]) {
            x = exp(s_sh[own + e] * sc - lse_sh[c]);
            if (ds) x *= d_sh[own + e] - delta_sh[c];
        }
        p_sh[ownp + r * SP + c] = ET(x);
    }
}
void main() {
    int bi = int(gl_WorkGroupID.z), h = int(gl_WorkGroupID.y), k0 = int(gl_WorkGroupID.x) * BR;
    int t = p.t, g = h / (p.hq / p.hk), qs = p.hq * int(D), kvs = p.hk * int(D), base = bi * t;
    uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, nl = gl_SubgroupSize;
    uint own = sg * RS * BC, ownp = sg * RS * SP;
    float sc = p.scale;
    int lrow = (bi * p.hq + h) * t;
    int kf = k0 + int(sg) * RS;  // this subgroup's first key
    stage(p.k, base, k0, BR, t, kvs, g * int(D), 0);
    memoryBarrierShared();
    barrier();
    MA ka[FM * FD], va[FM * FD];
    LOAD_ROWS(ka)
    barrier();
    stage(p.v, base, k0, BR, t, kvs, g * int(D), 0);
    memoryBarrierShared();
    barrier();
    LOAD_ROWS(va)
    MC gk[FM * FO], gv[FM * FO];
    ZERO(gk, FM * FO)
    ZERO(gv, FM * FO)
    for (int q0 = (k0 / BC) * BC; q0 < t; q0 += BC) {
        barrier();
        STAGE_B(p.q, base, q0, t, qs, h * int(D), 0);
        STAGE_B(p.dout, base, q0, t, qs, h * int(D), BC * SD);
        for (int e = TID; e < BC; e += BLOCK) {
            int i = q0 + e;
            bool ok = i < t;
            lse_sh[e] = ok ? p.lse.v[lrow + i] : 0.0;
            delta_sh[e] = ok ? p.delta.v[lrow + i] : 0.0;
            lo_sh[e] = ok ? p.lo.v[base + i] : 1;
            hi_sh[e] = ok ? p.hi.v[base + i] : 0;
        }
        memoryBarrierShared();
        barrier();
        SCORES(ka, 0, s_sh, own)
        SCORES(va, BC, d_sh, own)
        SUBGROUP_SYNC()
        RESTAGE(p.q, base, q0, t, qs, h * int(D), 0)
        RESTAGE(p.dout, base, q0, t, qs, h * int(D), BC * SD)
        // Pᵀ, then through the same shared memory dSᵀ = Pᵀ ⊙ (dPᵀ − delta).
        probabilities(own, ownp, kf, t, sc, false);
        SUBGROUP_SYNC()
        OUTPUT(gv, p_sh, ownp, BC)
        SUBGROUP_SYNC()
        probabilities(own, ownp, kf, t, sc, true);
        SUBGROUP_SYNC()
        OUTPUT(gk, p_sh, ownp, 0)
    }
    WRITE_OUT(gk, if (k0 + r < t) p.part_k.v[(base + k0 + r) * qs + h * int(D) + j] = x * sc)
    WRITE_OUT(gv, if (k0 + r < t) p.part_v.v[(base + k0 + r) * qs + h * int(D) + j] = x)
}
#endif

// dk[i, g, :] = Σ over the query heads h of kv head g of part_k[i, h, :] (dv likewise), in head
// order (deterministic).
#ifdef K_attn_reduce_heads
layout(push_constant) uniform P { F32 part_k; F32 part_v; TB dk; TB dv; int n; int hq; int hk; int d; } p;
void main() {
    int rep = p.hq / p.hk, w = p.hk * p.d;
    FOR_EACH(i, p.n * w) {
        int row = i / w, g = (i % w) / p.d, j = i % p.d;
        float sk = 0.0, sv = 0.0;
        for (int r = 0; r < rep; r++) {
            int at = (row * p.hq + g * rep + r) * p.d + j;
            sk += p.part_k.v[at];
            sv += p.part_v.v[at];
        }
        st(p.dk, i, sk);
        st(p.dv, i, sv);
    }
}
#endif

// ------------------------------------------------------------------------------------------------
// Attention through matrix products (ops.rs, `attn_*_products`): a chunk of `rows` query rows
// r0 .. r0 + rows sees keys 0 .. kn − 1 (kn = r0 + rows: no query sees a later key). For product
// z = b · hq + h of the batch, S (f32) and P (T) hold its rows × kn scores and probabilities,
// packed: element (z, r, j) at (z · rows + r) · kn + j.

// P from S = scale · Q Kᵀ (capped where `cap` is not 0), zero outside each row's keys lo ..= hi.
// Forward (`fwd` ≠ 0): the softmax of each row, and its log-sum-exp into lse (∞ for a row that
// sees no key); backward: exp(S − lse) with the forward pass's lse. Grid (rows, b · hq); one
// workgroup per row.
#ifdef K_attn_probs
layout(push_constant) uniform P {
    F32 s; TB pr; F32 lse; I32 lo; I32 hi; int t; int hq; int r0; int rows; int kn; int fwd; float cap;
} p;
void main() {
    int r = int(gl_WorkGroupID.x), z = int(gl_WorkGroupID.y), qi = p.r0 + r;
    int tok = (z / p.hq) * p.t + qi, row = (z * p.rows + r) * p.kn, lrow = z * p.t + qi;
    int lo = p.lo.v[tok], hi = min(p.hi.v[tok], p.kn - 1);
    float m, scale;
    if (p.fwd != 0) {
        m = -INF;
        for (int j = lo + TID; j <= hi; j += BLOCK) m = max(m, capped(p.s.v[row + j], p.cap));
        m = block_reduce(m, true);
        float l = 0.0;
        if (m != -INF)
            for (int j = lo + TID; j <= hi; j += BLOCK) l += exp(capped(p.s.v[row + j], p.cap) - m);
        l = block_reduce(l, false);
        if (TID == 0) p.lse.v[lrow] = l > 0.0 ? m + log(l) : INF;
        scale = l > 0.0 ? 1.0 / l : 0.0;
    } else {
        m = p.lse.v[lrow];
        scale = m == INF ? 0.0 : 1.0;
    }
    for (int j = TID; j < p.kn; j += BLOCK) {
        float x = j >= lo && j <= hi ? exp(capped(p.s.v[row + j], p.cap) - m) * scale : 0.0;
        st(p.pr, row + j, x);
    }
}
#endif

// dS = P ⊙ (dP − delta) in place of P (dP = dO Vᵀ in f32, delta = Σ dO ⊙ O of each row), times
// the cap's derivative at the scores S (f32, uncapped; read only where `cap` is not 0); the scale
// of S goes into the products that take dS. Grid-stride over the chunk's elements.
#ifdef K_attn_dscores
layout(push_constant) uniform P {
    TB pr; F32 dp; F32 delta; F32 s; int t; int r0; int rows; int kn; int n; float cap;
} p;
void main() {
    FOR_EACH(i, p.n) {
        int zr = i / p.kn, z = zr / p.rows, r = zr % p.rows;
        float g = p.cap > 0.0 ? capped_grad(capped(p.s.v[i], p.cap), p.cap) : 1.0;
        st(p.pr, i, ld(p.pr, i) * (p.dp.v[i] - p.delta.v[z * p.t + p.r0 + r]) * g);
    }
}
#endif

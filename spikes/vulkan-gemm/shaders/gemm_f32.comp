#version 460
// C[m,n] = A[m,k] · B[k,n], row-major f32, buffers reached through device addresses (the GPU
// engine's Gpu trait passes raw u64 pointers; this is how Vulkan can take them). 64×64 tiles,
// 16×16 invocations, 4×4 outputs each — the same kernel as the spike's WGSL one.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require

layout(buffer_reference, std430, buffer_reference_align = 4) readonly buffer In { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer Out { float v[]; };

layout(push_constant) uniform Args {
    uint64_t a;
    uint64_t b;
    uint64_t c;
    uint m;
    uint k;
    uint n;
} args;

layout(local_size_x = 16, local_size_y = 16) in;

const uint TILE = 64;
const uint KT = 16;
shared float sa[KT * TILE];
shared float sb[KT * TILE];

void main() {
    In a = In(args.a);
    In b = In(args.b);
    Out c = Out(args.c);
    uint row0 = gl_WorkGroupID.y * TILE;
    uint col0 = gl_WorkGroupID.x * TILE;
    uint tx = gl_LocalInvocationID.x;
    uint ty = gl_LocalInvocationID.y;
    uint tid = ty * 16 + tx;
    float acc[16];
    for (uint i = 0; i < 16; i++) acc[i] = 0.0;
    for (uint k0 = 0; k0 < args.k; k0 += KT) {
        for (uint l = 0; l < 4; l++) {
            uint e = tid + l * 256;
            uint ar = e / KT, ak = e % KT;
            uint gr = row0 + ar, gk = k0 + ak;
            sa[ak * TILE + ar] = (gr < args.m && gk < args.k) ? a.v[gr * args.k + gk] : 0.0;
            uint bk = e / TILE, bc = e % TILE;
            uint hk = k0 + bk, hc = col0 + bc;
            sb[bk * TILE + bc] = (hk < args.k && hc < args.n) ? b.v[hk * args.n + hc] : 0.0;
        }
        barrier();
        for (uint kk = 0; kk < KT; kk++) {
            float ra[4], rb[4];
            for (uint i = 0; i < 4; i++) {
                ra[i] = sa[kk * TILE + ty * 4 + i];
                rb[i] = sb[kk * TILE + tx * 4 + i];
            }
            for (uint i = 0; i < 4; i++)
                for (uint j = 0; j < 4; j++)
                    acc[i * 4 + j] = fma(ra[i], rb[j], acc[i * 4 + j]);
        }
        barrier();
    }
    for (uint i = 0; i < 4; i++)
        for (uint j = 0; j < 4; j++) {
            uint r = row0 + ty * 4 + i, cc = col0 + tx * 4 + j;
            if (r < args.m && cc < args.n) c.v[r * args.n + cc] = acc[i * 4 + j];
        }
}

#version 460
// C[m,n] (f32) = A[m,k] · B[k,n] (f16, row-major) on tensor cores through
// VK_NV_cooperative_matrix (glslang 12 has no GL_KHR_cooperative_matrix yet). Buffers are reached
// through device addresses, as in gemm_f32.comp. A workgroup of four subgroups computes a 64×64
// tile; each subgroup a 32×32 block as 2×2 matrices of 16×16, loading straight from memory.
// Requires m % 64 == 0, n % 64 == 0, k % 16 == 0 (the spike's shapes are).
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_shader_subgroup_basic : require

layout(buffer_reference, std430, buffer_reference_align = 2) readonly buffer H { float16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer F { float v[]; };

layout(push_constant) uniform Args {
    uint64_t a;
    uint64_t b;
    uint64_t c;
    uint m;
    uint k;
    uint n;
} args;

layout(local_size_x = 128) in;

void main() {
    H a = H(args.a);
    H b = H(args.b);
    F c = F(args.c);
    uint sg = gl_SubgroupID;
    uint row = gl_WorkGroupID.y * 64 + (sg / 2) * 32;
    uint col = gl_WorkGroupID.x * 64 + (sg % 2) * 32;
    fcoopmatNV<32, gl_ScopeSubgroup, 16, 16> acc[2][2];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) acc[i][j] = fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>(0.0);
    for (uint k0 = 0; k0 < args.k; k0 += 16) {
        fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> ma[2];
        fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> mb[2];
        for (int i = 0; i < 2; i++)
            coopMatLoadNV(ma[i], a.v, (row + i * 16) * args.k + k0, args.k, false);
        for (int j = 0; j < 2; j++)
            coopMatLoadNV(mb[j], b.v, k0 * args.n + col + j * 16, args.n, false);
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 2; j++) acc[i][j] = coopMatMulAddNV(ma[i], mb[j], acc[i][j]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            coopMatStoreNV(acc[i][j], c.v, (row + i * 16) * args.n + col + j * 16, args.n, false);
}

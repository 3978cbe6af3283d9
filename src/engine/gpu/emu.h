// Runs rtune's CUDA kernels (kernels.cu) on the CPU, for tests on machines without a GPU.
//
// Each CUDA thread of a block is a coroutine (ucontext) on one OS thread; the coroutines walk
// the grid block by block together, so `__shared__` arrays (plain statics here) serve one block
// at a time. `__syncthreads` is a barrier of the block's threads, warp shuffles and `mma.sync`
// are barriers of the warp's 32 threads around an exchange buffer, and the tensor-core product
// follows the fragment layouts of the PTX ISA (mma.m16n8k16, .row.col). A kernel that waits at
// a barrier some of its threads never reach (a warp-wide operation in a diverged warp, a
// `__syncthreads` after an early return) is reported as a deadlock instead of hanging.
#pragma once
// Coroutines switch with _setjmp/_longjmp between their own stacks, which glibc's fortified
// longjmp would reject.
#undef _FORTIFY_SOURCE
#include <csetjmp>
#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <ucontext.h>
#include <vector>

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace emu {
inline uint3 tid, bid;  // of the running coroutine
inline dim3 bdim, gdim;

struct Warp {
    uint64_t xch[32][10];
};

/// Cooperative scheduling of a block's threads: each runs until it reaches a barrier, then the
/// next runnable one runs.
struct Sched {
    struct Fiber {
        ucontext_t ctx;  // only to start it on its stack
        jmp_buf jb;      // where it continues
        std::unique_ptr<char[]> stack;
        bool started = false;
        bool done = false;
        // Waiting at the block barrier (1) or its warp's (2) until that barrier's generation moves.
        int waiting = 0;
        uint64_t gen = 0;
    };
    static constexpr size_t STACK = 256 << 10;
    jmp_buf main;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    unsigned n = 0, cur = 0, block_arrived = 0;
    uint64_t block_gen = 0;
    std::vector<unsigned> warp_arrived;
    std::vector<uint64_t> warp_gen;
    std::function<void()> body;
    const char* kernel = "";

    void wait(int kind) {
        Fiber& f = fibers[cur];
        if (kind == 1) {
            if (++block_arrived == n) {
                block_arrived = 0;
                block_gen++;
                return;
            }
            f.gen = block_gen;
        } else {
            unsigned w = cur / 32, members = std::min(32u, n - w * 32);
            if (++warp_arrived[w] == members) {
                warp_arrived[w] = 0;
                warp_gen[w]++;
                return;
            }
            f.gen = warp_gen[w];
        }
        f.waiting = kind;
        // Back to the scheduler without a system call (swapcontext saves the signal mask).
        if (!_setjmp(f.jb)) _longjmp(main, 1);
    }

    static void entry() {
        Sched& s = *current();
        s.body();
        s.fibers[s.cur].done = true;
        _longjmp(s.main, 1);
    }

    static Sched*& current() {
        static Sched* s = nullptr;
        return s;
    }

    // Run `fb` until it waits or ends.
    __attribute__((noinline)) void resume(Fiber& fb) {
        if (_setjmp(main)) return;
        if (!fb.started) {
            fb.started = true;
            setcontext(&fb.ctx);
        }
        _longjmp(fb.jb, 1);
    }

    // Runs `body` on threads 0 .. count of a block; false on a deadlock.
    bool run(unsigned count, std::function<void()> f) {
        n = count;
        body = std::move(f);
        fibers.resize(std::max<size_t>(fibers.size(), n));
        warps.resize((n + 31) / 32);
        warp_arrived.assign((n + 31) / 32, 0);
        warp_gen.assign((n + 31) / 32, 0);
        block_arrived = 0;
        current() = this;
        for (unsigned i = 0; i < n; i++) {
            Fiber& fb = fibers[i];
            if (!fb.stack) fb.stack.reset(new char[STACK]);
            getcontext(&fb.ctx);
            fb.ctx.uc_stack.ss_sp = fb.stack.get();
            fb.ctx.uc_stack.ss_size = STACK;
            fb.ctx.uc_link = nullptr;
            makecontext(&fb.ctx, entry, 0);
            fb.started = false;
            fb.done = false;
            fb.waiting = 0;
        }
        unsigned left = n;
        while (left > 0) {
            bool progress = false;
            for (unsigned i = 0; i < n; i++) {
                Fiber& fb = fibers[i];
                if (fb.done) continue;
                if (fb.waiting == 1 && fb.gen == block_gen) continue;
                if (fb.waiting == 2 && fb.gen == warp_gen[i / 32]) continue;
                fb.waiting = 0;
                cur = i;
                tid = {i, 0, 0};
                resume(fb);
                progress = true;
                if (fb.done) left--;
            }
            if (!progress) return false;
        }
        return true;
    }
};
inline Sched* sched;

inline Warp& warp() { return sched->warps[sched->cur / 32]; }
inline void warp_barrier() { sched->wait(2); }

using Kernel = void (*)(void**);
inline std::map<std::string, Kernel>& registry() {
    static std::map<std::string, Kernel> r;
    return r;
}
struct Reg {
    Reg(const char* name, Kernel k) { registry()[name] = k; }
};

template <class... A, size_t... I>
void call_impl(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(p[I])...);
}
template <class... A>
void call(void (*f)(A...), void** p) {
    call_impl(f, p, std::index_sequence_for<A...>{});
}

// Lane exchange: every lane of the warp publishes `n` words, then reads any lane's.
template <class F>
inline void exchange(const uint64_t* mine, int n, F&& read) {
    Warp& w = warp();
    int lane = tid.x & 31;
    for (int i = 0; i < n; i++) w.xch[lane][i] = mine[i];
    warp_barrier();
    read(w.xch);
    warp_barrier();
}
}  // namespace emu

#define threadIdx (emu::tid)
#define blockIdx (emu::bid)
#define blockDim (emu::bdim)
#define gridDim (emu::gdim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

inline void __syncthreads() { emu::sched->wait(1); }
inline void __syncwarp(unsigned = 0xffffffff) { emu::warp_barrier(); }

template <class V>
inline V __shfl_xor_sync(unsigned, V v, int mask) {
    uint64_t mine = 0;
    std::memcpy(&mine, &v, sizeof v);
    V out;
    int lane = emu::tid.x & 31;
    emu::exchange(&mine, 1, [&](uint64_t (*x)[10]) { std::memcpy(&out, &x[lane ^ mask][0], sizeof out); });
    return out;
}

template <class V>
inline V __shfl_sync(unsigned, V v, int src) {
    uint64_t mine = 0;
    std::memcpy(&mine, &v, sizeof v);
    V out;
    emu::exchange(&mine, 1, [&](uint64_t (*x)[10]) { std::memcpy(&out, &x[src & 31][0], sizeof out); });
    return out;
}

template <class V>
inline V atomicAdd(V* p, V v) {
    return std::atomic_ref<V>(*p).fetch_add(v);
}
inline int atomicMin(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int cur = a.load();
    while (v < cur && !a.compare_exchange_weak(cur, v)) {
    }
    return cur;
}
inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int cur = a.load();
    while (v > cur && !a.compare_exchange_weak(cur, v)) {
    }
    return cur;
}

// Storage types with the device's conversions (round to nearest even).
struct __nv_bfloat16 {
    uint16_t bits;
};
struct __half {
    _Float16 v;
};
inline float __bfloat162float(__nv_bfloat16 x) {
    uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return {uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
    u += 0x7fff + ((u >> 16) & 1);
    return {uint16_t(u >> 16)};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 x) { return x.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return {b}; }
inline float __half2float(__half x) { return float(x.v); }
inline __half __float2half_rn(float f) { return {_Float16(f)}; }
inline unsigned short __half_as_ushort(__half x) {
    unsigned short b;
    std::memcpy(&b, &x.v, 2);
    return b;
}
inline __half __ushort_as_half(unsigned short b) {
    __half h;
    std::memcpy(&h.v, &b, 2);
    return h;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d += a·b over the warp's fragments.
template <class T>
inline float emu_elem(uint32_t word, int half) {
    unsigned short b = half ? (word >> 16) : (word & 0xffff);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(__ushort_as_bfloat16(b));
    else return __half2float(__ushort_as_half(b));
}
template <class T>
inline void emu_mma16816(float* d, const uint32_t* a, const uint32_t* b) {
    uint64_t mine[10];
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    for (int i = 0; i < 2; i++) mine[4 + i] = b[i];
    int lane = emu::tid.x & 31, g = lane >> 2, c = lane & 3;
    float out[4];
    emu::exchange(mine, 6, [&](uint64_t (*x)[10]) {
        auto A = [&](int row, int k) {
            int kp = k >> 1;
            return emu_elem<T>(uint32_t(x[(row & 7) * 4 + (kp & 3)][(row >> 3) + 2 * (kp >> 2)]), k & 1);
        };
        auto B = [&](int k, int n) {
            int kp = k >> 1;
            return emu_elem<T>(uint32_t(x[n * 4 + (kp & 3)][4 + (kp >> 2)]), k & 1);
        };
        for (int r = 0; r < 4; r++) {
            int row = g + 8 * (r >> 1), col = 2 * c + (r & 1);
            float s = d[r];
            for (int k = 0; k < 16; k++) s += A(row, k) * B(k, col);
            out[r] = s;
        }
    });
    for (int r = 0; r < 4; r++) d[r] = out[r];
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8m .. 8m + 7 give the row addresses of
// 8×8 matrix m (8 consecutive 16-bit values each); lane l receives in r[m] row l/4, columns
// 2(l%4) and 2(l%4)+1 of matrix m — or with `.trans` column l/4, rows 2(l%4) and 2(l%4)+1.
template <bool TRANS>
inline void emu_ldmatrix_x4(uint32_t* r, const void* row) {
    uint64_t mine = reinterpret_cast<uint64_t>(row);
    int lane = emu::tid.x & 31, g = lane >> 2, c = lane & 3;
    emu::exchange(&mine, 1, [&](uint64_t (*x)[10]) {
        for (int m = 0; m < 4; m++) {
            auto at = [&](int rr, int cc) {
                return reinterpret_cast<const uint16_t*>(x[8 * m + rr][0])[cc];
            };
            uint32_t lo = TRANS ? at(2 * c, g) : at(g, 2 * c);
            uint32_t hi = TRANS ? at(2 * c + 1, g) : at(g, 2 * c + 1);
            r[m] = lo | (hi << 16);
        }
    });
}

// Runs `name` over `grid` × `block` (1-D blocks); 0 on success, -1 for an unknown kernel, -2
// when the block's threads deadlock at a barrier.
inline int emu_launch(const char* name, void** params, dim3 grid, dim3 block) {
    auto it = emu::registry().find(name);
    if (it == emu::registry().end()) return -1;
    emu::Kernel k = it->second;
    // One launch at a time: the grid's statics and the scheduler are process-wide.
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> guard(one_at_a_time);
    static emu::Sched sched;
    emu::sched = &sched;
    emu::bdim = block;
    emu::gdim = grid;
    sched.kernel = name;
    bool ok = sched.run(block.x * block.y * block.z, [&] {
        for (unsigned z = 0; z < grid.z; z++)
            for (unsigned y = 0; y < grid.y; y++)
                for (unsigned x = 0; x < grid.x; x++) {
                    emu::bid = {x, y, z};
                    k(params);
                    __syncthreads();
                }
    });
    return ok ? 0 : -2;
}

#define EMU_REGISTER(name) static emu::Reg emu_reg_##name(#name, [](void** p) { emu::call(name, p); });

//! What the GPU engine's tests (tests/gpu_engine.rs) and its kernel timings
//! (benches/gpu_kernels.rs, which includes this file by path) share: random inputs, the Vulkan
//! device they pick, and one attention call's buffers.

use std::rc::Rc;

use rtune::engine::gpu::ops::{AttnShape, Ops};
use rtune::engine::gpu::{Buf, Dt, Gpu};
use rtune::rng::Rng;

/// `n` values uniform in [-scale, scale).
pub fn rand_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale).collect()
}

/// The Vulkan device the tests use: `RTUNE_TEST_VULKAN=N`, else the first one listed (lavapipe,
/// Mesa's software driver, in CI).
#[cfg(feature = "vulkan")]
pub fn vulkan_ordinal() -> usize {
    std::env::var("RTUNE_TEST_VULKAN").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// The Vulkan device at [`vulkan_ordinal`], as the tests and timings run it: on a CPU
/// implementation (lavapipe) the device runs its per-lane kernels, so the kernels written for
/// GPUs run too, on a second instance listed first; on a GPU, the device alone.
#[cfg(feature = "vulkan")]
pub fn vulkan_devices() -> Result<Vec<Rc<dyn Gpu>>, rtune::engine::gpu::GpuError> {
    use rtune::engine::gpu::vulkan::VulkanGpu;
    let g = VulkanGpu::new(vulkan_ordinal())?;
    let mut v: Vec<Rc<dyn Gpu>> = Vec::new();
    if g.cpu_lanes().is_some() {
        let again = VulkanGpu::new(vulkan_ordinal()).expect("the Vulkan device opened once opens again");
        v.push(Rc::new(again.with_gpu_kernels()));
    }
    v.push(Rc::new(g));
    Ok(v)
}

/// The buffers of one attention call, forward and backward: inputs, output and gradients in
/// the compute type, per-row statistics in f32, the rows' key ranges.
pub struct AttnBufs {
    pub q: Buf,
    pub k: Buf,
    pub v: Buf,
    pub dout: Buf,
    pub out: Buf,
    pub lse: Buf,
    pub delta: Buf,
    pub scratch: Buf,
    pub dq: Buf,
    pub dk: Buf,
    pub dv: Buf,
    pub lo: Buf,
    pub hi: Buf,
}

impl AttnBufs {
    pub fn new(
        gpu: &Rc<dyn Gpu>,
        s: &AttnShape,
        dt: Dt,
        (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
        layout: &rtune::model::batch::AttentionLayout,
    ) -> Result<AttnBufs, rtune::engine::gpu::GpuError> {
        let (nq, nk, rows) = (s.b * s.t * s.hq * s.d, s.b * s.t * s.hk * s.d, s.b * s.hq * s.t);
        Ok(AttnBufs {
            q: Buf::from_f32(gpu, q, dt)?,
            k: Buf::from_f32(gpu, k, dt)?,
            v: Buf::from_f32(gpu, v, dt)?,
            dout: Buf::from_f32(gpu, dout, dt)?,
            out: Buf::new(gpu, nq, dt)?,
            lse: Buf::new(gpu, rows, Dt::F32)?,
            delta: Buf::new(gpu, rows, Dt::F32)?,
            scratch: Buf::new(gpu, s.scratch_len(dt, &**gpu, true), Dt::F32)?,
            dq: Buf::new(gpu, nq, dt)?,
            dk: Buf::new(gpu, nk, dt)?,
            dv: Buf::new(gpu, nk, dt)?,
            lo: Buf::from_i32(gpu, &layout.lo)?,
            hi: Buf::from_i32(gpu, &layout.hi)?,
        })
    }

    pub fn fwd(&self, o: &Ops, s: &AttnShape) -> Result<(), rtune::engine::gpu::GpuError> {
        let b = self;
        o.attn_fwd(
            s,
            b.q.ptr(),
            b.k.ptr(),
            b.v.ptr(),
            b.out.ptr(),
            b.lse.ptr(),
            b.lo.ptr(),
            b.hi.ptr(),
            b.scratch.ptr(),
        )
    }

    pub fn bwd(&self, o: &Ops, s: &AttnShape) -> Result<(), rtune::engine::gpu::GpuError> {
        let b = self;
        o.attn_bwd(
            s,
            b.q.ptr(),
            b.k.ptr(),
            b.v.ptr(),
            b.out.ptr(),
            b.dout.ptr(),
            b.lse.ptr(),
            b.delta.ptr(),
            b.scratch.ptr(),
            b.dq.ptr(),
            b.dk.ptr(),
            b.dv.ptr(),
            b.lo.ptr(),
            b.hi.ptr(),
        )
    }
}

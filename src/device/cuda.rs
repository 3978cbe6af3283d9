//! CUDA devices as the driver reports them, without starting the GPU engine: what `rtune
//! doctor` lists and the device policy chooses from.

use cudarc::driver::{CudaContext, sys};

/// The compute capability the kernels were compiled for (×10: 80 is 8.0); older GPUs cannot
/// load them.
pub const BUILD_COMPUTE_CAP: u32 = match u32::from_str_radix(env!("RTUNE_CUDA_COMPUTE_CAP"), 10) {
    Ok(c) => c,
    Err(_) => 80,
};

/// Whether candle's GGUF matrix kernels compiled into this build run on a GPU of compute
/// capability `major.minor`. candle compiles its fast GGUF kernels (`mmvq`, `mmq`) ahead of time
/// to one GPU generation's machine code (`CUDA_COMPUTE_CAP` when it was built; no PTX for the
/// driver to compile), which runs on that generation's later minor versions only — or, for the
/// `a` targets of 9.0 and later, on that exact one. candle launches them without checking, so
/// on any other GPU they leave whatever the output buffer held: an H200 running a build for 8.0
/// gave a q4_k_m GGUF's self-check a perplexity of `inf` (2026-11-27).
pub fn runs_candle_gguf_kernels(major: i32, minor: i32) -> bool {
    machine_code_runs(BUILD_COMPUTE_CAP, major, minor)
}

/// Whether machine code built for compute capability `built` (×10) runs on a `major.minor` GPU.
fn machine_code_runs(built: u32, major: i32, minor: i32) -> bool {
    let (b_major, b_minor) = ((built / 10) as i32, (built % 10) as i32);
    if built >= 90 { (major, minor) == (b_major, b_minor) } else { major == b_major && minor >= b_minor }
}

/// Before candle's GGUF code runs on CUDA device `ordinal` (the quantize stage's self-checks): on
/// a GPU that cannot load this build's fast GGUF kernels ([`runs_candle_gguf_kernels`]), switch
/// candle to its older ones, which are PTX and run everywhere (`dmmv`: one row a thread block
/// for a single token, a dequantized product otherwise). Process-wide, as candle's switch is.
/// Returns whether it switched.
pub fn use_gguf_kernels_that_run(ordinal: usize) -> bool {
    let Ok(ctx) = CudaContext::new(ordinal) else { return false };
    let (major, minor) = compute_capability(&ctx);
    let portable = !runs_candle_gguf_kernels(major, minor);
    if portable {
        candle_core::quantized::cuda::set_force_dmmv(true);
    }
    portable
}

/// The device's compute capability, `(major, minor)` (zeros where the driver will not say).
fn compute_capability(ctx: &CudaContext) -> (i32, i32) {
    let attr = |a| ctx.attribute(a).unwrap_or(0);
    (
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
        attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
    )
}

/// What `rtune doctor` shows of a CUDA device.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CudaInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub memory_bytes: u64,
    pub driver: String,
}

/// The CUDA devices the driver reports (without starting the GPU engine).
pub fn devices() -> Vec<CudaInfo> {
    let Ok(n) = CudaContext::device_count() else { return Vec::new() };
    let mut v = 0i32;
    // SAFETY: writes one int; the driver is initialised by `device_count`.
    let driver = match unsafe { sys::cuDriverGetVersion(&mut v) }.result() {
        Ok(()) => format!("CUDA {}.{}", v / 1000, (v % 1000) / 10),
        Err(_) => String::new(),
    };
    (0..n as usize)
        .filter_map(|i| {
            let ctx = CudaContext::new(i).ok()?;
            Some(CudaInfo {
                name: ctx.name().unwrap_or_default(),
                compute_capability: compute_capability(&ctx),
                memory_bytes: ctx.total_mem().unwrap_or(0) as u64,
                driver: driver.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn machine_code_runs_on_its_generation_only() {
        use super::machine_code_runs as runs;
        assert!(runs(80, 8, 0) && runs(80, 8, 6) && runs(80, 8, 9));
        assert!(!runs(80, 9, 0), "an 8.0 build's machine code does not load on a Hopper GPU");
        assert!(!runs(86, 8, 0) && !runs(80, 7, 5) && !runs(80, 12, 0));
        assert!(runs(90, 9, 0) && !runs(90, 10, 0), "sm_90a runs on 9.0 only");
    }
}

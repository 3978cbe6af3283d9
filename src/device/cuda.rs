//! CUDA devices as the driver reports them, without starting the GPU engine: what `rtune
//! doctor` lists and the device policy chooses from.

use cudarc::driver::{CudaContext, sys};

/// The compute capability the kernels were compiled for (×10: 80 is 8.0); older GPUs cannot
/// load them.
pub const BUILD_COMPUTE_CAP: u32 = match u32::from_str_radix(env!("RTUNE_CUDA_COMPUTE_CAP"), 10) {
    Ok(c) => c,
    Err(_) => 80,
};

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
            let attr = |a| ctx.attribute(a).unwrap_or(0);
            Some(CudaInfo {
                name: ctx.name().unwrap_or_default(),
                compute_capability: (
                    attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                    attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
                ),
                memory_bytes: ctx.total_mem().unwrap_or(0) as u64,
                driver: driver.clone(),
            })
        })
        .collect()
}

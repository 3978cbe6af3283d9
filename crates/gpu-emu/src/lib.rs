//! rtune's GPU kernels on the CPU: `src/engine/gpu/kernels.cu` compiled by the C++ compiler with
//! `emu.h`, which runs every CUDA thread of a block as a coroutine (see emu.h for what it
//! models). Slow, and only for tests: it lets `cargo test` run the GPU engine's kernels and
//! launch code on machines without a GPU.

use std::ffi::{CString, c_void};

unsafe extern "C" {
    fn rtune_emu_launch(name: *const i8, params: *mut *mut c_void, gx: u32, gy: u32, gz: u32, bx: u32) -> i32;
}

/// Run kernel `name` over `grid` blocks of `block` threads. `params` points at each argument's
/// value, in order, as `cuLaunchKernel` takes them.
///
/// # Safety
/// The parameters must match the kernel's signature, and every pointer among them must be
/// valid for the accesses the kernel makes.
pub unsafe fn launch(name: &str, grid: [u32; 3], block: u32, params: &mut [*mut c_void]) -> Result<(), String> {
    let c = CString::new(name).map_err(|_| format!("kernel name `{name}` has a NUL"))?;
    // SAFETY: as the caller promises; the name is a valid C string.
    let rc = unsafe { rtune_emu_launch(c.as_ptr(), params.as_mut_ptr(), grid[0], grid[1], grid[2], block) };
    match rc {
        0 => Ok(()),
        -2 => Err(format!("kernel `{name}` deadlocked: some threads wait at a barrier others never reach")),
        _ => Err(format!("no kernel `{name}` in kernels.cu")),
    }
}

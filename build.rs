//! With `--features cuda`: compiles src/engine/gpu/kernels.cu to PTX with nvcc (from `NVCC`,
//! `CUDA_HOME/bin` or `PATH`) for `CUDA_COMPUTE_CAP` (else the GPU `nvidia-smi` lists, else 80:
//! the PTX runs on Ampere and every later GPU through the driver's JIT). docs/devices.md describes the build.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/engine/gpu/kernels.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("rtune_kernels.ptx");
    // As candle's kernels choose theirs (cudaforge): `CUDA_COMPUTE_CAP`, else the first GPU
    // `nvidia-smi` lists, else 8.0 — so that rtune knows which GPUs candle's precompiled GGUF
    // kernels run on (src/device/cuda.rs).
    let cap: u32 = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .or_else(|| {
            let out = Command::new("nvidia-smi").args(["--query-gpu=compute_cap", "--format=csv,noheader"]).output();
            out.ok().filter(|o| o.status.success()).and_then(|o| {
                let first = String::from_utf8_lossy(&o.stdout).lines().next()?.trim().to_string();
                first.parse::<f32>().ok().map(|c| ((c * 10.0).round() as u32).to_string())
            })
        })
        .and_then(|c| c.trim_start_matches("sm_").trim_end_matches(char::is_alphabetic).parse().ok())
        .map(|c: u32| if c < 20 { c * 10 } else { c })
        .unwrap_or(80);
    println!("cargo:rustc-env=RTUNE_CUDA_COMPUTE_CAP={cap}");
    let nvcc = std::env::var("NVCC").ok().map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("CUDA_HOME")
            .map(|h| PathBuf::from(h).join("bin/nvcc"))
            .filter(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("nvcc"))
    });
    let status = Command::new(&nvcc)
        .args(["--ptx", &format!("-arch=compute_{cap}"), "-O3", "-std=c++17", "-o"])
        .arg(&out)
        .arg("src/engine/gpu/kernels.cu")
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run `{}` ({e}); scripts/toolchain/cuda-toolkit.sh installs one", nvcc.display())
        });
    assert!(status.success(), "nvcc failed to compile src/engine/gpu/kernels.cu");
}

//! Compiles src/engine/gpu/kernels.cu as C++ against emu.h (one translation unit with the launch
//! entry point, so that every kernel's registration is linked in).
use std::path::PathBuf;

fn main() {
    let gpu = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../src/engine/gpu");
    for f in ["kernels.cu", "emu.h"] {
        println!("cargo:rerun-if-changed={}", gpu.join(f).display());
    }
    println!("cargo:rerun-if-changed=src/launch.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .define("RTUNE_EMU", None)
        .include(&gpu)
        .opt_level(2)
        .warnings(false)
        .file("src/launch.cpp")
        .compile("rtune_gpu_emu");
    println!("cargo:rustc-link-lib=pthread");
}

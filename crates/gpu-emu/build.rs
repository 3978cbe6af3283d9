//! Compiles src/engine/gpu/kernels.cu as C++ against emu.h (one translation unit with the launch
//! entry point, so that every kernel's registration is linked in).
use std::path::PathBuf;

fn main() {
    let gpu = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../src/engine/gpu");
    for f in ["kernels.cu", "emu.h"] {
        println!("cargo:rerun-if-changed={}", gpu.join(f).display());
    }
    println!("cargo:rerun-if-changed=src/launch.cpp");
    let mut build = cc::Build::new();
    build.cpp(true).std("c++20").define("RTUNE_EMU", None).include(&gpu).opt_level(2).warnings(false);
    // macOS keeps ucontext (deprecated) behind X/Open's feature macro, and hides its own
    // extensions once that is set unless asked for them too.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        build.define("_XOPEN_SOURCE", "600").define("_DARWIN_C_SOURCE", None);
    }
    build.file("src/launch.cpp").compile("rtune_gpu_emu");
    println!("cargo:rustc-link-lib=pthread");
}

// The kernels and the emulator in one translation unit, and the entry point Rust calls.
#include "kernels.cu"

extern "C" int rtune_emu_launch(const char* name, void** params, unsigned gx, unsigned gy, unsigned gz, unsigned bx) {
    return emu_launch(name, params, dim3{gx, gy, gz}, dim3{bx, 1, 1});
}

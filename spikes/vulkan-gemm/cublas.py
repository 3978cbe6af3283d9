"""The reference for issue 18's spike: the same GEMMs as `vulkan-gemm` through PyTorch on CUDA
(cuBLAS), bf16 and f32 (TF32 off), timed the same way: median of N runs after warm-up, each
ended by a device sync. Prints lines in the spike's format."""
import argparse
import statistics
import time

import torch


def shapes(which):
    def model(name, h, i):
        t = 4 * 512
        return [(name, t, h, h), (name, t, h, i), (name, t, i, h), (name, t, h, 8192)]

    if which == "135m":
        return model("SmolLM2-135M", 576, 1536)
    if which == "360m":
        return model("SmolLM2-360M", 960, 2560)
    return model("SmolLM2-135M", 576, 1536) + model("SmolLM2-360M", 960, 2560)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--shapes", default="all")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    print(f"candidate: PyTorch {torch.__version__} cuBLAS on CUDA, {a.dtype}")
    print(f"adapter: {torch.cuda.get_device_name(0)}")
    for name, m, k, n in shapes(a.shapes):
        x = (torch.rand(m, k, device="cuda") * 2 - 1).to(dt)
        w = (torch.rand(k, n, device="cuda") * 2 - 1).to(dt)
        for _ in range(5):
            x @ w
        torch.cuda.synchronize()
        times = []
        for _ in range(a.iters):
            t = time.perf_counter()
            x @ w
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        gflops = 2 * m * k * n / (ms * 1e-3) / 1e9
        print(f"{name:14} {m:5}x{k:5}x{n:5}  {ms:9.3f} ms  {gflops:10.1f} GFLOP/s")


if __name__ == "__main__":
    main()

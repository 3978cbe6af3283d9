"""Issue 18's go/no-go from the output of spikes/vulkan-gemm/gpu.sh: each Vulkan candidate's rate
on every train-step shape as a fraction of cuBLAS bf16's on the same shape, their geometric mean,
and the rule's answer (a candidate goes if that mean reaches a quarter). With the output of
`gpu_engine --ignored gpu_timings` too, the same for rtune's own products through Vulkan against
its CUDA engine's (cuBLAS) in each type.

    python3 spikes/vulkan-gemm/verdict.py spike.txt [timings.txt]
"""
import math
import re
import sys

RULE = 0.25


def parse(text):
    """{label: {shape: GFLOP/s}} from the `== label` headers and the shape lines under them."""
    runs, label = {}, None
    for line in text.splitlines():
        if line.startswith("== "):
            label = line[3:].strip()
            continue
        m = re.match(r"\s*(\S+)\s+(\d+)x\s*(\d+)x\s*(\d+)\s+[\d.]+ ms\s+([\d.]+) GFLOP/s", line)
        if m and label:
            runs.setdefault(label, {})[f"{m[1]} {m[2]}x{m[3]}x{m[4]}"] = float(m[5])
    return runs


def geomean(xs):
    return math.exp(sum(math.log(max(x, 1e-12)) for x in xs) / len(xs))


def engine(text):
    """rtune's products on the last device of gpu_timings' table as fractions of the first's
    (CUDA's, cuBLAS, in a CUDA build): rows `| work | type | first | … | last (r×) |`."""
    ratios, names = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["work", "type"]:
            names = (cells[2], cells[-1])
        if len(cells) < 4 or "attention" in cells[0] or not re.search(r"x·Wᵀ|dy·W", cells[0]):
            continue
        m = re.search(r"\(([\d.]+)×\)", cells[-1])
        if m:
            ratios.setdefault(cells[1], []).append(float(m[1]))
    for dtype, rs in sorted(ratios.items()):
        mean = geomean(rs)
        rule = f"; {'meets' if mean >= RULE else 'misses'} the rule" if dtype != "F32" else ""
        print(f"rtune's {dtype} products on {names[1]}: {mean:.3f}× {names[0]}'s "
              f"(geometric mean of {len(rs)}; lowest {min(rs):.3f}×){rule}")


def main():
    if len(sys.argv) > 2:
        engine(open(sys.argv[2]).read())
    runs = parse(open(sys.argv[1]).read())
    ref = runs.get("cuBLAS (PyTorch) bf16")
    if not ref:
        print("verdict: no cuBLAS bf16 rates in the spike's output, so no answer")
        return
    best = None
    for label, rates in runs.items():
        if label.startswith("cuBLAS"):
            continue
        ratios = {s: rates[s] / ref[s] for s in rates if s in ref and ref[s] > 0}
        if not ratios:
            continue
        mean = geomean(list(ratios.values()))
        worst = min(ratios, key=ratios.get)
        print(f"{label}: {mean:.3f}× cuBLAS bf16 (geometric mean of {len(ratios)} shapes; "
              f"lowest {ratios[worst]:.3f}× on {worst})")
        if best is None or mean > best[1]:
            best = (label, mean)
    if best is None:
        print("verdict: no Vulkan candidate ran")
    elif best[1] >= RULE:
        print(f"verdict: GO — {best[0]} reaches {best[1]:.2f}× cuBLAS bf16 (rule: ≥ {RULE})")
    else:
        print(f"verdict: NO-GO — the best, {best[0]}, reaches {best[1]:.2f}× cuBLAS bf16 (rule: ≥ {RULE})")


if __name__ == "__main__":
    main()

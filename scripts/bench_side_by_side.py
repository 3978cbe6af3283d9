#!/usr/bin/env python3
"""One command for the side-by-side train-step table of docs/benchmarks.md: rtune's
`cargo bench --bench train_step` and benches/reference/peft_bench.py (PyTorch + PEFT) on the
same machine, one after the other, then the ratios. Needs torch, transformers and peft.

    python3 scripts/bench_side_by_side.py            # both shapes
    python3 scripts/bench_side_by_side.py tiny       # one shape
"""
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = {"tiny": 30, "135m": 5}
shapes = sys.argv[1:] or ["tiny", "135m"]
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}

rows = []
for shape in shapes:
    out = subprocess.run(
        ["cargo", "bench", "--quiet", "--bench", "train_step", "--", shape, str(STEPS[shape])],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    m = re.search(r"frozen-weight matmul\s+median ([\d.]+) s/step\s+(\d+) tokens/s\s+peak RSS ([\d.]+) (\w+)", out)
    rt = {"s": float(m.group(1)), "tps": float(m.group(2)), "rss": float(m.group(3)) * UNITS[m.group(4)]}
    ref = json.loads(subprocess.run(
        [sys.executable, str(ROOT / "benches/reference/peft_bench.py"), shape, str(STEPS[shape])],
        check=True, capture_output=True, text=True,
    ).stdout.strip().splitlines()[-1])
    rows.append((shape, rt, ref))

print("| shape | rtune s/step | rtune tok/s | rtune peak RSS | PyTorch+PEFT s/step | tok/s | peak RSS | speed ratio | RSS ratio |")
print("|---|---|---|---|---|---|---|---|---|")
for shape, rt, ref in rows:
    print(
        f"| {shape} | {rt['s']:.4f} | {rt['tps']:,.0f} | {rt['rss'] / 2**20:,.0f} MiB | {ref['s_per_step']:.4f} | "
        f"{ref['tokens_per_s']:,.0f} | {ref['peak_rss_bytes'] / 2**20:,.0f} MiB | "
        f"{rt['tps'] / ref['tokens_per_s']:.2f}x | {rt['rss'] / ref['peak_rss_bytes']:.2f}x |"
    )
print(f"\n({ref['impl']})")

#!/usr/bin/env python3
"""One command for the side-by-side tables of docs/benchmarks.md, rtune and PyTorch + PEFT on
the same machine, one after the other, then the ratios. Needs torch, transformers and peft.

    python3 scripts/bench/side-by-side.py                 # train step, both shapes
    python3 scripts/bench/side-by-side.py tiny            # one shape
    python3 scripts/bench/side-by-side.py --epoch tiny    # also one epoch of variable-length rows
    python3 scripts/bench/side-by-side.py --eval          # also evaluation (loss, no gradients)

Train step: `cargo bench --bench train_step` (rtune's fused engine, alone in its process so its
peak RSS is its own) and benches/reference/peft_bench.py. Epoch: `cargo bench --bench epoch`
and benches/reference/peft_epoch.py on the same rows and batches. Evaluate: `cargo bench --bench
export` (rtune's fused engine, a 4 x 128 batch) and benches/reference/peft_bench.py --eval.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"tiny": 30, "135m": 5, "qwen3-0.6b": 3, "gemma3-270m": 3}
args = sys.argv[1:]
epoch = "--epoch" in args
evaluate = "--eval" in args
shapes = [a for a in args if not a.startswith("--")] or ["tiny", "135m"]
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def cargo_bench(name, *bench_args, env=None):
    return subprocess.run(
        ["cargo", "bench", "--quiet", "--bench", name, "--", *bench_args],
        cwd=ROOT, check=True, capture_output=True, text=True, env={**os.environ, **(env or {})},
    ).stdout


def table(title, *columns):
    """A table's title, header and separator, as docs/benchmarks.md lays them out."""
    print(f"{title}:\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def python(script, *script_args):
    out = subprocess.run([sys.executable, str(ROOT / script), *script_args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


rows = []
for shape in shapes:
    out = cargo_bench("train_step", shape, str(STEPS[shape]), env={"RTUNE_BENCH_ENGINE": "fused"})
    m = re.search(r"fused engine\s+median ([\d.]+) s/step\s+(\d+) tokens/s\s+peak RSS ([\d.]+) (\w+)\s+([\d.]+) GFLOP/s", out)
    rt = {"s": float(m.group(1)), "tps": float(m.group(2)), "rss": float(m.group(3)) * UNITS[m.group(4)], "gflops": float(m.group(5))}
    ref = python("benches/reference/peft_bench.py", shape, str(STEPS[shape]))
    rows.append((shape, rt, ref))

table("Train step (4 x 128 tokens)", "shape", "rtune s/step", "rtune tok/s", "rtune GFLOP/s", "rtune peak RSS",
      "PyTorch+PEFT s/step", "tok/s", "peak RSS", "speed ratio", "RSS ratio")
for shape, rt, ref in rows:
    print(
        f"| {shape} | {rt['s']:.4f} | {rt['tps']:,.0f} | {rt['gflops']:.0f} | {rt['rss'] / 2**20:,.0f} MiB | {ref['s_per_step']:.4f} | "
        f"{ref['tokens_per_s']:,.0f} | {ref['peak_rss_bytes'] / 2**20:,.0f} MiB | "
        f"{rt['tps'] / ref['tokens_per_s']:.2f}x | {rt['rss'] / ref['peak_rss_bytes']:.2f}x |"
    )
print(f"\n({rows[-1][2]['impl']})")

if epoch:
    table("\nOne epoch of variable-length rows (batch 8)", "shape", "rtune shuffled s", "rtune group_by_length s",
          "PyTorch+PEFT s", "ratio (grouped / PyTorch)", "rtune peak RSS", "PyTorch peak RSS")
    for shape in shapes:
        out = cargo_bench("epoch", shape)
        loops = {m.group(1): float(m.group(2)) for m in re.finditer(r"(shuffled|group_by_length)\s+loop ([\d.]+) s", out)}
        rss = re.findall(r"peak RSS ([\d.]+) (\w+)", out)[-1]
        ref = python("benches/reference/peft_epoch.py", shape)
        print(
            f"| {shape} | {loops['shuffled']:.2f} | {loops['group_by_length']:.2f} | {ref['seconds']:.2f} | "
            f"{loops['group_by_length'] / ref['seconds']:.2f}x | {rss[0]} {rss[1]} | {ref['peak_rss_bytes'] / 2**30:.1f} GiB |"
        )

if evaluate:
    table("\nEvaluate (mean loss of a 4 x 128 batch, no gradients, median of 5)", "shape", "rtune tok/s",
          "PyTorch+PEFT tok/s", "speed ratio")
    for shape in shapes:
        out = cargo_bench("export", shape)
        tps = float(re.search(r"evaluate fused engine\s+[\d.]+ s/batch\s+(\d+) tokens/s", out).group(1))
        ref = python("benches/reference/peft_bench.py", "--eval", shape)
        print(f"| {shape} | {tps:,.0f} | {ref['tokens_per_s']:,.0f} | {tps / ref['tokens_per_s']:.2f}x |")

#!/usr/bin/env python3
"""A kernel's work, stalls and shared-memory bank conflicts by phase (the code between two barriers),
from an Nsight Compute SASS export: for kernels whose warps meet at __syncthreads between phases
(pass 3 of the KDA backward), which phase issues what and where the shared-memory wavefronts go.
On the GPU machine (ncu is /usr/local/cuda/bin/ncu there):

  ncu --set full --import-source yes -k regex:kda_chunk_gradient -c 1 -o /tmp/r  BINARY ARGS...
  ncu --import /tmp/r.ncu-rep --page source --csv --print-source sass > sass.csv
  ncu --import /tmp/r.ncu-rep --page details --csv > details.csv          (optional)
  scripts/ncu_phases.py sass.csv [--per N] [--top M] [--details details.csv]

A phase here is the SASS from one BAR instruction to the next, in address order (the compiler keeps
the barriers in source order, and moves little code across them). Prints, a row a phase: its
instructions (divided by --per, e.g. the chunks a launch processes, for per-item figures), its
share of the warp-stall samples with the three largest stall reasons, the shared-memory wavefronts
and those over the ideal (bank conflicts), and the most executed opcodes; then the M instructions
with the most excess wavefronts (--top, default 12). This is how the eighth session found pass 3's
bank conflicts (kernels/JOURNAL.md, "Eighth session"). Needs only Python's standard library.
"""
import argparse
import csv
from collections import defaultdict


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source):
    words = source.split()
    if not words:
        return ""
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def read(path):
    """The header and the instruction rows of the CSV (the first line names the kernel)."""
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    start = next(i for i, row in enumerate(rows) if "Address" in row and "Source" in row)
    return rows[0], rows[start], rows[start + 1:]


def phases(header, rows):
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    out, current = [], None
    for row in rows:
        if current is None:
            current = {"first": row[col["Address"]], "executed": 0.0, "samples": 0.0, "wavefronts": 0.0,
                       "excess": 0.0, "opcodes": defaultdict(float), "stalls": defaultdict(float)}
        source = row[col["Source"]].strip()
        executed = number(row[col["Instructions Executed"]])
        current["executed"] += executed
        current["samples"] += number(row[col["Warp Stall Sampling (All Samples)"]])
        current["wavefronts"] += number(row[col["L1 Wavefronts Shared"]])
        current["excess"] += number(row[col["L1 Wavefronts Shared Excessive"]])
        current["opcodes"][opcode(source)] += executed
        for name in stall_cols:
            current["stalls"][name[len("stall_"):]] += number(row[col[name]])
        if opcode(source) == "BAR":
            current["last"] = row[col["Address"]]
            out.append(current)
            current = None
    if current is not None:
        current["last"] = "end"
        out.append(current)
    return out


LAUNCH_METRICS = ["Duration", "Issue Slots Busy", "Warp Cycles Per Issued Instruction", "Executed Instructions",
                  "Eligible Warps Per Scheduler", "Registers Per Thread", "DRAM Throughput"]


def print_launch_metrics(path):
    """The launch-wide figures of a `--page details --csv` export (the first launch's, by name)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for name in LAUNCH_METRICS:
        row = next((r for r in rows if r.get("Metric Name") == name), None)
        if row is not None:
            print(f"{name}: {row['Metric Value']} {row.get('Metric Unit', '')}".rstrip())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--per", type=float, default=1.0, help="divide counts by this (e.g. items a launch)")
    parser.add_argument("--top", type=int, default=12, help="instructions listed by excess wavefronts")
    parser.add_argument("--details", help="the same report's `--page details --csv` export: print the "
                        "launch's duration, issue slots busy, cycles an issued instruction and the like first")
    args = parser.parse_args()
    title, header, rows = read(args.csv)
    col = {name: i for i, name in enumerate(header)}
    print(" ".join(title).strip(' ,"')[:160])
    if args.details:
        print_launch_metrics(args.details)
    found = phases(header, rows)
    samples = sum(p["samples"] for p in found) or 1.0
    executed = sum(p["executed"] for p in found)
    wavefronts = sum(p["wavefronts"] for p in found)
    excess = sum(p["excess"] for p in found)
    per = args.per
    print(f"in all: {executed / per:.0f} instructions, {wavefronts / per:.0f} shared wavefronts "
          f"({excess / per:.0f} over the ideal: {100 * excess / (wavefronts or 1):.0f}%)")
    print(f"{'phase':>5} {'instructions':>12} {'stalls':>7} {'wavefronts':>10} {'excess':>7}  "
          "top stall reasons | top opcodes")
    for i, p in enumerate(found):
        if p["executed"] == 0 and p["samples"] == 0:
            continue
        stalls = sorted(p["stalls"].items(), key=lambda kv: -kv[1])[:3]
        ops = sorted(p["opcodes"].items(), key=lambda kv: -kv[1])[:5]
        print(f"{i:>5} {p['executed'] / per:>12.0f} {100 * p['samples'] / samples:>6.1f}% "
              f"{p['wavefronts'] / per:>10.0f} {p['excess'] / per:>7.0f}  "
              + ", ".join(f"{name} {100 * v / samples:.1f}%" for name, v in stalls) + " | "
              + ", ".join(f"{name} {v / per:.0f}" for name, v in ops))
    if args.top <= 0:
        return
    print(f"instructions with the most excess shared wavefronts (phase, address, excess, ideal, executed):")
    ranked, phase = [], 0
    for row in rows:
        source = row[col["Source"]].strip()
        ranked.append((number(row[col["L1 Wavefronts Shared Excessive"]]), phase, row[col["Address"]],
                       number(row[col["L1 Wavefronts Shared Ideal"]]), number(row[col["Instructions Executed"]]),
                       source))
        if opcode(source) == "BAR":
            phase += 1
    for extra, phase, address, ideal, count, source in sorted(ranked, key=lambda r: -r[0])[:args.top]:
        if extra <= 0:
            break
        print(f"  {phase:>3} {address[-6:]} {extra / per:8.1f} {ideal / per:8.1f} {count / per:7.1f}  {source[:70]}")


if __name__ == "__main__":
    main()

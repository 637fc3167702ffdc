#!/usr/bin/env python3
"""A kernel's instructions and warp stalls by source line, from an Nsight Compute report: where a
kernel spends its issue slots and its stalls, without the Nsight GUI. On the GPU machine (ncu is
/usr/local/cuda/bin/ncu there), with the kernel built with -lineinfo:

  ncu --section SourceCounters --section WarpStateStats --import-source yes \\
      -k regex:kda_chunk_gradient_kernel -c 1 -o /tmp/r  BINARY ARGS...
  ncu --import /tmp/r.ncu-rep --page source --csv --print-source cuda,sass > lines.csv
  scripts/ncu_hot_lines.py lines.csv [--top N] [--by stalls|instructions] [--opcodes]

Prints, for the top N source lines (default 30, ordered by stall samples), the share of the
kernel's executed instructions and of its warp-stall samples, and the line. An inlined helper's
instructions count for the helper's line (the CSV puts each SASS instruction under one line).
--opcodes adds the instruction mix (executed share and stall share per opcode). Needs nothing but
Python's standard library, so the CSV can be read on the CPU machine.
"""
import csv
import sys
from collections import defaultdict


def read(path):
    """(lines, opcodes): {(file, line): [executed, samples]}, {opcode: [executed, samples]}, and
    the source text of each line."""
    by_line = defaultdict(lambda: [0, 0])
    by_opcode = defaultdict(lambda: [0, 0])
    text = {}
    current_file, current_line = None, None
    executed_col = samples_col = None
    seen = set()
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                current_file = row[1]
                continue
            if row[0] == "Line No":
                # "Line No","Source","Address","Source","Warp Stall Sampling (All Samples)",...
                executed_col = row.index("Instructions Executed")
                samples_col = row.index("Warp Stall Sampling (All Samples)")
                continue
            if row[0] == "Function Name" or executed_col is None or len(row) <= executed_col:
                continue
            line_no, source, address, sass = row[0], row[1], row[2], row[3]
            if line_no:
                current_line = (current_file, int(line_no))
                text[current_line] = source
            # A line's own row (address "-") repeats the sum of the SASS rows under it: count those,
            # each address once (an instruction can be listed under more than one file).
            if not address.startswith("0x") or not sass or address in seen:
                continue
            seen.add(address)
            try:
                executed = int(row[executed_col] or 0)
                samples = int(row[samples_col] or 0)
            except ValueError:
                continue
            by_line[current_line][0] += executed
            by_line[current_line][1] += samples
            words = sass.split()
            opcode = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
            by_opcode[opcode.split(".")[0]][0] += executed
            by_opcode[opcode.split(".")[0]][1] += samples
    return by_line, by_opcode, text


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        print(__doc__)
        return 2
    top = int(args[args.index("--top") + 1]) if "--top" in args else 30
    key = 0 if "--by" in args and args[args.index("--by") + 1].startswith("instr") else 1
    by_line, by_opcode, text = read(args[0])
    executed = sum(v[0] for v in by_line.values()) or 1
    samples = sum(v[1] for v in by_line.values()) or 1
    print(f"{executed} instructions executed, {samples} stall samples")
    print(f"{'file:line':32s} {'inst':>6s} {'stall':>6s}  source")
    for (path, line), (e, s) in sorted(by_line.items(), key=lambda item: -item[1][key])[:top]:
        name = f"{(path or '?').split('/')[-1]}:{line}"
        print(f"{name:32s} {100 * e / executed:5.1f}% {100 * s / samples:5.1f}%  {text.get((path, line), '').strip()[:100]}")
    if "--opcodes" in args:
        print(f"\n{'opcode':10s} {'inst':>6s} {'stall':>6s}")
        for opcode, (e, s) in sorted(by_opcode.items(), key=lambda item: -item[1][0])[:top]:
            print(f"{opcode:10s} {100 * e / executed:5.1f}% {100 * s / samples:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

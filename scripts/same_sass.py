#!/usr/bin/env python3
"""Whether two builds of the kernels have the same machine code, kernel by kernel, without a GPU:
the .text section of every kernel in two cubins compared byte for byte (the names' anonymous
namespace, which depends on the file's path, left out). A refactor of device code that leaves
every kernel identical needs no new GPU run; one that does not is a change to measure.

  nvcc -O3 -std=c++17 -arch=sm_90 -I. -cubin kernels/kda.cu -o /tmp/old.cubin     (before)
  nvcc -O3 -std=c++17 -arch=sm_90 -I. -cubin kernels/kda.cu -o /tmp/new.cubin     (after)
  scripts/same_sass.py /tmp/old.cubin /tmp/new.cubin

Prints the kernels that differ and a count; exits 1 when any differs. scripts/sass_stats.py
--dump disassembles one to see how (needs Debian's nvdisasm; see its docstring).
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_stats import sections  # noqa: E402


def kernels(cubin):
    strip = lambda name: re.sub(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_[0-9a-f]{8,}", "ANON", name)
    return {strip(name): code for name, code in sections(cubin)}


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
    same = differ = 0
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(f"only in {'the second' if name in new else 'the first'}: {name}")
            differ += 1
        elif old[name] != new[name]:
            print(f"differs ({len(old[name]) // 16} -> {len(new[name]) // 16} instructions): {name}")
            differ += 1
        else:
            same += 1
    print(f"{same} kernels identical, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

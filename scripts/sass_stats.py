#!/usr/bin/env python3
"""SASS statistics of the kernels in a cubin, without a GPU: what the kernels/README ladder cites
(instruction counts, MUFU, LDS, LDSM, HMMA, LDGSTS, BAR, and the BRA.DIV of a divergence-guarded
second copy of warp-synchronous code).

  nvcc -O3 -std=c++17 -arch=sm_90 -I. -cubin kernels/kda.cu -o /tmp/kda.cubin
  scripts/sass_stats.py /tmp/kda.cubin [name-substring] [--dump FILE]

Needs nvdisasm. CUDA 13's cuobjdump is not on the CPU machine, and Debian's CUDA 11.8 tools cannot
read a CUDA 13 cubin's ELF. But Debian's nvdisasm disassembles the raw code of each .text section
with `-b SM90`, so this script cuts the sections out with readelf. To get it:
  echo 'Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' > /etc/apt/sources.list.d/nonfree.sources
  apt-get update && apt-get download nvidia-cuda-toolkit && dpkg-deb -x nvidia-cuda-toolkit_*.deb ex
  export NVDISASM=$PWD/ex/usr/bin/nvdisasm
"""
import os
import re
import subprocess
import sys


def sections(cubin):
    out = subprocess.run(["readelf", "-S", "-W", cubin], capture_output=True, text=True).stdout
    data = open(cubin, "rb").read()
    for line in out.splitlines():
        m = re.search(r"\]\s+\.text\.(\S+)\s+PROGBITS\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)", line)
        if m:
            offset, size = int(m.group(2), 16), int(m.group(3), 16)
            yield m.group(1), data[offset:offset + size]


def main():
    args = [a for a in sys.argv[1:]]
    dump = None
    if "--dump" in args:
        i = args.index("--dump")
        dump = args[i + 1]
        del args[i:i + 2]
    if not args:
        print(__doc__)
        return 2
    cubin, pattern = args[0], args[1] if len(args) > 1 else ""
    nvdisasm = os.environ.get("NVDISASM", "nvdisasm")
    found = False
    for name, code in sections(cubin):
        if pattern not in name:
            continue
        found = True
        with open("/tmp/sass_stats_section.bin", "wb") as f:
            f.write(code)
        r = subprocess.run([nvdisasm, "-b", "SM90", "/tmp/sass_stats_section.bin"], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{name}: nvdisasm failed: {r.stderr.strip()[:200]}")
            continue
        s = r.stdout
        if dump:
            with open(dump, "a") as f:
                f.write(f"// {name}\n{s}\n")
        count = lambda what: len(re.findall(what, s))
        print(f"{len(code) // 16:6d} instr  MUFU {count('MUFU'):4d}  LDS {count(' LDS'):4d}  LDSM {count('LDSM'):4d}  "
              f"HMMA {count('HMMA'):4d}  LDGSTS {count('LDGSTS'):3d}  BAR {count(' BAR'):3d}  "
              f"BRA.DIV {count('BRA.DIV'):2d}  {name}")
    if not found:
        print(f"no .text section matching '{pattern}' in {cubin}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

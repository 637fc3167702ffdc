#!/usr/bin/env python3
"""Interop between odyssey's safetensors reader/writer (model/safetensors.h) and the reference
Python implementation (the `safetensors` package, with torch and numpy).

  safetensors_interop.py read PATH
      Reads a file odyssey wrote, with safe_open (torch) for every tensor and safe_open (numpy)
      for every tensor numpy can hold (not BF16), checks both agree byte for byte, and prints
        tensor <name> <dtype> [<d0>,<d1>,...] <sum of the tensor's bytes>
        metadata <key>=<value>
        numpy ok
  safetensors_interop.py write TORCH_PATH NUMPY_PATH
      Writes the same tensors with safetensors.torch.save_file (every dtype, BF16 included) and
      with safetensors.numpy.save_file (every dtype but BF16), metadata {"writer": "python"}:
      base = arange(24) as [2, 3, 4]; floats (base - 7) * 0.5; ints base - 7; u8 base;
      bool base % 3 == 0; "transposed" the f32 tensor transposed (0, 2), made contiguous.

Run by SafetensorsInterop.* in tests/model/safetensors_test.cpp (ODYSSEY_PYTHON_SAFETENSORS=1).
"""
import sys

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch


def byte_sum(tensor: torch.Tensor) -> int:
    flat = tensor.contiguous().reshape(-1)
    return int(flat.view(torch.uint8).to(torch.int64).sum().item()) if flat.numel() else 0


def read(path: str) -> None:
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        torch_tensors = {}
        for name in sorted(f.keys()):
            view = f.get_slice(name)
            dtype, shape = view.get_dtype(), view.get_shape()
            tensor = f.get_tensor(name)
            assert list(tensor.shape) == list(shape), (name, tensor.shape, shape)
            torch_tensors[name] = tensor
            dims = ",".join(str(d) for d in shape)
            print(f"tensor {name} {dtype} [{dims}] {byte_sum(tensor)}")
    for key in sorted(metadata):
        print(f"metadata {key}={metadata[key]}")
    with safe_open(path, framework="np") as f:
        for name in f.keys():
            if f.get_slice(name).get_dtype() == "BF16":
                continue  # numpy has no bfloat16
            array = f.get_tensor(name)
            expected = torch_tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert np.ascontiguousarray(array).tobytes() == expected, f"numpy and torch disagree on {name}"
    print("numpy ok")


def reference_tensors() -> dict:
    base = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4)
    floats = (base - 7) * 0.5
    ints = (base - 7).to(torch.int64)
    return {
        "f64": floats,
        "f32": floats.to(torch.float32),
        "f16": floats.to(torch.float16),
        "bf16": floats.to(torch.bfloat16),
        "i64": ints,
        "i32": ints.to(torch.int32),
        "i16": ints.to(torch.int16),
        "i8": ints.to(torch.int8),
        "u8": base.to(torch.uint8),
        "bool": base.to(torch.int64) % 3 == 0,
        "transposed": floats.to(torch.float32).transpose(0, 2).contiguous(),
    }


def write(torch_path: str, numpy_path: str) -> None:
    tensors = reference_tensors()
    save_torch(tensors, torch_path, metadata={"writer": "python"})
    arrays = {name: t.numpy() for name, t in tensors.items() if t.dtype != torch.bfloat16}
    save_numpy(arrays, numpy_path, metadata={"writer": "python"})
    print(f"wrote {torch_path} ({len(tensors)} tensors) and {numpy_path} ({len(arrays)} tensors)")


def main(argv: list) -> int:
    if len(argv) == 3 and argv[1] == "read":
        read(argv[2])
    elif len(argv) == 4 and argv[1] == "write":
        write(argv[2], argv[3])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

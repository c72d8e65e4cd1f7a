"""Reading the CPU engine's ``model.safetensors`` through a memory map: tensors as views of the file, copied
only when the compute dtype asks for another one."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _safetensors_index(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start offset in bytes, header dict) of a .safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return 8 + n, header


_ST_DTYPES = {"F32": (np.float32, torch.float32), "BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, torch.float16)}


class Weights:
    """Tensors of the engine directory's ``model.safetensors`` files, read through a read-only mmap
    (only what is used becomes resident; :meth:`mapped` keeps a tensor file-backed)."""

    def __init__(self, engine_dir: Path):
        files = sorted(Path(engine_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{engine_dir}: no *.safetensors weights")
        self._where: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for f in files:
            start, header = _safetensors_index(f)
            for name, meta in header.items():
                if name != "__metadata__":
                    self._where[name] = (f, start, meta)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def mapped(self, name: str) -> torch.Tensor:
        """The tensor backed by the file's pages (read-only; do not write to it)."""
        f, start, meta = self._where[name]
        np_dtype, t_dtype = _ST_DTYPES[meta["dtype"]]
        a, b = meta["data_offsets"]
        arr = np.memmap(f, dtype=np_dtype, mode="r", offset=start + a, shape=tuple(meta["shape"]))
        import warnings

        with warnings.catch_warnings():  # read-only memmap: torch warns that it is not writable
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        return t.view(t_dtype) if t_dtype == torch.bfloat16 else t

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A private in-memory copy in ``dtype``."""
        return self.mapped(name).to(dtype=dtype, copy=True)

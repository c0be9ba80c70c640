"""Which floating-point type is fast on this machine: bf16 only where the hardware multiplies it natively.

On a CPU with AMX or AVX512-BF16 (the Intel machines most numbers in docs/results.md come from) a bf16
matmul runs ≈ 4× faster than fp32. On a CPU without them (an AVX2-only AMD EPYC, also seen on this project's
2-core machines) PyTorch emulates bf16 and the same matmul runs ≈ 6× *slower* than fp32: target generation
fell from 140 tok/s (fp32) to 30 tok/s (bf16), `python scripts/bench_generate.py --dtype ...`, docs/results.md.
So presets say ``target.dtype: auto`` and ``train.bf16: auto`` and the choice is made here, once per process,
from what the hardware reports rather than from a timing (a timing could flip between runs and change a
cache key). A GPU uses bf16 where CUDA supports it.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def hardware() -> dict:
    """What decides the choice, for run.json and error messages."""
    import torch

    info = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cuda": torch.cuda.is_available()}
    for flag in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        probe = getattr(torch.cpu, flag, None)  # private helpers: absent in some builds, then treated as False
        info[flag.strip("_").removeprefix("is_").removesuffix("_supported")] = bool(probe()) if probe else False
    if info["cuda"]:
        info["cuda_bf16"] = bool(torch.cuda.is_bf16_supported())
    return info


def bf16_is_fast() -> bool:
    """True where bf16 matmuls run natively: a bf16-capable GPU, or a CPU with AMX or AVX512-BF16."""
    info = hardware()
    if info["cuda"]:
        return info["cuda_bf16"]
    return info["amx_tile"] or info["avx512_bf16"]


def resolve_dtype(name: str) -> str:
    """``auto`` → ``bfloat16`` where bf16 is fast, else ``float32``; explicit names pass through."""
    if name == "auto":
        return "bfloat16" if bf16_is_fast() else "float32"
    return name


def resolve_bf16(value: bool | str) -> bool:
    """``train.bf16``: ``auto`` → autocast in bf16 only where it is fast; true/false pass through."""
    return bf16_is_fast() if value == "auto" else bool(value)

"""GPU memory as the recipe reports it: the peak, and whether an error means it ran out."""

from __future__ import annotations

import resource

import torch


def peak_memory(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) peak bytes; on CPU both are the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return rss, rss


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is CUDA running out of memory, however torch raised it: its
    OutOfMemoryError, a RuntimeError saying "out of memory" (the CUDA caching allocator,
    cuBLAS, NCCL, bitsandbytes), or an error raised from one (a failed checkpoint save or
    load, which reports each rank's error)."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [e]
    while todo and len(seen) < 32:
        err = todo.pop()
        if any(err is s for s in seen):
            continue
        seen.append(err)
        if isinstance(err, torch.OutOfMemoryError):
            return True
        if isinstance(err, RuntimeError) and "out of memory" in str(err).lower():
            return True
        failures = getattr(err, "failures", None)  # DCP: rank → (error, trace)
        if isinstance(failures, dict):
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(first, BaseException):
                    todo.append(first)
        if err.__cause__ is not None:
            todo.append(err.__cause__)
    return False

"""The CPU a command runs on, as /proc/cpuinfo describes it: recorded beside measurements and a depth
study's sittings, and asked before a run in bf16 on a CPU; and the memory /proc/meminfo says is free.
Nothing here starts a process (platform.processor() runs `uname -p`, which the fast tests refuse)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")


def cpuinfo_fields(cpuinfo: Path = CPUINFO) -> tuple[str, set[str]] | None:
    """The first processor's model name ("unknown" where none is given) and flags; None where the file
    cannot be read (not Linux)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return None
    model, flags = "unknown", None
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        if key.strip() == "flags" and flags is None:
            flags = set(value.split())
    return model, flags or set()


def native_bf16_cpu(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (the avx512_bf16 or amx_bf16 flag); elsewhere
    oneDNN emulates them, about 50x slower than fp32 (docs/BENCHMARKS.md). True where it cannot tell."""
    fields = cpuinfo_fields(cpuinfo)
    return fields is None or bool(fields[1] & {"avx512_bf16", "amx_bf16"})


def cpu() -> dict:
    """The CPU's model, its cores and those this process may use, and whether it has avx512_bf16."""
    model, flags = cpuinfo_fields() or ("unknown", set())
    return {
        "model": model,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "avx512_bf16": "avx512_bf16" in flags,
    }


def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name, else (not Linux, or none given) its architecture, which os.uname() gives
    without a process."""
    fields = cpuinfo_fields(cpuinfo)
    return fields[0] if fields and fields[0] != "unknown" else platform.machine() or "unknown"


def available_memory(meminfo: Path = MEMINFO) -> int | None:
    """Bytes this machine can still allocate without swapping (MemAvailable), None where it cannot tell."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key == "MemAvailable" and (words := value.split()) and words[0].isdigit():
            return int(words[0]) * 1024  # /proc/meminfo's kB are KiB
    return None

"""What a benchmark ran on, recorded beside its numbers (load average included: the
machines here are shared, and timing results mean little without it)."""

from __future__ import annotations

import os
import platform
import time

import psutil


def machine_info() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "load_average_1m_at_start": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d %H:%M")}

"""What the planner and the self-check know about accelerators: dense peak throughput, for model FLOPs utilisation."""

from __future__ import annotations

from typing import Optional

#: dense bf16 TFLOP/s per device (the vendors' figures without sparsity), matched by name
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0, "A10": 125.0}


def peak_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a device named ``device_name`` (e.g. ``"NVIDIA H100 80GB HBM3"``), or ``None``."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


"""What a kernel's config follows on this GPU: peak DRAM bandwidth per SM (more bytes in flight per SM
where it is high: the decode kernel's copy stages, the GEMV's tile) and programmatic dependent launch
(PDL) support."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton.language as tl

# peak DRAM bytes/s per SM above which the D 65-128 decode config takes a 2-stage copy pipeline:
# H100 SXM 3.35 TB/s over 132 SMs = 25 GB/s (1 stage measured best), H200 4.8 TB/s = 36 GB/s (2 stages)
STAGES_BW_PER_SM = 30e9


def memory_bandwidth_per_sm(props) -> Optional[float]:
    """Peak DRAM bandwidth per SM in bytes/s from CUDA device properties: two transfers a memory clock
    (memory_clock_rate, kHz) over memory_bus_width bits, over the SM count (H200: 4.81e12 / 132). None
    where the properties lack the memory clock or bus width (older torch)."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    sms = getattr(props, "multi_processor_count", 0) or 0
    if not (clock_khz and bus_bits and sms):
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / sms


def high_bandwidth_per_sm(bw_per_sm: Optional[float]) -> bool:
    """Whether a GPU of this peak bandwidth per SM (memory_bandwidth_per_sm; None: unknown) needs the
    configs with more bytes in flight per SM: above STAGES_BW_PER_SM (the H200, not the H100 SXM)."""
    return bw_per_sm is not None and bw_per_sm > STAGES_BW_PER_SM


@functools.lru_cache(maxsize=None)
def has_fp8(index: int) -> bool:
    """Whether CUDA device `index` is of compute capability 8.9+: FP8 tensor cores and the e4m3x2
    conversions (cached: asked by every FP8 product and 8-bit GEMV of an eager step)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch from Triton: an NVIDIA device (not ROCm) of compute capability
    9.0+ (the griddepcontrol instructions) and a Triton with ``tl.extra.cuda.gdc_wait`` (3.4+)."""
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return (device.type == "cuda" and getattr(torch.version, "hip", None) is None
            and torch.cuda.get_device_capability(device) >= (9, 0)
            and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents"))

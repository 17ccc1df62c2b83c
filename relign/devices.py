"""The devices a plan is made for: a named GPU of the table (its memory, bf16 peak and bandwidth),
or this machine's own (``cpu``: available RAM; ``cuda[:N]``: free memory). ``relign plan``,
``--dry-run`` and the refusal in ``frame.open`` read them (``relign/plan.py``); ``perf/mfu`` reads
the GPU table's peaks (``models/flops.PEAKS``)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class Device:
    """A device to plan for: its memory, what of it a run may use, and its bf16 peak and bandwidth."""

    key: str
    """The name ``--device`` / ``plan.device`` takes (h100, cpu, cuda:0 ...)."""
    name: str
    memory: int
    """Bytes the device has."""
    available: int
    """Bytes a run may allocate: free memory (local), or the memory less ``CUDA_RESERVE`` (named)."""
    tflops: float = 0.0
    """bf16 dense peak, TFLOP/s (0: unknown, no step time)."""
    tbs: float = 0.0
    """Memory bandwidth, TB/s."""


CUDA_RESERVE = GiB
"""A named GPU's memory a run cannot allocate: the CUDA context, cuBLAS workspaces and the caching
allocator's slack (the local CUDA device reports its free memory instead)."""

# key, the fragments of torch.cuda.get_device_name it matches, memory (MiB, as nvidia-smi reports it),
# bf16 dense TFLOP/s, HBM TB/s (vendors' data sheets). Most specific first: models/flops.PEAKS (perf/mfu,
# bench/gpu_checks.py) is read from this table.
GPUS: list[tuple[str, tuple[str, ...], int, float, float]] = [
    ("h100-pcie", ("H100 PCIe",), 81559, 756.0, 2.0),
    ("h100-nvl", ("H100 NVL",), 95830, 835.0, 3.9),
    ("h100", ("H100",), 81559, 989.0, 3.35),
    ("h200", ("H200",), 143771, 989.0, 4.8),
    ("b200", ("B200",), 183359, 2250.0, 8.0),
    ("a100-40", ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"), 40960, 312.0, 1.555),
    ("a100-80", ("A100",), 81920, 312.0, 2.039),
    ("l40s", ("L40S",), 46068, 362.0, 0.864),
    ("rtx4090", ("RTX 4090",), 24564, 165.2, 1.008),
]
ALIASES = {"a100": "a100-80", "4090": "rtx4090", "rtx-4090": "rtx4090", "h100-sxm": "h100"}


def named_device(key: str) -> Device:
    """The device of the table by its key (``h100``, ``a100-40``, ``rtx4090`` ...)."""
    k = ALIASES.get(key.lower(), key.lower())
    for gpu, _, mib, tflops, tbs in GPUS:
        if gpu == k:
            memory = mib * 2**20
            return Device(gpu, _device_title(gpu, mib), memory, memory - CUDA_RESERVE, tflops, tbs)
    raise ConfigError(f"bad value for 'plan.device': {key!r}; choose one of auto, cpu, cuda, {', '.join(g[0] for g in GPUS)}")


def _device_title(key: str, mib: int) -> str:
    names = {"h100-pcie": "H100 PCIe", "h100-nvl": "H100 NVL", "h100": "H100 SXM", "h200": "H200", "b200": "B200",
             "a100-40": "A100", "a100-80": "A100", "l40s": "L40S", "rtx4090": "RTX 4090"}
    marketed = {"h100-nvl": 94, "h200": 141, "b200": 180}  # the rest: the MiB rounded to a multiple of 8 GB
    return f"{names[key]} {marketed.get(key, round(mib / 1024 / 8) * 8)} GB"


def gpu_peak(cuda_name: str) -> tuple[float, float]:
    """(bf16 dense TFLOP/s, TB/s) of a GPU from its ``torch.cuda.get_device_name``; (0, 0) when unknown."""
    for _, fragments, _, tflops, tbs in GPUS:
        if any(f in cuda_name for f in fragments):
            return tflops, tbs
    return 0.0, 0.0


def available_ram(meminfo: str = "/proc/meminfo") -> int:
    """Bytes of RAM a new allocation can get now: psutil's ``available``, else MemAvailable."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no MemAvailable in {meminfo}")


def local_device(name: str = "auto") -> Device:
    """The device a run on this machine gets: ``cpu`` (available RAM), ``cuda[:N]`` (free memory, from
    ``torch.cuda.mem_get_info``), ``auto`` (CUDA when there is one), or a named GPU of the table."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        ram = available_ram()
        return Device("cpu", "this CPU (available RAM)", ram, ram)
    if name.startswith("cuda"):
        index = torch.device(name).index
        index = torch.cuda.current_device() if index is None else index  # a torchrun rank's own GPU
        free, total = torch.cuda.mem_get_info(index)
        gpu = torch.cuda.get_device_name(index)
        tflops, tbs = gpu_peak(gpu)
        return Device(name, f"{gpu} ({name}, free memory)", int(total), int(free), tflops, tbs)
    return named_device(name)

"""Instance catalog: the hardware facts the planner and the launchers rely on (stdlib only).

Figures are the vendors' published peak numbers (dense tensor-core TFLOP/s, no sparsity; for
fp32 the CUDA-core figure, which fp32 matrix products run at under PyTorch's default of no TF32)
and AWS's published instance specifications. Prices are on-demand list prices in us-east-1 (Linux)
as of ``PRICE_DATE`` from the AWS EC2 and SageMaker pricing pages; they change, so a spec can
override them with ``compute.price_per_hour``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass

PRICE_DATE = "2025-05"
PRICE_SOURCE = "AWS EC2 / Amazon SageMaker on-demand pricing pages, us-east-1, Linux"


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpu_model: str | None
    gpus: int
    gpu_memory_gib: float
    peak_bf16_tflops: float  # per GPU, dense; 0 where the GPU has no bf16 tensor cores
    peak_fp16_tflops: float  # per GPU, dense
    peak_fp32_tflops: float  # per GPU, dense, CUDA cores (no TF32)
    intra_node_gbytes_per_s: float  # per GPU, one direction (NVLink/NVSwitch or PCIe)
    network_gbits_per_s: float  # per instance
    efa_interfaces: int
    gpudirect_rdma: bool
    vcpus: int
    memory_gib: float
    ec2_price_per_hour: float | None
    sagemaker_price_per_hour: float | None
    price_date: str = PRICE_DATE
    price_source: str = PRICE_SOURCE

    @property
    def has_gpu(self) -> bool:
        return self.gpus > 0

    @property
    def is_local(self) -> bool:
        return self.name in ("local", "local_gpu")

    @property
    def on_sagemaker(self) -> bool:
        return self.sagemaker_price_per_hour is not None

    @property
    def on_ec2(self) -> bool:
        return self.ec2_price_per_hour is not None

    @property
    def peak_tflops(self) -> float:
        """Peak per-GPU TFLOP/s in the fastest half-precision format the GPU has."""
        return max(self.peak_bf16_tflops, self.peak_fp16_tflops)

    def peak_tflops_in(self, precision: str) -> float:
        """Peak per-GPU TFLOP/s when the model computes in ``precision`` (bf16, fp16, fp32)."""
        return {"bf16": self.peak_bf16_tflops, "fp16": self.peak_fp16_tflops,
                "fp32": self.peak_fp32_tflops}.get(precision) or self.peak_tflops

    def price_per_hour(self, target: str) -> float | None:
        return self.sagemaker_price_per_hour if target == "sagemaker" else self.ec2_price_per_hour

    def to_dict(self) -> dict:
        return asdict(self)


def _gpu(name, model, gpus, mem, bf16, fp16, fp32, intra, net, efa, rdma, vcpus, ram, ec2, sm):
    return InstanceType(name, model, gpus, mem, bf16, fp16, fp32, intra, net, efa, rdma, vcpus,
                        ram, ec2, sm)


_CATALOG = [
    # name            GPU     n  GiB  bf16   fp16  fp32  GB/s  Gb/s  EFA RDMA  vCPU  GiB  $EC2  $SM
    _gpu("p4d.24xlarge", "A100-40GB", 8, 40, 312, 312, 19.5, 300, 400, 4, True, 96, 1152, 32.7726, 37.688),
    _gpu("p4de.24xlarge", "A100-80GB", 8, 80, 312, 312, 19.5, 300, 400, 4, True, 96, 1152, 40.9657, 47.11),
    _gpu("p5.48xlarge", "H100-80GB", 8, 80, 989, 989, 67, 450, 3200, 32, True, 192, 2048, 98.32, 113.07),
    _gpu("p5e.48xlarge", "H200-141GB", 8, 141, 989, 989, 67, 450, 3200, 32, True, 192, 2048, 108.15, None),
    _gpu("p5en.48xlarge", "H200-141GB", 8, 141, 989, 989, 67, 450, 3200, 16, True, 192, 2048, 110.47, 124.38),
    _gpu("p3dn.24xlarge", "V100-32GB", 8, 32, 0, 125, 15.7, 150, 100, 1, False, 96, 768, 31.212, 35.894),
    _gpu("p3.16xlarge", "V100-16GB", 8, 16, 0, 125, 15.7, 150, 25, 0, False, 64, 488, 24.48, 28.152),
    _gpu("g5.12xlarge", "A10G-24GB", 4, 24, 70, 70, 31.2, 16, 40, 1, False, 48, 192, 5.672, 7.09),
    _gpu("g5.48xlarge", "A10G-24GB", 8, 24, 70, 70, 31.2, 16, 100, 1, False, 192, 768, 16.288, 20.36),
    _gpu("g6e.48xlarge", "L40S-48GB", 8, 48, 362, 362, 91.6, 32, 400, 4, False, 192, 1536, 30.131, 37.66),
    # This machine. CPU "GPUs" are processes; figures are nominal, for rough local estimates.
    _gpu("local", None, 0, 0, 0, 0, 0, 5, 40, 0, False, 0, 0, 0.0, None),
    # This machine's GPUs: count and model are read when the job starts, not here.
    _gpu("local_gpu", "local", 1, 0, 0, 0, 0, 0, 0, 0, False, 0, 0, 0.0, None),
]

CATALOG: dict[str, InstanceType] = {t.name: t for t in _CATALOG}
# Nominal compute of one CPU worker process, used only to estimate local step times.
LOCAL_CPU_TFLOPS = 0.1


def gpu_peak_tflops(device_name: str) -> float:
    """The catalog's peak half-precision TFLOP/s for a GPU named as the driver names it
    (``torch.cuda.get_device_name``, e.g. "NVIDIA H100 80GB HBM3"), or 0 for a GPU the catalog
    does not have. Matched on the model word ("H100", "A100", "A10G"), so a machine outside AWS
    with a catalog GPU gets the same figure as the instance type that carries it."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for t in _CATALOG:
        if t.gpu_model and t.gpu_model.split("-")[0].upper() in words:
            return t.peak_tflops
    return 0.0


def canonical_name(name: str) -> str:
    """``ml.p4d.24xlarge`` → ``p4d.24xlarge``; the catalog keys carry no ``ml.`` prefix."""
    return name.removeprefix("ml.")


def get(name: str) -> InstanceType:
    """Look up an instance type by its EC2 or SageMaker (``ml.``) name."""
    key = canonical_name(name)
    if key in CATALOG:
        return CATALOG[key]
    # only a type of the same family is a likely typo (p4d.12xlarge -> p4d.24xlarge); a family
    # the catalog lacks (p9) gets no guess, just the list
    family = key.split(".", 1)[0]
    same_family = [t for t in CATALOG if t.split(".", 1)[0] == family]
    close = difflib.get_close_matches(key, same_family, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"unknown instance type {name!r}; {hint}known types: {', '.join(CATALOG)}"
    )


def efa_environment(instance_type: str, network_interface_name: str | None) -> dict[str, str]:
    """NCCL/libfabric settings for EFA instance types (per the catalog); empty elsewhere.

    Without ``network_interface_name`` (a Slurm job's script, written before a node is known)
    the settings that do not name an interface."""

    try:
        facts = get(instance_type)
    except ValueError:
        return {}  # a type the catalog does not know: leave NCCL to its defaults
    if not facts.efa_interfaces:
        return {}
    env = {"FI_PROVIDER": "efa"}
    if network_interface_name:
        env["NCCL_SOCKET_IFNAME"] = network_interface_name
    if facts.gpudirect_rdma:
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return env

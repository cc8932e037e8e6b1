"""Hardware profiles: the devices and links a plan is priced on, from their datasheets.

``hardware=<profile>`` (the config group ``conf/hardware/``) picks one; ``this_host`` (the default)
means "calibrate the machine the planner runs on", which is what the dry run and ``+parallel=auto``
did before profiles existed. Any other profile describes a cluster the planner never touches: a
node of ``devices_per_node`` GPUs joined by ``intra_node`` (NVLink / NVSwitch), nodes joined by
``inter_node`` (InfiniBand / RoCE, one NIC per GPU), with the device's peak FLOP/s per dtype, its
memory and memory bandwidth, and what the runtime (CUDA context, NCCL buffers, the caching
allocator) holds beside the tensors. Every number carries its source: a datasheet, NCCL's own
model, or a stated estimate. ``docs/hardware.md`` lists them side by side.

    python -m trainer dry_run=true hardware=h100_sxm launch.nnodes=32 +parallel=3d mesh=[8,4,8]

A profile of your own is a YAML file ``<dir>/hardware/<name>.yaml`` with the keys below, picked by
``hardware=<name> hydra.searchpath=[file:///abs/<dir>]``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from parallel.config import Section as _Section

HOST_PROFILE = "this_host"  # the profile that means "calibrate this machine" (today's behaviour)
TFLOPS_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
TflopsDtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]


class Link(_Section):
    """One kind of link between devices, as NCCL sees it from one device."""

    bandwidth_gb_s: float = Field(..., gt=0, description="Bus bandwidth one device reaches on this link in one "
                                  "direction, in GB/s (1e9 B/s): what NCCL's bus bandwidth (nccl-tests' busbw) "
                                  "reaches for large messages, not the bidirectional figure of a datasheet.")
    latency_us: float = Field(..., ge=0, description="Latency of one algorithm step (one hop) on this link, in "
                              "microseconds (NCCL's per-step hardware latency).")
    source: str = Field(..., min_length=1, description="Where the two numbers come from (document, URL, table).")


class RuntimeMemory(_Section):
    """Device memory the runtime holds beside the model's tensors, per process."""

    cuda_context_gib: float = Field(..., ge=0, description="CUDA context and loaded kernels (cuBLAS, cuDNN, "
                                    "PyTorch's), per process, in GiB.")
    nccl_gib: float = Field(..., ge=0, description="NCCL's buffers per process for a typical run (several "
                            "communicators: one per mesh axis and its algorithms), in GiB.")
    allocator_slack: float = Field(..., ge=0, description="Fraction of the live tensor bytes PyTorch's caching "
                                   "allocator holds on top (fragmentation, block rounding): reserved = live * "
                                   "(1 + allocator_slack).")
    source: str = Field(..., min_length=1, description="How the three numbers were measured or estimated.")


class Achieved(_Section):
    """What the device's kernels reach, as fractions of the datasheet's peaks: the cost model's
    roofline (:mod:`trainer.planner.cost.device`) prices every op of a step with these."""

    matmul: float = Field(..., gt=0, le=1, description="A large bf16 GEMM's achieved FLOP/s over the peak (cuBLAS, "
                          "e.g. 8192^3); smaller GEMMs lose more to wave quantisation over `sm_count`.")
    matmul_half_gflop: float = Field(15.0, ge=0, description="The GEMM size, in GFLOP (2 m k n / 1e9), at which "
                                     "half of `matmul` is reached in bf16 (measured over a sweep of decoder shapes): a "
                                     "GEMM costs this many FLOPs' time at the bf16 rate on top of its own FLOPs' "
                                     "(prologue and tail: a fixed time per GEMM, the same in every precision).")
    attention_forward: float = Field(..., gt=0, le=1, description="torch's flash attention forward (causal, head "
                                     "dim 128, 2k tokens): achieved FLOP/s over the peak.")
    attention_backward: float = Field(..., gt=0, le=1, description="Its backward (2.5x the forward's FLOPs).")
    memory: float = Field(..., gt=0, le=1, description="A streaming kernel's (a device copy's) bytes read + "
                          "written per second over the memory bandwidth.")
    compiled_elementwise: float = Field(1.0, gt=0, le=1, description="With train.compile=true: the share of the "
                                        "eager elementwise ops' time left once Inductor fuses them (1 = no effect "
                                        "known).")
    kernel_us: float = Field(..., ge=0, description="The least one op of an eager step costs: launch and the "
                             "framework's dispatch on the host CPU, in microseconds.")
    fitted_to: str | None = Field(None, description="The published run (tests/bench/published.py) a number here "
                                  "was fitted to, if any: the benchmark leaves that row out of its error.")
    source: str = Field(..., min_length=1, description="How each number was measured, fitted or assumed.")


class HardwareProfile(_Section):
    """The hardware a run is planned for; ``this_host`` (the default) calibrates the machine at hand."""

    name: str = Field(HOST_PROFILE, min_length=1, description="Profile name; `this_host` = calibrate the machine the "
                      "planner runs on (the other keys are then unused).")
    # The default is this_host.yaml's own line: a config composed without the group (REST) equals the CLI's.
    description: str = Field("this machine, measured by the planner's calibration (no datasheet numbers)",
                             description="One line saying what the profile is (part, node, network).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="The device kind of the profile: `cuda` for a GPU "
                                           "profile, which must state every key below.")
    devices_per_node: int | None = Field(None, ge=1, description="Devices in one node (8 in a DGX / HGX node); "
                                         "launch.nnodes nodes hold the mesh.")
    memory_gb: float | None = Field(None, gt=0, description="Device memory in decimal GB, as the datasheet states "
                                    "it (80 for an 80 GB part).")
    memory_bandwidth_gb_s: float | None = Field(None, gt=0, description="Device memory bandwidth in GB/s "
                                                "(datasheet peak).")
    peak_tflops: dict[TflopsDtype, float] = Field(
        default_factory=dict, description="Dense peak TFLOP/s per dtype (no 2:4 sparsity), keys among fp32, tf32, "
        "bf16, fp16, fp8. fp32 is the non-tensor-core rate; tf32 the tensor-core rate fp32 matmuls reach when "
        "TF32 is allowed.")
    power_w: float | None = Field(None, gt=0, description="The power limit the numbers assume, in W.")
    intra_node: Link | None = Field(None, description="The link between devices of one node (NVLink / NVSwitch): "
                                    "bandwidth_gb_s, latency_us, source.")
    inter_node: Link | None = Field(None, description="The link between nodes per device (InfiniBand / RoCE; DGX "
                                    "and HGX nodes have one NIC per GPU): bandwidth_gb_s, latency_us, source.")
    sm_count: int | None = Field(None, ge=1, description="Streaming multiprocessors per device: the unit of a "
                                 "GEMM's wave quantisation.")
    achieved: Achieved | None = Field(None, description="Fractions of the peaks the device's kernels reach: matmul, "
                                      "attention_forward, attention_backward, memory, kernel_us, fitted_to, source.")
    runtime_memory: RuntimeMemory | None = Field(None, description="Memory the runtime holds per process beside "
                                                 "the tensors: cuda_context_gib, nccl_gib, allocator_slack, source.")
    sources: dict[str, str] = Field(default_factory=dict, description="Citation per key (datasheet, URL, page or "
                                    "table), e.g. sources.memory_gb.")

    def missing_gpu_keys(self) -> list[str]:
        """The keys a GPU profile must state and this one leaves empty (validation refuses a ``cuda``
        profile that has any: :func:`trainer.validate.checks.check_hardware`)."""
        missing = [key for key in ("devices_per_node", "memory_gb", "memory_bandwidth_gb_s", "intra_node",
                                   "inter_node", "runtime_memory", "sm_count", "achieved") if getattr(self,
                                                                                                      key) is None]
        missing += [f"peak_tflops.{dtype}" for dtype in ("bf16", "fp32") if dtype not in self.peak_tflops]
        return missing

    @property
    def is_host(self) -> bool:
        """True for ``this_host``: calibrate the machine at hand instead of reading datasheet numbers."""
        return self.name == HOST_PROFILE

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes (``memory_gb`` * 1e9)."""
        if self.memory_gb is None:
            raise ValueError(f"hardware profile {self.name!r} states no memory_gb")
        return self.memory_gb * 1e9

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (``peak_tflops[dtype]`` * 1e12); an error naming the profile's
        dtypes when it states none for this one."""
        if dtype not in self.peak_tflops:
            raise KeyError(f"hardware profile {self.name!r} states no peak_tflops.{dtype} "
                           f"(it has {sorted(self.peak_tflops)})")
        return self.peak_tflops[dtype] * 1e12

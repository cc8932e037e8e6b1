"""What prices a layout's step: this host's calibration, or a hardware profile (``hardware=...``).

    pricing = pricing_for(cfg, calibration=cal)         # HostPricing (this_host) or ProfilePricing
    costs = pricing.unit_costs(cfg, plan, micro, model)  # the meta pass, cached by a planner
    pricing.keep(cfg, plan, micro, costs)                 # (the planner's choice:) answered from memory next time
    step = pricing.step(cfg, plan, costs, model)         # a StepTime
    bound = pricing.lower_bound(cfg, plan, params, flops_per_sequence)
    floor = pricing.compute_floor(cfg, plan, params, flops_per_sequence)   # <= bound, no collective priced

The auto-planner and the dry run ask one of these and never which: ``hardware=this_host`` (the
default) prices with the probe of this host's workers (:mod:`trainer.planner.cost.model`), a GPU
profile with the datasheet and achieved rates of its devices and links (:mod:`trainer.planner.cost.device`),
which needs no such device and starts no process.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from parallel.pipeline.order import expected_bubble
from parallel.plan.spec import ParallelPlan
from trainer.config.hardware import HardwareProfile
from trainer.config.schema import RunConfig
from trainer.planner.cost.calibration import Calibration
from trainer.planner.cost.device import ProfileStep, device_unit_costs, lower_bound_on_profile, predict_on_profile
from trainer.planner.cost.model import StepTime, lower_bound_s, predict_step_time, unit_costs
from trainer.planner.cost.speed import DeviceSpeed
from trainer.planner.memory.pass_cache import PassCache, pass_key


# A layout's unit costs kept for the process by all they depend on (pass_key's, and what prices them): the
# auto-planner leaves its choice's here (priced by two alike blocks, exact for every deeper one), so the dry run of
# that layout prints the step its ranking showed without tracing the whole model again (gpt_175b: seconds).
COSTS = PassCache(size=8)


def _costs_key(cfg: RunConfig, plan: ParallelPlan, micro: int, pricer: str) -> tuple | None:
    # None: the costs hold for any attention (pass_key's annotation says Callable; memory/pass_cache.py is to
    # widen it to Callable | None, when this ignore goes)
    key = pass_key(cfg, plan, micro, None)  # type: ignore[arg-type]
    return None if key is None else (key, pricer, cfg.train.compile)


@dataclass(frozen=True)
class HostPricing:
    """This host, as its probe measured it with the run's workers."""

    calibration: Calibration

    def unit_costs(self, cfg: RunConfig, plan: ParallelPlan, micro: int, model: nn.Module):
        key = _costs_key(cfg, plan, micro, "host")  # what a pass counts: no calibration in it
        return COSTS[key] if key is not None and key in COSTS else unit_costs(cfg, plan, micro, model=model)

    def keep(self, cfg: RunConfig, plan: ParallelPlan, micro: int, costs: dict) -> None:
        """Keep ``costs`` as :meth:`unit_costs`' answer for this layout (see :data:`COSTS`)."""
        if (key := _costs_key(cfg, plan, micro, "host")) is not None:
            COSTS[key] = costs

    def step(self, cfg: RunConfig, plan: ParallelPlan, costs, model: nn.Module, params: dict | None = None) -> StepTime:
        return predict_step_time(cfg, plan, self.calibration, costs=costs, model=model)

    def lower_bound(self, cfg: RunConfig, plan: ParallelPlan, params: dict, flops_per_sequence: float) -> float:
        return lower_bound_s(cfg, plan, self.calibration, params, flops_per_sequence)

    def compute_floor(self, cfg: RunConfig, plan: ParallelPlan, params: dict, flops_per_sequence: float) -> float:
        """A floor of :meth:`lower_bound` (here the bound itself: a host's meshes are small)."""
        return self.lower_bound(cfg, plan, params, flops_per_sequence)

    def describe(self) -> str:
        from trainer.planner.calibration.probe import describe  # start-up: only a planner pays for it

        return describe(self.calibration)


@dataclass(frozen=True)
class ProfilePricing:
    """The devices and links of a hardware profile; nothing of this host is measured."""

    profile: HardwareProfile

    def unit_costs(self, cfg: RunConfig, plan: ParallelPlan, micro: int, model: nn.Module):
        if (key := _costs_key(cfg, plan, micro, self.profile.model_dump_json())) is not None and key in COSTS:
            return COSTS[key]
        # As predict_on_profile prices a pass it runs itself: train.compile's fused elementwise work included.
        speed = DeviceSpeed.of(self.profile, cfg.train.precision, compiled=cfg.train.compile)
        return device_unit_costs(cfg, plan, micro, speed, model=model)

    def keep(self, cfg: RunConfig, plan: ParallelPlan, micro: int, costs: dict) -> None:
        """Keep ``costs`` as :meth:`unit_costs`' answer for this layout (see :data:`COSTS`)."""
        if (key := _costs_key(cfg, plan, micro, self.profile.model_dump_json())) is not None:
            COSTS[key] = costs

    def step(self, cfg: RunConfig, plan: ParallelPlan, costs, model: nn.Module,
             params: dict | None = None) -> ProfileStep:
        return predict_on_profile(cfg, plan, self.profile, costs=costs, model=model, params=params)

    def lower_bound(self, cfg: RunConfig, plan: ParallelPlan, params: dict, flops_per_sequence: float) -> float:
        return lower_bound_on_profile(cfg, plan, self.profile, params, flops_per_sequence)

    def compute_floor(self, cfg: RunConfig, plan: ParallelPlan, params: dict, flops_per_sequence: float) -> float:
        """A floor of :meth:`lower_bound` that prices no collective: the step's FLOPs shared perfectly at the
        fastest achieved rate, stretched by the bubble (what the bound starts from)."""
        t, pp = cfg.train, plan.pipeline
        speed = DeviceSpeed.of(self.profile, t.precision, compiled=t.compile)
        compute = flops_per_sequence * t.global_batch_size / plan.mesh.world_size / max(speed.matmul_flops,
                                                                                         *speed.attention_flops)
        bubble = expected_bubble(pp.schedule, pp_size=plan.pp_size, stages_per_rank=pp.stages_per_rank,
                                 microbatches=pp.num_microbatches) if pp else 0.0
        return compute / (1.0 - bubble)

    def describe(self) -> str:
        p, a = self.profile, self.profile.achieved
        # a GPU profile has them all (HardwareProfile's validator)
        assert a is not None and p.intra_node is not None and p.inter_node is not None, "a GPU profile's figures"
        return (f"hardware {p.name}: {p.description}; {p.devices_per_node} devices per node, "
                f"{p.memory_gb:g} GB at {p.memory_bandwidth_gb_s:,.0f} GB/s, peak "
                + ", ".join(f"{k} {v:g}" for k, v in p.peak_tflops.items()) + " TFLOP/s; achieved: GEMM "
                f"{a.matmul:.0%}, attention {a.attention_forward:.0%} / {a.attention_backward:.0%}, HBM "
                f"{a.memory:.0%}, "
                f"{a.kernel_us:g} us per kernel; links: node {p.intra_node.bandwidth_gb_s:g} GB/s, "
                f"network {p.inter_node.bandwidth_gb_s:g} GB/s per device")


def pricing_for(cfg: RunConfig, *, calibration: Calibration | None = None) -> HostPricing | ProfilePricing:
    """The profile's pricing for a GPU profile; else this host's ``calibration`` (the auto-planner
    probes it: :func:`trainer.planner.auto.plan.host_calibration`)."""
    if not cfg.hardware.is_host:
        return ProfilePricing(cfg.hardware)
    if calibration is None:
        raise ValueError("hardware=this_host is priced by this host's calibration: pass one")
    return HostPricing(calibration)

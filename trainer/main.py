"""The entry point behind ``python -m trainer``: compose (Hydra) -> validate -> launch.

Hydra stays here at the edge: the composed config becomes a plain dict, then a frozen
pydantic :class:`~trainer.config.RunConfig`. A bad config exits with code 2 before any
worker starts, printing each problem as ``path: reason (fix)``.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from trainer.compose import CONF_DIR, register_defaults, to_plain
from parallel.errors import ConfigError
from trainer.launch import EXIT_CONFIG, launch
from trainer.validate import validate_with_plan


_BATCH_PATHS = {"train.global_batch_size", "parallel.pipeline.microbatches"}
register_defaults()  # the base config Hydra composes from: the pydantic models' defaults


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(composed: DictConfig) -> None:
    raw = to_plain(composed)
    try:
        cfg, plan = validate_with_plan(raw)
    except ConfigError as err:
        if raw.get("dry_run") is True and all(i.path in _BATCH_PATHS for i in err.issues):
            _plan_despite_batch(raw, err)
            return
        print(err, file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if cfg.validate_only:
        print(f"config OK: {cfg.model.arch} model, mesh {list(cfg.mesh_shape)} "
              f"({cfg.world_size} worker{'s' if cfg.world_size > 1 else ''}), {cfg.train.steps} steps")
        return
    if cfg.dry_run:
        from trainer.plan import describe_plan

        print(describe_plan(cfg, plan))
        _write_pictures(cfg, plan)
        return
    sys.exit(launch(cfg))


def _write_pictures(cfg, plan) -> None:
    """The dry run's placement picture and table, under ./meshflow-plan (``tracking.pictures``)."""
    if cfg.tracking.pictures:
        from trainer.placement_picture import DRY_RUN_DIR, write_placement

        paths = write_placement(cfg, plan, DRY_RUN_DIR)
        print(f"placement picture: {paths['png'].resolve()}\nplacement table: {paths['json'].resolve()}")


def _plan_despite_batch(raw: dict, err: ConfigError) -> None:
    """A plan for a big mesh is useful before the batch arithmetic is settled; all else must hold."""
    from trainer.config import RunConfig
    from trainer.model_checks import check_against_model
    from trainer.plan import describe_plan

    cfg = RunConfig.model_validate(raw)
    plan, issues = check_against_model(cfg)
    if issues:
        print(ConfigError(err.issues + issues), file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    print(describe_plan(cfg, plan))
    _write_pictures(cfg, plan)
    print(f"\nthis config would be refused at launch:\n{err}")

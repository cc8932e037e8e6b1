"""``python -m trainer [overrides]``: compose -> validate -> launch -> train.

    python -m trainer                                # one device, default model and data
    python -m trainer +parallel=3d mesh=[2,2,2]      # 8 workers: dp x pp x tp
    python -m trainer validate_only=true +parallel=tp mesh=[4]
    python -m trainer --cfg job                      # print the resolved config
    python -m trainer --help                         # every config key, documented
    python -m trainer --multirun optim.lr=1e-3,3e-3  # a sweep: one parent MLflow run, a child per job
"""

import sys
import time

STARTED = time.monotonic()  # the process's start, near enough: the run's summary counts its wall time from here
FIRST_LINE = "python -m trainer: composing the config, then checking it against the model ..."

if __name__ == "__main__":
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        from trainer.cli.help import print_help

        print_help()
        sys.exit(0)
    # before the imports below (Hydra, pydantic, then torch: seconds, many more on a busy host), so that
    # the user sees at once that the command started; stderr keeps stdout the command's output
    print(FIRST_LINE, file=sys.stderr, flush=True)
    from trainer.cli.main import main, refuse_unknown_group_options
    from trainer.config.compose import forgiving_overrides

    refuse_unknown_group_options(sys.argv[1:])  # Hydra would dump its search path and exit 1
    sys.argv[1:] = forgiving_overrides(sys.argv[1:])  # before Hydra reads them
    # a sweep's: its first failed job's code; a single run has already exited with its own
    sys.exit(main(started=STARTED))

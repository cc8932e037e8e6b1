"""``python -m trainer.launch CONFIG.json [--node-rank N | --node-rank-env VAR] ...``: launch a config that
was validated elsewhere (the control plane's ``job.json``), this node's share of it.
See :func:`trainer.launch.launcher.main`."""

import sys

if __name__ == "__main__":
    if sys.argv[1:] and not sys.argv[1].startswith("-"):
        # A job's log has a line from its first second: the imports below (torch, MLflow) take several.
        print(f"launching {sys.argv[1]}", flush=True)
    from trainer.launch.launcher import main  # start-up: after the line above

    sys.exit(main())

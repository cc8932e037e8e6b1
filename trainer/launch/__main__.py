"""``python -m trainer.launch CONFIG.json [--node-rank N | --node-rank-env VAR] ...``: launch a config that
was validated elsewhere (the control plane's ``job.json``), this node's share of it.
See :func:`trainer.launch.launcher.main`."""

import sys

from trainer.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())

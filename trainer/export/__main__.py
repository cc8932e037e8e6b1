"""``python -m trainer.export CHECKPOINT [--format safetensors|hf|peft] [--out PATH]``: weights out.
See :func:`trainer.export.weights.main`."""

import sys

from trainer.export.weights import main

if __name__ == "__main__":
    sys.exit(main())

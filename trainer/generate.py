"""``python -m trainer.generate CHECKPOINT --prompt "..."``: sample text from any checkpoint.
The command's home; the sampling lives in :mod:`trainer.export.generate`."""

import sys

from trainer.export.generate import main

if __name__ == "__main__":
    sys.exit(main())

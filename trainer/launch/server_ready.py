"""Imported last by the workers' fork server (:mod:`trainer.launch.processes`), after torch and the
training loop: their objects move to the collector's permanent generation, so that a worker's
garbage collections do not write to (and so copy) the pages it shares with the server. A worker's
memory then grows by what it allocates, as a spawned one's does (the CPU memory meter counts the
resident high-water mark: trainer.run.metrics.MemoryMeter).
"""

import gc

gc.collect()
gc.freeze()

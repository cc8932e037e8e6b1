"""Published training runs, one module per source family; ``published.py`` beside this folder
assembles them into ``published.PUBLISHED_RUNS`` (see its docstring for every source).

* :mod:`published_rows.schema`: the row's dataclasses (model shape, layout, what was reported).
* :mod:`published_rows.llm_foundry`: MosaicML llm-foundry's MPT throughput tables (FSDP).
* :mod:`published_rows.nanotron`: Hugging Face nanotron's best layouts per model and cluster size
  (tensor x pipeline x data, H100, MFU and memory).
* :mod:`published_rows.dgxc`: NVIDIA's DGX Cloud recipes, Megatron tensor x pipeline (interleaved)
  on H100 (step time, tokens/s, MFU).
* :mod:`published_rows.dgxc_cp`: the same recipes for Llama 3.1 8B / 70B / 405B with context
  parallel 2 (beside tensor x pipeline for the 70B and 405B).
"""

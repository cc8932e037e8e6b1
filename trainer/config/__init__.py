"""The run configuration: the frozen pydantic models (the single source of truth for every key) and Hydra's composition
of conf/ into a plain dict."""

"""Executors: where and how the control plane runs a job (``base.Executor``); one module per engine."""

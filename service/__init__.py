"""Job orchestration without HTTP: job store, queue, runner (built by the control-plane issue)."""

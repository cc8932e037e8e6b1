"""The FastAPI control plane (built by the control-plane issue)."""

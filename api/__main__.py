"""``python -m api [--host H] [--port P]``: serve the control plane with uvicorn (settings: MESHFLOW_*)."""

from __future__ import annotations

import argparse
import os

from service import fork_server
from service.settings import Settings


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m api", description=__doc__)
    parser.add_argument("--host", help="bind address (default: MESHFLOW_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default: MESHFLOW_PORT or 8000)")
    parser.add_argument("--log-level", default="info", help="uvicorn log level")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides)
    os.umask(0o077)  # everything the server writes in the workspace is its own: files 600, dirs 700
    if settings.validation_workers > 0:
        fork_server.start()  # the validation workers' imports (seconds) beside the app's, below
    # start-up: imported after the fork server started, so that its imports and these run side by side
    from api.main import create_app
    from service.mlflow_runs import ui_notice

    assert settings.mlflow_tracking_uri is not None, "Settings fills it in"
    print(ui_notice(settings.mlflow_tracking_uri, settings.mlflow_ui_url), flush=True)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level)


if __name__ == "__main__":
    main()

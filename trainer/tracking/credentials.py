"""A tracking URI's credentials travel apart from the config: the config names the store, the
environment holds the key.

    strip_credentials("postgresql://me:pw@db/mlflow")   # "postgresql://db/mlflow"
    MlflowClient(tracking_uri=connect_uri(cfg.tracking_uri))

The control plane stores every job's config with the URI stripped, so job rows, API replies,
Kubernetes ConfigMaps and the Ray entrypoint never hold a password, and hands the job the whole
URI in ``$MLFLOW_TRACKING_URI`` (a Kubernetes Secret reference, Ray's runtime environment, a local
job's environment). The trainer connects with the environment's URI only when, stripped, it *is*
the config's: the environment adds credentials to the store the config names, it never moves a run
to another store. MLflow's own ``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD`` / ``_TOKEN`` reach an
http(s) server the same way, without any URI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
# MLflow's REST client reads these itself (basic auth, bearer token).
MLFLOW_AUTH_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def strip_credentials(uri: str) -> str:
    """``uri`` without its ``user:password@`` part; any other string as it is."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # not a URL (a bad port, a stray bracket): nothing to strip
        return uri
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def has_credentials(uri: str) -> bool:
    return strip_credentials(uri) != uri


def connect_uri(uri: str, environ: Mapping[str, str] | None = None) -> str:
    """The URI to connect to the store ``uri`` names: ``$MLFLOW_TRACKING_URI`` when that is the same
    store with credentials, else ``uri`` itself."""
    full = (os.environ if environ is None else environ).get(TRACKING_URI_ENV)
    return full if full and strip_credentials(full) == uri else uri

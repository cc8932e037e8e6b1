"""An in-memory Kubernetes API server behind the official client's transport.

``FakeApiServer`` stands in for urllib3's pool manager inside a real ``kubernetes.client.ApiClient``:
every request the executor makes goes through the client's own URL building, serialization and
deserialization, and is answered here from a dict of stored objects (JobSets, ConfigMaps, pods) and
recorded in ``calls``. Only the routes the Kubernetes executor uses exist; any other is a 404 the
test sees.
"""

from __future__ import annotations

import copy
import io
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import urllib3

HOST = "https://k8s.example.test:6443"
_JOBSETS = re.compile(r"^/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets(?:/([^/]+))?$")
_CONFIG_MAPS = re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps(?:/([^/]+))?$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
_POD_LOG = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    body: Any


@dataclass
class FakeApiServer:
    objects: dict[tuple[str, str, str], dict] = field(default_factory=dict)   # (kind, namespace, name) -> object
    pod_logs: dict[str, str] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    crd_installed: bool = True

    # urllib3.PoolManager.request, as kubernetes.client.rest.RESTClientObject calls it
    def request(self, method, url, body=None, fields=None, headers=None, **_):
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query)) | dict(fields or [])
        payload = json.loads(body) if isinstance(body, str) and body else None
        self.calls.append(Call(method, parts.path, query, payload))
        status, answer = self._route(method, parts.path, query, payload)
        data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
        content_type = "text/plain" if isinstance(answer, str) else "application/json"
        return urllib3.HTTPResponse(body=io.BytesIO(data), status=status, headers={"Content-Type": content_type},
                                    reason={200: "OK", 201: "Created", 404: "Not Found",
                                            409: "Conflict"}.get(status, ""),
                                    preload_content=True)

    def clear(self) -> None:
        self.calls.clear()

    def _route(self, method: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        if m := _JOBSETS.match(path):
            if not self.crd_installed:
                return _status(404, "the server could not find the requested resource")
            return self._crud("JobSet", m.group(1), m.group(2), method, body)
        if m := _CONFIG_MAPS.match(path):
            return self._crud("ConfigMap", m.group(1), m.group(2), method, body)
        if (m := _PODS.match(path)) and method == "GET":
            key, _, value = query.get("labelSelector", "").partition("=")
            items = [o for (kind, ns, _), o in self.objects.items()
                     if kind == "Pod" and ns == m.group(1) and o["metadata"]["labels"].get(key) == value]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        if (m := _POD_LOG.match(path)) and method == "GET":
            if ("Pod", m.group(1), m.group(2)) not in self.objects:
                return _status(404, f'pods "{m.group(2)}" not found')
            return 200, self.pod_logs.get(m.group(2), "")
        return _status(404, f"no route {method} {path}")

    def _crud(self, kind: str, namespace: str, name: str | None, method: str, body: Any) -> tuple[int, Any]:
        if method == "POST" and name is None:
            key = (kind, namespace, body["metadata"]["name"])
            if key in self.objects:
                return _status(409, f'{kind} "{key[2]}" already exists')
            stored = copy.deepcopy(body)
            stored["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp="2026-01-01T00:00:00Z")
            self.objects[key] = stored
            return 201, stored
        key = (kind, namespace, name)
        if key not in self.objects:
            return _status(404, f'{kind} "{name}" not found')
        if method == "GET":
            return 200, self.objects[key]
        if method == "DELETE":
            return 200, self.objects.pop(key)
        return _status(405, f"{method} not supported here")

    def add_pod(self, namespace: str, name: str, *, jobset: str, index: int, exit_code: int | None,
                message: str = "", reason: str | None = None) -> None:
        """A pod of an indexed Job as the API server shows it; ``exit_code`` None: still running."""
        state = ({"running": {"startedAt": "2026-01-01T00:00:00Z"}} if exit_code is None else
                 {"terminated": {"exitCode": exit_code, "message": message, "reason": reason or
                                 ("Completed" if exit_code == 0 else "Error")}})
        self.objects[("Pod", namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"jobset.sigs.k8s.io/jobset-name": jobset,
                                    "batch.kubernetes.io/job-completion-index": str(index)},
                         "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}},
            "spec": {"containers": [{"name": "trainer", "image": "meshflow:0.1.0"}]},
            "status": {"phase": "Running" if exit_code is None else ("Succeeded" if exit_code == 0 else "Failed"),
                       "containerStatuses": [{"name": "trainer", "image": "meshflow:0.1.0", "imageID": "",
                                              "ready": exit_code is None, "restartCount": 0, "state": state}]},
        }


def _status(code: int, message: str) -> tuple[int, dict]:
    return code, {"apiVersion": "v1", "kind": "Status", "status": "Failure", "message": message, "code": code}


def api_client(server: FakeApiServer):
    """A real ``kubernetes.client.ApiClient`` whose transport is ``server``."""
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = HOST
    api = client.ApiClient(configuration)
    api.rest_client.pool_manager = server
    return api

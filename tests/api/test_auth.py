"""The auth matrix: no token and unknown tokens get 401; users see only their own jobs; admins see all."""

from __future__ import annotations

import httpx
import pytest
from api_testkit import TINY, auth, wait_for
from timing import scaled


def test_auth_matrix(queue_server):
    server = queue_server
    with server.client("alice") as alice, server.client("bob") as bob, server.client("admin") as admin:
        job = alice.post("/v1/jobs", json={"name": "alice's", "overrides": [*TINY, "train.steps=3"]}).json()
        job_id = job["id"]
        try:
            anonymous = httpx.Client(base_url=server.url, timeout=scaled(30))
            wrong = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer not-a-token"},
                                 timeout=scaled(30))
            for client in (anonymous, wrong):
                for method, path in (("GET", "/v1/jobs"), ("GET", f"/v1/jobs/{job_id}"), ("POST", "/v1/jobs"),
                                     ("POST", f"/v1/jobs/{job_id}/cancel"), ("GET", f"/v1/jobs/{job_id}/logs"),
                                     ("POST", "/v1/plans"), ("DELETE", f"/v1/jobs/{job_id}")):
                    response = client.request(method, path, json={"overrides": []} if method == "POST" else None)
                    assert response.status_code == 401, (method, path, response.text)
                    assert response.headers["www-authenticate"] == "Bearer"
            basic = httpx.get(f"{server.url}/v1/jobs", headers={"Authorization": "Basic YWxpY2U6eA=="},
                              timeout=scaled(30))
            assert basic.status_code == 401
            assert httpx.get(f"{server.url}/v1/jobs", headers={"Authorization": auth("alice")["Authorization"] + "x"},
                             timeout=scaled(30)).status_code == 401

            # Another user's job does not exist for bob: read, logs, metrics, cancel, delete.
            for method, path in (("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/logs"),
                                 ("GET", f"/v1/jobs/{job_id}/metrics"), ("POST", f"/v1/jobs/{job_id}/cancel"),
                                 ("DELETE", f"/v1/jobs/{job_id}")):
                assert bob.request(method, path).status_code == 404, (method, path)
            assert job_id not in [j["id"] for j in bob.get("/v1/jobs", params={"limit": 500}).json()["items"]]
            assert bob.get("/v1/jobs", params={"owner": "alice"}).status_code == 403
            assert job_id in [j["id"] for j in alice.get("/v1/jobs", params={"limit": 500}).json()["items"]]

            # The admin sees everyone's jobs and may cancel them.
            assert admin.get(f"/v1/jobs/{job_id}").json()["owner"] == "alice"
            listed = admin.get("/v1/jobs", params={"owner": "alice", "limit": 500}).json()["items"]
            assert job_id in [j["id"] for j in listed] and {j["owner"] for j in listed} == {"alice"}
            assert admin.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
            assert wait_for(alice, job_id, {"CANCELLED"}, timeout=60)["state"] == "CANCELLED"
        finally:
            admin.post(f"/v1/jobs/{job_id}/cancel")


def test_tokens_are_not_kept_in_plain_text():
    from service.settings import Settings

    settings = Settings(tokens={"alice": "alice-token"}, workspace="/tmp/meshflow-settings-test")
    stored = settings.tokens["alice"]
    assert "alice-token" not in stored and stored.startswith("sha256$")
    assert settings.user_for_token("alice-token") == "alice" and settings.user_for_token("alice-tokem") is None
    assert Settings(tokens={"alice": stored}, workspace="/tmp/x").user_for_token("alice-token") == "alice"
    assert Settings(workspace="/tmp/x").auth_disabled is False


def test_auth_is_off_only_when_the_settings_say_so():
    import asyncio

    from fastapi import HTTPException

    from api.deps import LOCAL_USER, get_current_user
    from service.settings import Settings

    with pytest.raises(HTTPException) as refused:
        asyncio.run(get_current_user(Settings(workspace="/tmp/x"), None))
    assert refused.value.status_code == 401
    open_settings = Settings(workspace="/tmp/x", auth_disabled=True)
    assert asyncio.run(get_current_user(open_settings, None)) == LOCAL_USER and open_settings.is_admin(LOCAL_USER)


def test_auth_off_on_a_non_loopback_bind_is_refused_loudly():
    from pydantic import ValidationError

    from service.settings import Settings

    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(ValidationError, match="MESHFLOW_AUTH_DISABLED=true with MESHFLOW_HOST="):
            Settings(workspace="/tmp/x", auth_disabled=True, host=host)
    assert Settings(workspace="/tmp/x", auth_disabled=True, host="127.0.0.1").auth_disabled
    assert Settings(workspace="/tmp/x", tokens={"a": "t"}, host="0.0.0.0").host == "0.0.0.0"

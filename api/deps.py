"""Dependencies shared by the routes, as ``Annotated`` aliases: the control plane, settings, a DB session, the
caller."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.plane import ControlPlane
from service.settings import Settings

LOCAL_USER = "local"

bearer_scheme = HTTPBearer(auto_error=False,
                           description="A token from MESHFLOW_TOKENS: `Authorization: Bearer <token>`.")


# The dependencies that do no I/O are coroutines: FastAPI runs a plain function in its thread pool,
# a hand-off per dependency per request that cost more than the list query itself.


async def get_plane(request: Request) -> ControlPlane:
    return request.app.state.plane


PlaneDep = Annotated[ControlPlane, Depends(get_plane)]


async def get_settings(plane: PlaneDep) -> Settings:
    return plane.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_session(plane: PlaneDep) -> Iterator[Session]:  # closing may talk to the database: a thread
    with plane.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


async def get_current_user(settings: SettingsDep,
                     credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]) -> str:
    """The user whose bearer token came with the request; 401 without one or with an unknown one."""
    if settings.auth_disabled:
        return LOCAL_USER
    user = settings.user_for_token(credentials.credentials) if credentials else None
    if user is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or unknown bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
    return user


CurrentUser = Annotated[str, Depends(get_current_user)]


async def require_metrics_reader(settings: SettingsDep, credentials: Annotated[HTTPAuthorizationCredentials | None,
                                                                               Depends(bearer_scheme)]) -> None:
    """/metrics: the same bearer token as every other route, unless MESHFLOW_METRICS_PUBLIC opens it."""
    if not settings.metrics_public:
        await get_current_user(settings, credentials)

"""Who is asking: the bearer token of a request, its owner and scopes.

No token (or not a bearer one) → 401; a malformed, unknown or revoked token → 401 too,
the same answer whatever the reason; a live token without the endpoint's scope → 403.
The token itself is never logged nor echoed: it is read from the ``Authorization``
header only (never a query string, which access logs would record).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from conveyor.client.by_name import Client
from conveyor.web import tokens
from conveyor.web.problems import Problem

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    bearerFormat="cvy_<id>_<secret>",
    description="A token from `conveyor tokens create --owner OWNER --scope read --scope submit`. "
    "Scopes: `read` (show jobs), `submit` (submit and cancel), `admin` (everything, every owner).",
)


@dataclass(frozen=True)
class Caller:
    """The token a request came with."""

    token: tokens.Token

    @property
    def owner(self) -> str:
        """Whose jobs this caller submits and sees."""
        return self.token.owner

    def sees(self, owner: str | None) -> bool:
        """Whether a job of ``owner`` is visible to this caller (an admin sees all)."""
        return self.token.admin or owner == self.token.owner

    @property
    def name(self) -> str:
        """How the caller is recorded (``cancelled_by``): the token's id, never its secret."""
        return f"token:{self.token.id}"


def client_of(request: Request) -> Client:
    """The :class:`conveyor.Client` the app serves."""
    client: Client = request.app.state.conveyor_client
    return client


def _unauthorized(detail: str, error: str | None = None) -> Problem:
    challenge = 'Bearer realm="conveyor"' + (f', error="{error}"' if error else "")
    return Problem(401, "unauthorized", "Unauthorized", detail, headers={"WWW-Authenticate": challenge})


def requires(scope: str) -> Callable[..., Caller]:
    """A dependency: the caller, whose token must be live and allow ``scope``."""

    def caller(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> Caller:
        if credentials is None:
            raise _unauthorized("a bearer token is required (Authorization: Bearer cvy_...)")
        token = tokens.verify(client_of(request).connections.engine, credentials.credentials)
        if token is None:
            raise _unauthorized("the token is not valid (unknown, revoked or malformed)", "invalid_token")
        if not token.allows(scope):
            raise Problem(
                403,
                "forbidden",
                "Forbidden",
                f"this token lacks the '{scope}' scope",
                headers={"WWW-Authenticate": f'Bearer error="insufficient_scope", scope="{scope}"'},
            )
        return Caller(token)

    return caller


Reader = Annotated[Caller, Depends(requires(tokens.READ))]
Submitter = Annotated[Caller, Depends(requires(tokens.SUBMIT))]

__all__ = ["Caller", "Reader", "Submitter", "bearer", "client_of", "requires"]

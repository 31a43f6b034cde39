"""API keys, scopes and tenants.

Optional: with no key configured the server is open, as before, and everything belongs to the default
tenant (``""``); ``jitflow serve`` then refuses a non-loopback ``--host`` unless told ``--insecure``.
With keys, every endpoint but ``/health`` needs ``Authorization: Bearer <key>`` (what the OpenAI client
sends); a missing or unknown key gets 401, a ``user`` key on an operator endpoint 403, both in OpenAI's
error shape. Operator endpoints (scope ``admin``): everything under ``/v1/jitflow/`` (policy switch and
parameters, pause and resume, engine state and diagnostics, which show every tenant's requests).

Each key belongs to a tenant. Compound tasks, their telemetry and the pattern history learnt from them
are per tenant: a task id and an application name are looked up inside the caller's tenant
(``TaskManager`` keys them as ``tenant/id`` and ``tenant/app``), so one tenant can neither read another's
tasks nor shift the sub-deadlines of its applications.

Keys come from ``--api-key`` / ``$JITFLOW_API_KEY`` (one admin key of the default tenant) and a keys file
(``--api-keys-file``): JSON ``{"keys": [{"key": "...", "tenant": "acme", "scope": "user"}, ...]}``.
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jitflow_server.api.schemas import APIError

SCOPES = ("user", "admin")
#: Tenant names: letters, digits, ``_``, ``.``, ``-`` (no ``/``: it separates tenant and id internally).
TENANT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Shortest accepted key (characters): a guessable key is no key.
MIN_KEY_CHARS = 16
DEFAULT_TENANT = ""
#: Paths that need no key.
PUBLIC_PATHS = frozenset({"/health"})
#: Path prefix of the operator endpoints (scope ``admin``).
ADMIN_PREFIX = "/v1/jitflow/"


class KeysError(ValueError):
    """A key or keys file is malformed (message names the entry)."""


@dataclass(frozen=True)
class APIKey:
    """One API key: its ``tenant`` (``""`` = the default tenant) and ``scope`` (``user`` | ``admin``)."""

    key: str
    tenant: str = DEFAULT_TENANT
    scope: str = "user"


def _check(entry: APIKey, where: str) -> APIKey:
    if len(entry.key) < MIN_KEY_CHARS or any(c.isspace() for c in entry.key):
        raise KeysError(f"{where}: a key needs at least {MIN_KEY_CHARS} characters and no whitespace")
    if entry.tenant and not TENANT_RE.match(entry.tenant):
        raise KeysError(f"{where}: tenant {entry.tenant!r} must match {TENANT_RE.pattern}")
    if entry.scope not in SCOPES:
        raise KeysError(f"{where}: scope must be one of {SCOPES}, got {entry.scope!r}")
    return entry


def load_keys(api_key: str | None = None, keys_file: Path | None = None) -> dict[str, APIKey]:
    """The configured keys by key string (empty: authentication off).

    Raises:
        KeysError: a malformed key or keys file, or one key listed twice.
        OSError: the keys file cannot be read.
    """
    keys: dict[str, APIKey] = {}
    if api_key:
        keys[api_key] = _check(APIKey(api_key, DEFAULT_TENANT, "admin"), "--api-key")
    if keys_file is not None:
        try:
            data = json.loads(Path(keys_file).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise KeysError(f"{keys_file}: not JSON: {exc}") from None
        entries = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise KeysError(f'{keys_file}: expected {{"keys": [{{"key", "tenant", "scope"}}, ...]}}')
        for i, e in enumerate(entries):
            where = f"{keys_file}: keys[{i}]"
            if not isinstance(e, dict) or not isinstance(e.get("key"), str):
                raise KeysError(f"{where}: needs a string 'key'")
            entry = _check(APIKey(e["key"], str(e.get("tenant") or DEFAULT_TENANT), str(e.get("scope", "user"))),
                           where)
            if entry.key in keys:
                raise KeysError(f"{where}: this key is listed twice")
            keys[entry.key] = entry
    return keys


def tenants(keys: dict[str, APIKey]) -> list[str]:
    """The tenants of ``keys`` besides the default one, sorted."""
    return sorted({k.tenant for k in keys.values() if k.tenant != DEFAULT_TENANT})


def request_tenant(request: Any) -> str:
    """The tenant the auth middleware attached to a Starlette request (default tenant without keys)."""
    return getattr(request.state, "tenant", DEFAULT_TENANT)


class Auth:
    """ASGI middleware checking bearer keys (module docstring); puts the caller's tenant and scope in
    ``scope["state"]`` (``request.state.tenant``, ``request.state.scope``). With no keys it only sets
    the default tenant."""

    def __init__(self, app: Any, keys: dict[str, APIKey] | None = None) -> None:
        self.app = app
        self.keys = dict(keys or {})

    def _find(self, presented: str) -> APIKey | None:
        found = None
        for k, entry in self.keys.items():  # constant-time compare against every key
            if hmac.compare_digest(k.encode(), presented.encode()):
                found = entry
        return found

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        if not self.keys:
            state["tenant"], state["scope"] = DEFAULT_TENANT, "admin"
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        auth = ""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                auth = value.decode("latin-1")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        entry = self._find(token) if token else None
        if entry is None:
            msg = ("missing API key: send 'Authorization: Bearer <key>'" if not token
                   else "invalid API key")
            await _send(send, APIError(401, msg, type="invalid_request_error", code="invalid_api_key",
                                       headers={"WWW-Authenticate": "Bearer"}))
            return
        if path.startswith(ADMIN_PREFIX) and entry.scope != "admin":
            await _send(send, APIError(403, f"{path} needs an admin key", type="permission_error",
                                       code="insufficient_scope"))
            return
        state["tenant"], state["scope"] = entry.tenant, entry.scope
        await self.app(scope, receive, send)


async def _send(send: Any, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

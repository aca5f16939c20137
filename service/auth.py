"""API keys -> tenants, Bearer checks, and the per-tenant prefix-cache salt."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

from aiohttp import web

from kvcore.service.errors import APIError

ANONYMOUS_TENANT = "anonymous"  # the single tenant of a server without keys


def keys_from_list(keys: Iterable[str]) -> dict[str, str]:
    """--api-key values: each key is its own tenant, named by its position."""
    keys = list(keys)
    for key in keys:
        if not key:
            raise ValueError("api keys must be non-empty")
    return {key: f"key{i}" for i, key in enumerate(keys)}


def load_keys_file(path: str | Path) -> dict[str, str]:
    """A JSON object {key: tenant}, or lines `KEY TENANT` (blank lines and # comments skipped)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in data.items()):
            raise ValueError(f"{path}: keys and tenants must be non-empty strings")
        return dict(data)
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected `KEY TENANT`, got {line!r}")
        keys[parts[0]] = parts[1]
    return keys


class TenantAuth:
    """Maps a request's Bearer key to its tenant; derives every tenant's cache salt server-side."""

    def __init__(self, api_keys: Mapping[str, str] | None, secret: bytes | None = None) -> None:
        self.api_keys = dict(api_keys or {})
        # a per-process secret unless configured: salts cannot be guessed from tenant names
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)

    def tenant_for(self, request: web.Request) -> str:
        """The tenant of the request; APIError 401 for a missing or unknown key."""
        if not self.enabled:
            return ANONYMOUS_TENANT
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "Missing API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")
        # compare against every key in constant time so timing does not reveal a prefix
        tenant = None
        for key, name in self.api_keys.items():
            if hmac.compare_digest(key.encode(), token.encode()):
                tenant = name
        if tenant is None:
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
        return tenant

    def cache_salt(self, tenant: str, request_salt: str | None) -> str:
        """H(tenant salt, request salt): a request's salt narrows sharing within its tenant only."""
        tenant_salt = hmac.new(self._secret, f"tenant:{tenant}".encode(), hashlib.sha256).digest()
        if request_salt is None:
            return tenant_salt.hex()
        return hmac.new(tenant_salt, f"request:{request_salt}".encode(), hashlib.sha256).hexdigest()

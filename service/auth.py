"""API keys -> tenants, Bearer checks, and the per-tenant prefix-cache salt."""

from __future__ import annotations

import base64
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


def read_keys_file(path: str | Path) -> tuple[dict[str, str], set[str]]:
    """The keys file's {key: tenant} and its admin keys. A JSON object whose values are a
    tenant name or {"tenant": NAME, "admin": true}, or lines `KEY TENANT` or `KEY TENANT admin`
    (blank lines and # comments skipped)."""
    text = Path(path).read_text()
    keys: dict[str, str] = {}
    admins: set[str] = set()
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        for key, value in data.items():
            entry = value if isinstance(value, dict) else {"tenant": value}
            tenant, admin = entry.get("tenant"), entry.get("admin", False)
            if not (isinstance(key, str) and key and isinstance(tenant, str) and tenant
                    and isinstance(admin, bool) and set(entry) <= {"tenant", "admin"}):
                raise ValueError(f"{path}: keys and tenants must be non-empty strings (values: "
                                 f"a tenant or {{\"tenant\": NAME, \"admin\": true}})")
            keys[key] = tenant
            if admin:
                admins.add(key)
        return keys, admins
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin"):
            raise ValueError(f"{path}:{number}: expected `KEY TENANT` or `KEY TENANT admin`, "
                             f"got {line!r}")
        keys[parts[0]] = parts[1]
        if len(parts) == 3:
            admins.add(parts[0])
    return keys, admins


class TenantAuth:
    """Maps a request's Bearer key to its tenant; derives every tenant's cache salt server-side."""

    def __init__(self, api_keys: Mapping[str, str] | None, secret: bytes | None = None,
                 admin_keys: Iterable[str] = ()) -> None:
        self.api_keys = dict(api_keys or {})
        self.admin_keys = frozenset(admin_keys)  # may also read the operator routes (/inspector)
        unknown = self.admin_keys - set(self.api_keys)
        if unknown:
            raise ValueError(f"admin_keys must be among api_keys ({len(unknown)} are not)")
        # a per-process secret unless configured: salts cannot be guessed from tenant names
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)

    def tenant_for(self, request: web.Request) -> str:
        """The tenant of the request; APIError 401 for a missing or unknown key."""
        if not self.enabled:
            return ANONYMOUS_TENANT
        return self.api_keys[self._key_of(request)]

    def require_admin(self, request: web.Request) -> None:
        """Operator routes: open without keys; else 401 without a valid key, 403 for a key that
        is not an admin key. Besides Bearer, HTTP Basic with the key as the password is accepted
        here, so a browser's login dialog can open the page."""
        if self.enabled and self._key_of(request, basic=True) not in self.admin_keys:
            raise APIError(403, "this route needs an admin key (--admin-key, or `admin` in the "
                           "keys file)", code="permission_denied")

    def _key_of(self, request: web.Request, basic: bool = False) -> str:
        """The configured key the request presents; APIError 401 for a missing or unknown one."""
        header = request.headers.get("Authorization", "")
        if not header and request.headers.get("x-api-key"):  # Anthropic's clients send this
            header = "Bearer " + request.headers["x-api-key"]
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if basic and scheme.lower() == "basic":
            try:
                scheme, token = "bearer", base64.b64decode(token, validate=True).decode()
            except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
                token = ""
            token = token.partition(":")[2]  # user:password, the key is the password
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "Missing API key: send `Authorization: Bearer <key>` (or "
                           "`x-api-key: <key>`)",
                           code="invalid_api_key")
        # compare against every key in constant time so timing does not reveal a prefix
        found = None
        for key in self.api_keys:
            if hmac.compare_digest(key.encode(), token.encode()):
                found = key
        if found is None:
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
        return found

    def cache_salt(self, tenant: str, request_salt: str | None) -> str:
        """H(tenant salt, request salt): a request's salt narrows sharing within its tenant only."""
        tenant_salt = hmac.new(self._secret, f"tenant:{tenant}".encode(), hashlib.sha256).digest()
        if request_salt is None:
            return tenant_salt.hex()
        return hmac.new(tenant_salt, f"request:{request_salt}".encode(), hashlib.sha256).hexdigest()

"""``--kv-cache-isolation api-key``: each API key its own prefix-cache namespace.

The key a request authenticated with is hashed (BLAKE2b, 16 bytes; the key itself is never kept)
into a cache salt, joined with the request's own ``cache_salt`` if it has one, so requests of
different keys never share cached blocks (in the pool or in the offload tiers) and cannot probe
each other's prompts through cached-token counts or timing. The API-key middleware sets the salt
for the request's task (a context variable); ``salted`` applies it to the request's sampling
parameters where every API adds its prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
from contextvars import ContextVar

ISOLATION_MODES = ("none", "api-key")

_TENANT_SALT: ContextVar[str | None] = ContextVar("pagedllm_tenant_salt", default=None)


def key_salt(key: bytes) -> str:
    """The cache salt of an API key: a digest, so logs and the KV map never show the key."""
    return "api-key:" + hashlib.blake2b(key, digest_size=16).hexdigest()


def set_tenant(key: bytes):
    """Make ``key``'s salt the current request's; returns the token to ``reset_tenant`` with."""
    return _TENANT_SALT.set(key_salt(key))


def reset_tenant(token) -> None:
    _TENANT_SALT.reset(token)


def salted(params):
    """``params`` with the current tenant's salt in ``cache_salt`` (before the request's own), or
    ``params`` itself when no tenant is set."""
    tenant = _TENANT_SALT.get()
    if tenant is None:
        return params
    salt = tenant if params.cache_salt is None else f"{tenant}/{params.cache_salt}"
    return dataclasses.replace(params, cache_salt=salt)

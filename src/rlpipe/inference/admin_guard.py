"""Runs inside each vLLM server: its admin routes answer only callers holding the inference token.

vLLM's dev mode (VLLM_SERVER_DEV_MODE=1, needed for weight syncs) mounts /pause, /resume,
/collective_rpc (our reload), /update_weight_version, /reset_prefix_cache, /sleep, ... for anyone
who reaches the port, and its `--api-key` guards only /v1, /v2 and /inference. This ASGI middleware,
loaded with `--middleware rlpipe.inference.admin_guard.AdminGuard` (infra/vllm.py), turns that
around: every route needs `Authorization: Bearer <token>` except the ones rollouts, probes and
scrapers use (PUBLIC_PATHS, PUBLIC_PREFIXES). A route a later vLLM adds is therefore guarded until
someone decides it is public.

The token comes from RLPIPE_INFERENCE_TOKEN in the server's environment: the stack generates one
(infra/inference.py), a user may set their own; the sync sidecar sends it (inference/admin.py).
This module imports only the stdlib: it loads into the vLLM process.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

TOKEN_ENV = "RLPIPE_INFERENCE_TOKEN"

PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load", "/weight_info",
                          "/tokenize", "/detokenize", "/inference/v1/generate"})
"""Read-only routes (health checks, Prometheus, the weight label the rollout client reads) and the
token-in/token-out generate route rollouts use (its neighbour /inference/v1/abort_requests is admin)."""
PUBLIC_PREFIXES = ("/v1/",)
"""The OpenAI routes: what rollouts, evals and judges call."""
ADMIN_UNDER_PUBLIC = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
"""Routes that change the server although they sit under a public prefix."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def is_public(path: str) -> bool:
    if path in ADMIN_UNDER_PUBLIC:
        return False
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def bearer(token: str) -> dict[str, str]:
    """The header an admin call carries."""
    return {"Authorization": f"Bearer {token}"}


class AdminGuard:
    """Refuses a non-public route with 401 unless the request carries the token (403 for a wrong one)."""

    def __init__(self, app: ASGIApp) -> None:
        token = os.environ.get(TOKEN_ENV, "")
        if not token:  # fail closed: a server started without a token must not serve its admin routes
            raise RuntimeError(f"{TOKEN_ENV} is not set: the admin guard has no token to check callers against")
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":  # lifespan; CORS preflight
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if is_public(path):
            await self.app(scope, receive, send)
            return
        status = self._check(scope)
        if status is None:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        reason = "no inference admin token" if status == 401 else "wrong inference admin token"
        body = json.dumps({"error": f"{path} is an admin route: {reason} ({TOKEN_ENV}, sent as a Bearer token)"})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body.encode()})

    def _check(self, scope: Scope) -> int | None:
        """None when the caller holds the token; else 401 (none sent) or 403 (a wrong one)."""
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return 401
        # comparing digests keeps the time taken independent of the token's length and content
        return None if hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest) else 403

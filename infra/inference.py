"""Local vLLM inference servers of the stack (`rlpipe stack up --inference N --model DIR`).

Each serves the model under the name `policy` (what rollouts ask for), with the RL/dev
endpoints that weight syncs use; `infra/vllm.py` holds the command line and its reasons.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from rlpipe.inference.admin_guard import TOKEN_ENV
from rlpipe.infra.service import HealthError, Launch, Service
from rlpipe.infra.settings import StackSettings
from rlpipe.infra.vllm import vllm_command

SERVED_MODEL_NAME = "policy"
TOKEN_FILE = "inference-token"
"""In the stack's state directory: the admin token of its local inference servers, made at first use."""


def inference_token(settings: StackSettings, env: Mapping[str, str] | None = None) -> str | None:
    """The token the inference servers' admin routes take (inference/admin_guard.py). None for external
    servers (INFERENCE_URLS) when RLPIPE_INFERENCE_TOKEN is not set: their token is not ours to make."""
    env = os.environ if env is None else env
    if settings.external_inference_urls and not env.get(TOKEN_ENV):
        return None
    return local_inference_token(settings, env)


def local_inference_token(settings: StackSettings, env: Mapping[str, str] | None = None) -> str:
    """RLPIPE_INFERENCE_TOKEN when set, else the stack's own: generated once, kept in its state
    directory, readable by its owner only."""
    env = os.environ if env is None else env
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    path = settings.home.resolve() / TOKEN_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        try:  # a hard link appears whole or not at all: two processes starting at once agree on one token
            os.link(draft, path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_text().strip()


class InferenceService(Service):
    startup_timeout_s = 420.0  # SmolLM2 on 2 busy cores can take minutes
    stop_timeout_s = 20.0
    reap_orphans = True  # a SIGKILLed API server leaves its engine core running (~2.4 GB)

    def __init__(self, settings: StackSettings, index: int) -> None:
        super().__init__(settings)
        self.index = index
        self.name = f"inference-{index}"

    @property
    def port(self) -> int:
        return self.settings.inference_base_port + self.index

    def ports(self) -> list[int]:
        return [self.port]

    def address(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def launch(self) -> Launch:
        model = self.settings.inference_model
        if model is None or not (model / "config.json").exists():
            raise FileNotFoundError(f"no model to serve at {model}: run `rlpipe model prepare` and pass "
                                    "`--model DIR` (or set stack.inference_model)")
        argv, env = vllm_command(model, self.settings.host, self.port, served_model_name=SERVED_MODEL_NAME,
                                 max_model_len=self.settings.inference_max_model_len,
                                 admin_token=local_inference_token(self.settings))
        return Launch(argv=argv, env=env)

    def check_health(self) -> None:
        import httpx

        try:
            response = httpx.get(f"{self.address()}/health", timeout=3)
        except httpx.TransportError as exc:
            raise HealthError(f"no answer: {exc}") from exc
        if response.status_code != 200:
            raise HealthError(f"/health answered {response.status_code}")

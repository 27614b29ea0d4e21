"""Local vLLM inference servers of the stack (`rlpipe stack up --inference N --model DIR`).

Each serves the model under the name `policy` (what rollouts ask for), with the RL/dev
endpoints that weight syncs use; `infra/vllm.py` holds the command line and its reasons.
"""

from __future__ import annotations

from rlpipe.infra.service import HealthError, Launch, Service
from rlpipe.infra.settings import StackSettings
from rlpipe.infra.vllm import vllm_command

SERVED_MODEL_NAME = "policy"


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
                                 max_model_len=self.settings.inference_max_model_len)
        return Launch(argv=argv, env=env)

    def check_health(self) -> None:
        import httpx

        try:
            response = httpx.get(f"{self.address()}/health", timeout=3)
        except httpx.TransportError as exc:
            raise HealthError(f"no answer: {exc}") from exc
        if response.status_code != 200:
            raise HealthError(f"/health answered {response.status_code}")

"""How close an inference server's probe logprobs must come to the trainer's for a sync to verify,
from the dtype the server computes in.

The trainer's probe is always the fp32 forward of exactly the bytes it publishes (fp32 or
bf16-rounded weights, whatever precision it trained in: trainer/trainer.py), so a faithful fp32
server differs from it only by kernel noise: ~1e-5 on SmolLM2, for bf16-published weights too. A
bf16 server rounds every activation, which moves the probe by ~0.1-0.4 on a faithful load and
leaves apart only gross errors (a wrong layer moves it by ~8); a stale tensor, a version one step
old or a slightly scaled embedding hide in that noise (benchmarks/sync_precision.py, BENCHMARKS.md
"Sync verification by dtype"). Each bound is about three times the worst faithful load measured.
Where a bound cannot tell two consecutive versions apart the sync says its check was inconclusive
(weights/sync.py).
"""

from __future__ import annotations

FP32_SERVER_TOLERANCE = 2e-4
"""3x the worst faithful fp32 load of SmolLM2 (7.1e-5 after a reload, docs/vllm-cpu-notes.md)."""
BF16_SERVER_TOLERANCE = 1.0
"""~3x the worst faithful bf16 load of SmolLM2 (0.34; the tiny model 0.16), an eighth of what a
wrong layer shows (7.5)."""
TOLERANCES = {"float32": FP32_SERVER_TOLERANCE, "bfloat16": BF16_SERVER_TOLERANCE, "float16": BF16_SERVER_TOLERANCE}
"""float16 (what vLLM's `--dtype auto` picks on GPUs for fp32 checkpoints) is not measured: it rounds
8x finer than bfloat16, whose bound therefore covers it, loosely."""


class UnmeasuredDtype(ValueError):
    """A server computes in a dtype no bound was measured for."""


def probe_tolerance(server_dtype: str) -> float:
    """The largest |server - trainer| probe logprob a faithful load shows on a server computing in
    `server_dtype`, with margin."""
    if server_dtype not in TOLERANCES:
        raise UnmeasuredDtype(f"the inference server computes in {server_dtype!r}: verification bounds exist "
                              f"for {', '.join(TOLERANCES)} servers only; set sync.verify_tolerance for this one")
    return TOLERANCES[server_dtype]

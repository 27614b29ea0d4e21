"""Configuration of the task side of a run: which environment the policy acts in, and how it is graded.

Shapes only: no ML imports, and none of the plugin packages (envs, graders), which build on these
configs. The environment and grader names are checked against the registries loaded in this process
(`rlpipe.registry.registered_names`): the command line and every worker load the built-in ones, and a
name no loaded registry can vouch for is refused where the run builds its environment and graders.
"""

import re
import string
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlpipe.registry import unusable
from rlpipe.schemas.dataset import DatasetConfig
from rlpipe.schemas.verifiers import VerifiersConfig

ArithmeticOperator = Literal["+", "-", "*"]
MAX_STRUCTURED_SCORE = 100  # a structured judge chooses among max_score + 1 replies


class ArithmeticDifficulty(BaseModel):
    """Knobs of the arithmetic and calculator question generator."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    num_operands: int = Field(2, ge=2, le=8)
    """Numbers per question; questions use the usual precedence (* before + and -)."""
    min_digits: int = Field(1, ge=1, le=12)
    """Fewest digits of each operand (1 allows 0..9)."""
    max_digits: int = Field(2, ge=1, le=12)
    """Most digits of each operand; multi-digit products are what makes the calculator worth calling."""
    operators: tuple[ArithmeticOperator, ...] = ("+", "-")
    """Operators drawn uniformly between operands; add '*' for products. Division is left out so
    every answer is an integer."""

    @model_validator(mode="after")
    def _digits_ordered(self) -> "ArithmeticDifficulty":
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"difficulty.min_digits ({self.min_digits}) is above difficulty.max_digits "
                f"({self.max_digits}): lower min_digits or raise max_digits"
            )
        if not self.operators:
            raise ValueError("difficulty.operators is empty: name at least one of '+', '-', '*'")
        return self


class EnvConfig(BaseModel):
    """Which environment a run uses and how its prompt sets are drawn."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = "arithmetic"
    """Environment: 'arithmetic', 'arithmetic_plain' (same questions, plain-number answers), 'calculator',
    'code', 'dataset' (prompts and references from your data: env.dataset), an import path
    ('my_pkg.tasks:SpellingEnv') or an entry point an installed package declares in group
    'rlpipe.environments' (docs/own-tasks.md; `rlpipe envs list` shows what is available)."""
    seed: int = 0
    """Seed of the prompt sets; the same seed gives the same train and eval questions in every process."""
    train_size: int = Field(10_000, ge=1)
    """Number of train prompts (indices 0..train_size-1)."""
    eval_size: int = Field(200, ge=0)
    """Number of eval prompts; no eval question ever appears in the train set."""
    difficulty: ArithmeticDifficulty | None = None
    """Question knobs for 'arithmetic', 'arithmetic_plain' and 'calculator', replacing the environment's default
    as a whole;
    None keeps the default (arithmetic: 2 operands of 1-2 digits with + and -; calculator: 3 operands
    of 2-3 digits with +, - and *)."""
    max_turns: int | None = Field(None, ge=1, le=64)
    """Model turns per episode; None takes the environment's default (arithmetic 1, calculator 4, code 3)."""
    max_tool_calls_per_turn: int = Field(4, ge=1, le=64)
    """Tool calls run per model turn; further calls in the same turn get an error observation."""
    max_observation_chars: int = Field(2000, ge=64)
    """Longest tool observation fed back to the model; longer output keeps its head and tail."""
    tool_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """Wall-clock limit of one sandboxed tool run (the code environment's python tool)."""
    dataset: DatasetConfig | None = None
    """The data of the 'dataset' environment (and of plugins built on it): files, columns, system prompt
    and the train/eval split. Its train and eval sets come from the data, so train_size and eval_size
    do not apply."""
    verifiers: VerifiersConfig | None = None
    """For env.name = 'verifiers': an installed `verifiers` environment, its load arguments and eval split
    (docs/own-tasks.md). Its tasks are the taskset's, so train_size, eval_size and difficulty do not apply;
    max_turns defaults to 4 with tools, 1 without."""

    @field_validator("name")
    @classmethod
    def _name_registered(cls, name: str) -> str:
        reason = unusable("environment", name)
        if reason is not None:
            raise ValueError(f"env.name {name!r} is not a registered environment: {reason}")
        return name

    @model_validator(mode="after")
    def _dataset_configured(self) -> "EnvConfig":
        if self.name == "dataset" and self.dataset is None:
            raise ValueError("env.name 'dataset' needs env.dataset: set at least env.dataset.path "
                             "(a JSONL or Parquet file, or a directory saved by `datasets`)")
        if self.dataset is not None:
            self._refuse_sizes(("train_size", "eval_size", "difficulty"), "a dataset, whose rows are the prompts",
                               "env.dataset.eval_rows sets the eval split's size")
        if self.name == "verifiers" and self.verifiers is None:
            raise ValueError("env.name 'verifiers' needs env.verifiers: set at least env.verifiers.id, the installed "
                             "environment's id (e.g. 'vf-sums')")
        if self.verifiers is not None:
            if self.name != "verifiers":
                raise ValueError(f"env.verifiers is set, but env.name is {self.name!r}: set env.name = 'verifiers', "
                                 "or remove env.verifiers")
            self._refuse_sizes(("train_size", "eval_size", "difficulty"),
                               "a verifiers environment, whose taskset holds the prompts",
                               "env.verifiers.eval_tasks sets the eval split's size")
        return self

    def _refuse_sizes(self, names: tuple[str, ...], what: str, instead: str) -> None:
        # compared with the defaults, not `model_fields_set`: a config that went through JSON (Temporal's
        # payloads, the runs table) has every field set
        sized = [name for name in names if getattr(self, name) != EnvConfig.model_fields[name].default]
        if sized:
            raise ValueError(f"env.{', env.'.join(sized)} {'does' if len(sized) == 1 else 'do'} not apply to "
                             f"{what}: remove it; {instead}")


DEFAULT_JUDGE_TEMPLATE = """You are grading a response to a task.

Task:
{question}

Reference answer:
{reference}

Response:
{response}

Rate how correct the response is on a scale from 0 to 10.
End your reply with one line of the form: SCORE: <number>"""

JUDGE_TEMPLATE_FIELDS = frozenset({"question", "reference", "response"})


class JudgeConfig(BaseModel):
    """How the model-based grader reaches its judge and reads the verdict."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    base_url: str
    """Address of any OpenAI-compatible server, with or without the trailing /v1
    (e.g. a vLLM server's URL); never assumed to be local."""
    model: str
    """Model name sent in the request body."""
    api: Literal["chat", "completions"] = "chat"
    """chat: POST /v1/chat/completions with one user message; completions: POST /v1/completions."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """str.format template; may use {question}, {reference} and {response} (the latter is required)."""
    score_pattern: str = r"SCORE:\s*(-?\d+(?:\.\d+)?)"
    """Regex with one group capturing the number; the last match in the judge's text counts."""
    max_score: float = Field(10.0, gt=0, allow_inf_nan=False)
    """The judge's top score; the reward is the captured number divided by this, so it lies in [0, 1]."""
    max_tokens: int = Field(512, ge=1)
    """Generation limit of the judge's reply."""
    api_key_env: str | None = None
    """Name of an environment variable holding a bearer token, for hosted endpoints; None sends none."""
    reply_format: Literal["structured", "free_text"] = "structured"
    """structured: the server may only generate one of the replies `structured_reply` renders for the
    whole scores 0..max_score (vLLM's structured outputs, a `choice` constraint), so every reply parses,
    whatever the judge model; free_text: the judge writes what it likes (reasoning first, say) and a
    reply without a score is an unparsable grade. Servers without vLLM's `structured_outputs` request
    field (hosted APIs) need free_text."""
    structured_reply: str = "SCORE: {score}"
    """With reply_format 'structured': the one reply allowed per whole score; must contain {score}
    and be read back by score_pattern as that score."""

    @field_validator("base_url")
    @classmethod
    def _url_has_scheme(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"judge.base_url {url!r} has no scheme: write it as http://host:port[/v1]")
        return url

    @field_validator("prompt_template")
    @classmethod
    def _template_fields(cls, template: str) -> str:
        used = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        unknown = used - JUDGE_TEMPLATE_FIELDS
        if unknown:
            raise ValueError(
                f"judge.prompt_template uses unknown fields {sorted(unknown)}: only "
                f"{{question}}, {{reference}} and {{response}} are filled (double other braces: {{{{ }}}})"
            )
        if "response" not in used:
            raise ValueError("judge.prompt_template never shows the response: add {response}")
        return template

    @field_validator("score_pattern")
    @classmethod
    def _pattern_has_one_group(cls, pattern: str) -> str:
        try:
            groups = re.compile(pattern).groups
        except re.error as e:
            raise ValueError(f"judge.score_pattern is not a valid regex ({e}): fix the pattern") from e
        if groups != 1:
            raise ValueError(
                f"judge.score_pattern has {groups} groups: it needs exactly one, capturing the number"
            )
        return pattern

    @model_validator(mode="after")
    def _structured_replies_parse(self) -> "JudgeConfig":
        if self.reply_format != "structured":
            return self
        if not self.max_score.is_integer() or self.max_score > MAX_STRUCTURED_SCORE:
            raise ValueError(
                f"judge.max_score {self.max_score} must be a whole number <= {MAX_STRUCTURED_SCORE} for "
                "reply_format 'structured' (one allowed reply per score): change it or use 'free_text'"
            )
        if "{score}" not in self.structured_reply:
            raise ValueError(f"judge.structured_reply {self.structured_reply!r} has no {{score}} field")
        pattern = re.compile(self.score_pattern)
        for score, reply in enumerate(self.structured_replies()):
            found = pattern.findall(reply)
            if not found or float(found[-1]) != score:
                raise ValueError(
                    f"judge.score_pattern {self.score_pattern!r} does not read the structured reply {reply!r} "
                    f"as {score}: make structured_reply and score_pattern agree"
                )
        return self

    def structured_replies(self) -> list[str]:
        """The replies a structured judge may give, one per whole score 0..max_score (index = score)."""
        return [self.structured_reply.replace("{score}", str(score)) for score in range(int(self.max_score) + 1)]


class GraderConfig(BaseModel):
    """Which grader turns a response into a reward, and how hard it may be driven."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str | None = None
    """A grader: 'answer_match', 'final_number', 'code_tests', 'judge', an import path of a Grader class or
    of a reward function `fn(task, response_text) -> float` ('my_pkg.rewards:exact'), or an entry point an
    installed package declares in group 'rlpipe.graders'; None uses the environment's rubric."""
    judge: JudgeConfig | None = None
    """Judge endpoint and parsing; required when the judge grades (name 'judge')."""
    concurrency: int = Field(8, ge=1)
    """Gradings one grader instance runs at once (judge requests, sandboxed test runs)."""
    timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """Limit of one judge request or one sandboxed test run."""

    @field_validator("name")
    @classmethod
    def _name_registered(cls, name: str | None) -> str | None:
        reason = None if name is None else unusable("grader", name)
        if reason is not None:
            raise ValueError(f"grader.name {name!r} is not a registered grader: {reason}; or leave grader.name "
                             "unset for the environment's rubric")
        return name

    @model_validator(mode="after")
    def _judge_configured(self) -> "GraderConfig":
        if self.name == "judge" and self.judge is None:
            raise ValueError(
                "grader.judge is required when grader.name is 'judge': set judge.base_url and judge.model"
            )
        return self

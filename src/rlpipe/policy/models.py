"""The two models rlpipe prepares: the tiny test model and SmolLM2-135M-Instruct.

The tiny model is warmed up on demonstrations of the built-in arithmetic and calculator tasks,
rendered exactly as rollouts present them, so its samples are sometimes right, sometimes wrong
and sometimes call the calculator: RL tests on it see real reward variance.
"""

from __future__ import annotations

from pathlib import Path

from rlpipe.envs.demonstrations import demonstrations
from rlpipe.envs.registry import build_environment
from rlpipe.schemas.task import ArithmeticDifficulty, EnvConfig

DEMONSTRATIONS_PER_ENV = 1500
TINY_DIFFICULTY = ArithmeticDifficulty(num_operands=2, min_digits=1, max_digits=1, operators=("+", "-"))
"""What the tiny model can half-learn in seconds: one-digit sums and differences. Tests that
want learnable rewards use this difficulty (`[env.difficulty]` in configs/tiny-*.toml)."""


def tiny_corpus(seed: int = 0) -> list[str]:
    texts: list[str] = []
    for name in ("arithmetic", "calculator"):
        # another seed than runs use, so the warm-up never shows the run's exact prompts
        env = build_environment(EnvConfig(name=name, seed=seed + 1000, difficulty=TINY_DIFFICULTY, eval_size=50))
        texts += demonstrations(env, DEMONSTRATIONS_PER_ENV, seed)
    return texts


def prepare_tiny(out_dir: Path, seed: int = 0) -> Path:
    from rlpipe.policy.tiny import build_tiny_llama

    return build_tiny_llama(out_dir, seed=seed, corpus=tiny_corpus(seed))


def prepare_smollm2(out_dir: Path) -> Path:
    from rlpipe.policy.prepare import prepare_smollm2 as convert

    return convert(out_dir)

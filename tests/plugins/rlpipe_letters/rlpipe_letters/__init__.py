"""Count the letters of a word, answered in plain words: an rlpipe environment and its grader, found by
rlpipe through this package's entry points (pyproject.toml), in every worker, with no registration."""

import random
import re

from rlpipe.envs.base import Environment, Problem, Rubric, Task
from rlpipe.graders.base import Grader, GradeResult

WORDS = ("river", "lantern", "orbit", "meadow", "cat", "harbor", "pencil", "sky", "garden", "window", "tea",
         "mountain", "violet", "cloud", "anchor", "ember", "fox", "quartz", "ladder", "saddle")
INTEGER = re.compile(r"-?\d+")


class LetterCountEnv(Environment):
    """How many letters has a word? The reference is the count, the rubric the package's own grader."""

    name = "letter_count"  # the entry point's name: rlpipe refuses a class whose name differs
    system_prompt = "Answer with just the number."
    rubric = Rubric({"near_number": 1.0})

    def sample_problem(self, rng: random.Random) -> Problem:
        word = rng.choice(WORDS)
        return Problem(question=f"How many letters are in the word {word}?", reference=str(len(word)))


class NearNumberGrader(Grader):
    """1.0 for the reply's last integer equal to the reference, 0.5 for one off, else 0.0: partial credit
    that no built-in grader gives, so the rewards in Postgres show which grader scored them."""

    name = "near_number"
    version = "1"

    async def score(self, task: Task, response_text: str) -> GradeResult:
        numbers = INTEGER.findall(response_text)
        if not numbers:
            return GradeResult(0.0, {"answer": None})
        off = abs(int(numbers[-1]) - int(task.reference))
        return GradeResult(1.0 if off == 0 else 0.5 if off == 1 else 0.0, {"answer": numbers[-1], "off": off})

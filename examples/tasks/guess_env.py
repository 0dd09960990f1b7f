"""The tools task's environment and trajectory reward, in a module of their own that imports
nothing heavy: the trainer loads them by path in tool and reward worker processes, where an
import of torch would eat the tool timeout (examples/tasks/tools_task.py builds the task)."""

from __future__ import annotations

from typing import Any

MAX_NUMBER = 7


class GuessEnv:
    """One game: `reset` draws nothing (the row holds the secret); `guess` is the tool."""

    def reset(self, **row: Any) -> None:
        self.secret = int(row["secret"])
        self.num_guesses = 0
        self.done = False  # set when found: the episode ends (end cause "env_ended")

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: your guess, from 0 to 7
        """
        self.num_guesses += 1
        if n == self.secret:
            self.done = True
            return "correct"
        return "higher" if self.secret > n else "lower"

    def get_reward(self) -> float:
        return 1.0 - 0.1 * (self.num_guesses - 1) if self.done else 0.0


def tool_error_penalty(prompt: str, response: str, reference: str | None, row: dict) -> float:
    """A reward function over the whole trajectory (the trainer's reward.functions; `row` is
    genrm.trajectory_sample's metadata): -1 per tool call that failed (bad JSON, unknown tool,
    wrong arguments, a raise, a timeout)."""
    calls = [call for turn in row.get("tool_calls") or [] for call in turn]
    return -float(sum(1 for call in calls if call.get("error")))

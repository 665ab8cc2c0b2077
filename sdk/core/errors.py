"""Errors shown to users: one line that says what is wrong, the value, and what to do."""

from __future__ import annotations


class DtrainError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits 1."""

    exit_code = 1


class SpecError(DtrainError, ValueError):
    """The job spec or a command-line argument is invalid; the CLI exits 2.

    ``problems`` holds one ``"field.path: message"`` line per problem found.
    """

    exit_code = 2

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{len(self.problems)} problems in the job spec:\n" + "\n".join(
            f"  - {p}" for p in self.problems
        )


class SpecWarning(UserWarning):
    """Something in the spec will work but is probably not what the user wants."""


class ParallelismError(ValueError):
    """A distribution the cluster cannot run; ``field`` is the spec field to change."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")

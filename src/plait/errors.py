"""The one error type for bad user input: the CLI prints its message on one line and exits with 2."""


class PlaitError(ValueError):
    """Bad input: the message says what is wrong and what would fix it."""

"""The errors a user can cause: the CLI prints their message as one line and exits 2."""


class SpotUserError(ValueError):
    """Bad input from the user (an argument, a request): the CLI prints the message as one line and exits 2."""


class SpotArgError(SpotUserError):
    """A bad model argument: the message names the argument and the accepted values."""


def preview(text: str, n: int = 50) -> str:
    """A request's last `n` characters, quoted, to name it in an error message."""
    tail = text[-n:]
    return repr(("..." if len(text) > n else "") + tail)

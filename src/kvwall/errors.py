"""User-facing errors: one line that names the problem and the fix."""


class KvwallError(Exception):
    """A problem with what the user asked for (bad model, size, format, device...).

    The CLI prints ``error: <message>`` and exits with status 2, no traceback.
    """


def first_line(exc: BaseException) -> str:
    """An exception's message as one line, for messages that quote a library's reason."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

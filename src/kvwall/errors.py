"""User-facing errors: one line that names the problem and the fix."""


class KvwallError(Exception):
    """A problem with what the user asked for (bad model, size, format, device...).

    The CLI prints ``error: <message>`` and exits with status 2, no traceback.
    """

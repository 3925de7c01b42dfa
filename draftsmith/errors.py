"""The one exception type users see. The CLI prints it as a single line and exits non-zero (no traceback).

Raise it with a message that names the problem precisely: the file, the dotted recipe key, the line number.
"""


class DraftsmithError(Exception):
    """A user-facing error: bad recipe, bad input file, unknown model. Message is one line."""

"""The one exception type that is the user's mistake.

A :class:`UserError` (a bad config, model, spec or command line) ends a run with one line naming the
file and the key, line or node, ``error`` in the results file and exit code 1.  Every other exception
is a bug of the verifier and keeps its traceback.
"""


class UserError(ValueError):
    """A mistake in what the user gave the verifier; the message names where it is."""

"""What Islands tells people about, named for what happened."""


class IslandsWarning(UserWarning):
    """A problem Islands works around (an expert missing from an ensemble, say). The command line prints each as one
    line, `islands: warning: ...`; library callers get a Python warning they can filter or record."""

"""What Islands tells people about, named for what happened. The command line turns each error into one line and
its own exit status (islands/cli.py); the layers below raise them, or plain `ValueError`s that the builders which
read the config turn into `ConfigError`s naming the key (`config_errors`)."""

import contextlib
import re


class ConfigError(ValueError):
    """A config key, file or command-line value is wrong; the message names it. Exit status 2."""


class DataError(ValueError):
    """An input file is missing, unreadable or does not hold what we expect."""


class CheckpointError(ValueError):
    """A run directory, checkpoint, weights, samples or manifest file cannot be read as what it should be."""


class TamperedCheckpoint(CheckpointError):
    """A checkpoint file is whole (the size its checkpoint recorded) but holds other bytes than were written: changed
    by someone, not cut short by a crash or a copy. A resume stops on it unless asked to fall back."""


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); the last checkpoint is intact."""


class MemberFailed(RuntimeError):
    """A member's process exited non-zero. Not a config error: every member's config was derived before any started."""


class IslandsWarning(UserWarning):
    """A problem Islands works around (an expert missing from an ensemble, say). The command line prints each as one
    line, `islands: warning: ...`; library callers get a Python warning they can filter or record."""


@contextlib.contextmanager
def config_errors(section: str):
    """Turn the `ValueError`s of networks and strategies, which know nothing of the config, into `ConfigError`s
    that name the config section they came from."""
    try:
        yield
    except ValueError as err:
        if type(err) is not ValueError:  # already named for what happened (a DataError, say)
            raise
        message = str(err)
        names_a_key = re.match(r"[a-z_]+(\.[a-z_]+)*: ", message)  # "model.arch: ..." already says which key
        raise ConfigError(message if names_a_key else f"{section}: {message}") from None

"""Third-party noise: dropped unless asked for (``autotune -v``).

A command runs torch, transformers and DeepSpeed (under a fake process group on the plan path), in its own
process and in its plan workers (``autotune.backends.pool``: spawned, fresh interpreters). What they say on the
way says nothing about the user's config, e.g. DeepSpeed's ``[WARNING] [real_accelerator.py] Setting accelerator
to CPU`` (its accelerator auto-detection on a machine without a GPU, logged at its first import through its own
stdout handler), Python warnings from torch, library log records without a handler. By default they are dropped;
``configure(verbose=True)`` shows them all, as the libraries write them.

    configure(verbose)   the CLI, once at start (``-v``): sets this process, and ``$AUTOTUNE_VERBOSE`` for the
                         processes it starts
    configure()          a plan worker (``autotune.backends.pool``) at its start: follows
                         ``$AUTOTUNE_VERBOSE``, quiet when it is unset

What stays: errors (DeepSpeed's logger at ERROR and above, any library's log records at ERROR and above through
logging's last-resort handler) and all that autotune itself prints. Nothing here changes what a trial computes.
The other half of the noise, DeepSpeed's JIT build of its shared-memory comm op, is not built at all
(``trials.core.patches.deepspeed_shm_comm_op_skipped``).
"""

from __future__ import annotations

import logging
import os
import warnings

VERBOSE_ENV = "AUTOTUNE_VERBOSE"  # "1": show third-party output; "0" or unset: drop it

# libraries' loggers with their own handler (``propagate = False``): the last-resort handler never sees them, so
# their records are filtered on the logger itself (a filter on a logger object outlives the library's own set-up
# of that logger, which resets its level and adds its handler at the library's import)
OWN_HANDLER_LOGGERS = ("DeepSpeed",)


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_ERRORS_ONLY = _ErrorsOnly()
_IGNORE_WARNINGS = ("ignore", None, Warning, None, 0)  # ``warnings.filterwarnings("ignore")``'s entry


def verbose_from_env() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip() == "1"


def configure(verbose: bool | None = None) -> None:
    """Quiet (``verbose`` False) or not this process's third-party output; None: as ``$AUTOTUNE_VERBOSE`` says.
    Idempotent, and either way round: ``configure(True)`` undoes ``configure(False)``."""
    if verbose is None:
        verbose = verbose_from_env()
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"  # the plan workers, spawned later, read it
    for name in OWN_HANDLER_LOGGERS:
        logger = logging.getLogger(name)
        if verbose:
            logger.removeFilter(_ERRORS_ONLY)
        elif _ERRORS_ONLY not in logger.filters:
            logger.addFilter(_ERRORS_ONLY)
    if logging.lastResort is not None:  # records of loggers without a handler (torch's, DeepSpeed's modules')
        logging.lastResort.setLevel(logging.WARNING if verbose else logging.ERROR)
    _ignore_warnings(not verbose)


def _ignore_warnings(ignore: bool) -> None:
    """Python warnings (torch's ``UserWarning``/``FutureWarning``, ...): one ``ignore`` filter in front, or none.
    An ignored warning leaves no trace in the ``once``/``default`` registries, so removing the filter is enough."""
    present = _IGNORE_WARNINGS in warnings.filters
    if ignore and not present:
        warnings.filterwarnings("ignore")
    elif not ignore and present:
        warnings.filters.remove(_IGNORE_WARNINGS)

"""The library's one error type for configurations that cannot run."""


class ConfigError(ValueError):
    """A configuration that cannot run (a knob value, a combination of knobs, a model config, a config file).
    The message is the whole story: callers show it as it is (the ``autotune`` CLI: one line, exit 2)."""

"""The library's error types: configurations that cannot run, memory the host could not give."""


class ConfigError(ValueError):
    """A configuration that cannot run (a knob value, a combination of knobs, a model config, a config file).
    The message is the whole story: callers show it as it is (the ``autotune`` CLI: one line, exit 2)."""


class HostOutOfMemoryError(MemoryError):
    """The host could not give memory a technique asked for (pinning activation offload's buffers, mapping them).
    A trial counts it out of memory, as the oracle's verdict on host bytes over the node's share is, and says the
    host's memory ran out, not the device's."""

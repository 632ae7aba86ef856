"""What every other room of ``trials`` builds on: ``ConfigError`` (``errors``), process groups and the mesh
(``dist``), the device-memory tracker that techniques report their allocations to (``memory``), the allocator's
settings (``allocator``) and patches of torch internals, each a context manager (``patches``).

May import nothing else from ``trials``: nothing here knows about a model, a knob or a trial.
"""

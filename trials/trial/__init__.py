"""One measured trial: the launcher's contract (``spec``: ``TrialSpec`` in, ``RankRecord`` out), the runner that
builds, trains warm-up and measured steps and writes each rank's record (``runner``, ``python -m
trials.trial.runner``), per-segment peaks (``segments``), per-layer times for reduced depth (``layer_clock``), and a
step's allocations as a torch memory snapshot (``memory_timeline``).

May import every room below it (``core``, ``kernels``, ``models``, ``stack``, ``training``); never ``trials.hf`` or
``trials.train``.
"""

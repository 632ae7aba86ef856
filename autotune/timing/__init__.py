"""The time model and what feeds it: counting a step (``counting``), predicting its time (``model``), and
measuring this machine's rates (``calibration``, only when asked for: ``autotune calibrate``).

Above ``autotune.core``; below the oracle (whose fake kernels report to the counter) and the backends."""

"""The largest batch size and timeout a run takes: beyond them tensor sizes and deadlines overflow
64-bit integers after work has started (2**31 samples, about eleven days). Checked by the command
line's options and by the Python API alike, before any work."""

MAX_BATCH_SIZE = 2**31 - 1
MAX_TIMEOUT_S = 1e6

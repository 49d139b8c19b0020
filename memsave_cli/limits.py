"""The largest batch size and timeout a run takes: beyond them tensor sizes and deadlines overflow
64-bit integers after work has started (2**31 samples, about eleven days). Checked by the command
line's options and by the Python API alike, before any work. The largest probe depth bounds time
instead: a probe builds a stack of every depth up to it, N(N + 1) / 2 layers (500: minutes)."""

MAX_BATCH_SIZE = 2**31 - 1
MAX_TIMEOUT_S = 1e6
MAX_DEPTH = 500

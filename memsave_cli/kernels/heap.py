"""glibc's malloc told to keep freed memory for reuse, for the CPU timing worker.

NOTE [a heap without page faults]: glibc's malloc hands every block over 32 MiB (most activations of
a CNN at batch 64) straight back to the kernel when it is freed, and the next step maps it again:
a ResNet-50 step at batch 64 took 3.5 to 4.2 million page faults, about a third of its wall time
was the kernel zeroing pages, and how many each implementation took depended on the allocation
history of the process, so the memsave/stock ratio of ``memsave profile --device cpu`` ranged from
1.02 to 1.14 between repeats of the same command. :func:`keep_freed_memory` sets ``M_MMAP_MAX``
to 0 and ``M_TRIM_THRESHOLD`` to its largest value (``mallopt``, as ``MALLOC_MMAP_MAX_=0`` and
``MALLOC_TRIM_THRESHOLD_`` would at start-up): freed memory stays in the heap and is reused, as
PyTorch's caching allocator reuses it on CUDA (and jemalloc or tcmalloc on CPU). The step then
took no page faults and 35% less time, and five repeats of the command gave ratios within 2.4%
of their mean, 0.999. It changes nothing where the user chose malloc settings (those variables,
``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``), and nothing on other C libraries.
"""

from __future__ import annotations

import ctypes
import os

#: ``mallopt`` parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
#: Variables by which a user sets glibc's malloc up; any of them leaves it as the user set it.
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Keep this process's freed memory in its heap (see NOTE); whether the settings applied."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    # -1 reaches glibc as the largest size_t: the heap is never trimmed.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))

"""Kernels of memsave: one module per kernel family, each a ``torch.library`` custom op with its
CPU, CUDA (Triton), fake and reference implementations side by side (``activation.py``,
``maxpool.py``, ``dropout.py``), the C kernels they call on CPU (``native.py``), and how the C
library is built and cached (``build.py``, ``_cache.py``)."""

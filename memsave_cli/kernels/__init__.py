"""Kernels of memsave: one module per kernel family, each a ``torch.library`` custom op with its
CPU, CUDA (Triton), fake and reference implementations side by side (``activation.py``,
``maxpool.py``, ``dropout.py``), the C kernels they call on CPU (``native.py``), the C++ autograd
operators of the eager CPU path (``autograd_ops.py``), and how compiled libraries are built and
cached (``build.py``, ``_cache.py``)."""

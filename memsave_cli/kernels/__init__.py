"""Kernels of memsave: one module per kernel family, each a ``torch.library`` custom op with its
CPU, CUDA (Triton), fake and reference implementations side by side (``activation.py``,
``maxpool.py``, ``dropout.py``); max pooling by blocks with window offsets (``maxpool_blocks.py``,
``maxpool_maps.py``); the C kernels the ops call on CPU (``native.py``), and how the C library is
built and cached (``build.py``, ``_cache.py``); the C++ autograd nodes (``nodes.py``); where the
Triton ReLU kernels may serve, as stock's ReLU answers (``stock_relu.py``); floats as their bits
(``float_bits.py``)."""

"""Kernels of memsave: one module per kernel family, each a custom op with its implementations."""

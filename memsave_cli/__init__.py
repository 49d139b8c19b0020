"""memsave: exact memory-saving drop-in PyTorch layers, and a tool that measures what they save."""

__version__ = "0.1.0"

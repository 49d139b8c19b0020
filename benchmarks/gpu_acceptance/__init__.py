"""GPU acceptance in one command: exactness, saved bytes and time of memsave on a CUDA device.

    python -m benchmarks.gpu_acceptance [--quick] [--docs DIR] [--out FILE] [--budget SECONDS]

Four parts, each within its share of a time budget (NOTE [budget] in ``budget.py``):

- ``exactness`` (``exactness.py``): every drop-in against stock on the device, bit for bit;
- ``memory`` (``memory.py``): saved bytes on the device against the meta estimate, within 3%,
  for ResNet-101 (batch 64) and the paper's Transformer, with NVML's view of each run's process
  next to the allocator's peak (cells of part ``device-view``);
- ``layer-time`` (``layer_time.py``) and ``model-time`` (``model_time.py``): forward+backward
  time of memsave against stock per layer and per paper model, alternating, with their spread.

It prints a line per finished cell, writes the time result files and pages under ``--docs``,
one JSON file of everything (``--out``), and a one-screen summary; the exit code is 1 when an
exactness or saved-bytes check failed, 0 otherwise. Without a CUDA device it says so in one line
and exits 0. ``--device cpu`` (hidden) runs the whole script on the cpu at reduced sizes, to
check the script itself without a GPU.
"""

#!/usr/bin/env bash
# What a lent GPU runs, as one command, in order of value; results under $OUT.
#
#   OUT=results-folder bash benchmarks/gpu_lease.sh
#
# 1. The acceptance (benchmarks/gpu_acceptance): the C++ nodes' launch check first, then every
#    drop-in bit for bit on CUDA, saved bytes against meta, per-layer and per-model time.
# 2. benchmarks/cpp_node_probe: memsave's C++ nodes against Python Functions and the probe's
#    nodes on ResNet-101 (input case), each variant's input gradient against stock's.
# 3. benchmarks/cuda_step_profile: host time against kernel time of one step, with the Python
#    profile of memsave's step.
# Each step has a time limit so that the three fit one 600-s call (the acceptance's budget
# leaves it about 90 s for building the C++ nodes, checking their launches and its workers'
# start); a step that fails leaves the others to run. Afterwards, here: python -m benchmarks.gpu_acceptance --unpack
# <files>/gpu_acceptance.json, and commit the results.
set -u
out="${OUT:?set OUT to the folder the results go to}"
export PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
run() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most $limit s)"
    timeout "$limit" python3 "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $?" | tee -a "$out/exits.txt"
    tail -5 "$out/$name.log"
}
run gpu_acceptance 380 -m benchmarks.gpu_acceptance --budget 290 --out "$out/gpu_acceptance.json"
run cpp_node_probe 140 -m benchmarks.cpp_node_probe --out "$out/cpp_node_probe.json"
run cuda_step_profile 60 -m benchmarks.cuda_step_profile --python-profile 5 \
    --out "$out/cuda_step_profile.json"

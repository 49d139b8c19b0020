#!/usr/bin/env bash
# What a lent GPU runs, as one command, in order of value; results under $OUT.
#
#   OUT=results-folder bash benchmarks/gpu_lease.sh
#
# 1. The acceptance (benchmarks/gpu_acceptance): the C++ nodes' launch check first, then every
#    drop-in bit for bit on CUDA, saved bytes against meta, per-layer and per-model time (the
#    CNNs first: TIMED_MODELS in benchmarks/gpu_acceptance/plan.py).
# 2. benchmarks/triton_launch_probe: host time of one launch by each route (torch, Triton from
#    Python, memsave's Kernel, a node's C++ launch inside a layer), with the driver calls' times.
# 3. benchmarks/cuda_step_profile: host time against kernel time of one step, stock, memsave
#    and memsave's convolutions or activations alone taking turns, with the Python profile of
#    each and their timelines (traces/, read here with python -m benchmarks.trace_gaps).
# (benchmarks/cpp_node_probe has answered its question: on H200s memsave's C++ convolution took
# 1.005 of stock's ResNet-101 step, the probe's own node 1.001. Run it by hand to ask again.)
# Each step has a time limit so that the three fit one 600-s call (the acceptance's budget
# leaves it about 80 s for building the C++ nodes, checking their launches and its workers'
# start); a step that fails leaves the others to run. Afterwards, here: python -m benchmarks.gpu_acceptance --unpack
# <files>/gpu_acceptance.json, and commit the results.
set -u
out="${OUT:?set OUT to the folder the results go to}"
export PYTHONUNBUFFERED=1
# At most 8 files come back from a lease: the acceptance's log stands alone (docs keep it), the
# other steps' logs share lease.txt with nvidia-smi's view and the exit codes, and the timelines
# travel as one archive (6 files in all).
nvidia-smi > "$out/lease.txt" 2>&1
run() {
    local name=$1 limit=$2 log="$out/lease.txt"
    shift 2
    [ "$name" = gpu_acceptance ] && log="$out/$name.log"
    echo "== $name (at most $limit s)" | tee -a "$out/lease.txt"
    timeout "$limit" python3 "$@" >> "$log" 2>&1
    echo "$name: exit $?" | tee -a "$out/lease.txt"
    tail -5 "$log"
}
run gpu_acceptance 420 -m benchmarks.gpu_acceptance --budget 330 --out "$out/gpu_acceptance.json"
run triton_launch_probe 40 -m benchmarks.triton_launch_probe --profile \
    --out "$out/triton_launch_probe.json"
run cuda_step_profile 100 -m benchmarks.cuda_step_profile --families --rounds 9 \
    --python-profile 5 --trace "$out/traces" --out "$out/cuda_step_profile.json"
if [ -d "$out/traces" ]; then tar -C "$out" -cf "$out/traces.tar" traces && rm -r "$out/traces"; fi

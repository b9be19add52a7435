#!/bin/bash
# Bitwise regression check for performance work: run a fixed set of `bema stabilize` configurations
# into OUTROOT and print the sha256 of every safetensors file's tensors (outputs and state; the header's
# provenance, which names versions and paths, left out). Run it with the old code and the new
# (PYTHONPATH), then diff the two listings.
#   usage: bench/bitwise_refs.sh OUTROOT > sums    (BEMA_REF_TRAJ: a bench/synth.py trajectory, base + 4 checkpoints)
set -e
R=$1; rm -rf $R; mkdir -p $R
B=${BEMA:-$(pwd)/.venv/bin/bema}
T=${BEMA_REF_TRAJ:-/tmp/perfref/traj}
run() { name=$1; shift; $B stabilize "$@" --out $R/$name --json > /dev/null 2>$R/$name.err || { echo "FAIL $name"; cat $R/$name.err; }; }
run bema $T/run --base $T/base --method bema --max-memory 1MiB
run ema $T/run --base $T/base --method ema --max-memory 1MiB
run dema $T/run --base $T/base --method dema
run ouema $T/run --base $T/base --method ouema
run ref $T/run --base $T/base --preset reference --phi 200
run grid $T/run --base $T/base --method bema --kappa 0.2,0.5 --eta 0.2,0.4,inf --max-memory 1MiB
run gridfo $T/run --base $T/base --method bema --kappa 0.2,0.5 --eta 0.2,inf --final-only
run tau $T/run --base $T/base --tau 200 --max-memory 1MiB
run phi $T/run --base $T/base --phi 200
run bf16 $T/run --base $T/base --out-dtype bfloat16
run f64 $T/run --base $T/base --accum-dtype float64 --method dema
# incremental: first the first 2 steps, then all
mkdir -p $R/part; for s in 100 200; do ln -s $T/run/checkpoint-$s $R/part/checkpoint-$s; done
run inc $R/part --base $T/base --method bema --kappa 0.2,0.5 --tau 100
for s in 300 400; do ln -s $T/run/checkpoint-$s $R/part/checkpoint-$s; done
run inc $R/part --base $T/base --method bema --kappa 0.2,0.5 --tau 100
run incd $R/part --base $T/base --method dema,ouema --max-memory 1MiB
PY=${PYTHON:-$(pwd)/.venv/bin/python}
cd $R && find . -path ./part -prune -o -name '*.safetensors' -print | grep -v '\.err' | sort | \
  PYTHONPATH=$OLDPWD/bench xargs $PY -c 'import hashlib, sys; from measure import tensor_bytes; [print(hashlib.sha256(tensor_bytes(f)).hexdigest(), f) for f in sys.argv[1:]]'

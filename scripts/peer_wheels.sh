#!/usr/bin/env bash
# Carries the optional peer libraries (FlashInfer, FlashAttention-4, cuEquivariance) to the lent GPU
# machine, which has no package registry, as wheels split over several device calls: what travels with
# one call (the working tree plus its carried folders) is at most 64 MiB, and these wheels are ~230 MiB.
#
# Here (pip reaches PyPI):
#   scripts/peer_wheels.sh download [DIR]    (DIR defaults to .peerwheels, git-ignored)
#     downloads the pinned wheels below for CPython 3.12 manylinux x86-64 into DIR/wheels, splits each wheel
#     larger than a part, packs wheels and pieces into DIR/p1 ... DIR/pN (each at most PART_MIB MiB and
#     each holding the checksum lists), and prints the device calls to make. PART_MIB defaults to what one
#     call leaves after this checkout's travelling files (64 MiB less their size, less 2 MiB), at most 60.
# There, one call per part, the calls back to back (files under /tmp stay while the machine is warm, and
# it goes back 30 s after a call), each call's carry naming its part:
#   bash scripts/peer_wheels.sh collect [DIR]     (carry: ["DIR/pK"])
#     copies the parts it finds under DIR into /tmp/peers; once every piece is there and its checksum
#     holds, joins the split wheels, checks every wheel, installs them all with
#     pip install --no-index --no-deps --target /tmp/site, and prints what imports. Exit status: 0 when
#     installed, 3 while parts are missing (it names them), 1 on a bad checksum or a failed install.
#   Then, in that call or any later one on the same machine:
#     export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
#   (the second folder is what nvidia-cutlass-dsl's .pth file adds in a site dir; --target dirs run no .pth).
#   bash scripts/peer_wheels.sh env   prints that line.
set -euo pipefail

SITE=${PEERS_SITE:-/tmp/site}
STORE=${PEERS_STORE:-/tmp/peers}
PTH_DIR=$SITE/nvidia_cutlass_dsl/dsl_packages

# Pinned so that the checksums and the list below hold; Requires-Dist of each, as read from its METADATA.
FLASHINFER=(
  flashinfer-python==0.7.2.post1   # JIT-compiles its FA2 kernels with the machine's nvcc
  apache-tvm-ffi==0.1.15.post2     # FlashInfer's and FA-4's kernel loader (imported by `import flashinfer`)
  cuda-tile==1.7.0                 # imported by `import flashinfer` (cuda.tile, cutile_cache)
)
FA4=(
  flash-attn-4==4.0.0b36           # the flash_attn.cute package
  nvidia-cutlass-dsl==4.8.1        # the CuTe DSL: a .pth file and these three libs
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1  # torch there is cu130 (the default requirement names the cu12 libs)
  quack-kernels==0.6.5
  torch-c-dlpack-ext==0.1.5
)
CUEQUIVARIANCE=(
  cuequivariance==0.13.0
  cuequivariance-torch==0.13.0
  cuequivariance-ops-torch-cu13==0.13.0
  cuequivariance-ops-cu13==0.13.0
  platformdirs==4.14.8             # needed by cuequivariance-ops-cu13, not on the machine
  opt-einsum-fx==0.1.4             # cuequivariance_torch's naive method optimizes its einsums with it (else a warning a call)
)
# Requirements left out on purpose (the adapters' routes do not import them):
#   flashinfer-cubin (458 MB of ahead-of-time cubins for trtllm-gen/XQA kernels; PyPI has 0.6.13 only, not 0.7.2),
#   flashinfer-jit-cache (not on PyPI: FlashInfer's own index), nccl4py and nccl-extensions (communication),
#   nvidia-cudnn-frontend (FlashInfer's cudnn backend), cuda-python (a meta package: cuda-bindings, cuda-core and
#   cuda-pathfinder are on the machine), nvidia-cutlass-dsl-libs-cu12.
SKIPPED="flashinfer-cubin flashinfer-jit-cache nccl4py nccl-extensions nvidia-cudnn-frontend cuda-python
nvidia-cutlass-dsl-libs-cu12"
# On the machine already (its package list, .library/device/KINDS.md): what the wheels above require besides
# each other.
MACHINE="torch triton numpy scipy click einops ninja nvidia-ml-py packaging requests tabulate tqdm typing-extensions
cuda-bindings cuda-core cuda-pathfinder protobuf networkx opt-einsum sympy nvidia-cublas"

# what `collect` reports importable, with the distribution that gives each version
IMPORTS="flashinfer:flashinfer-python tvm_ffi:apache-tvm-ffi flash_attn.cute:flash-attn-4 cutlass:nvidia-cutlass-dsl
quack:quack-kernels cuequivariance:cuequivariance cuequivariance_torch:cuequivariance-torch
cuequivariance_ops_torch:cuequivariance-ops-torch-cu13"

py() { "${PYTHON:-python3}" "$@"; }  # PYTHON: another interpreter (a 3.12 to try collect here)
mib() { echo $(( ($1 + 1048575) / 1048576 )); }

travelling_bytes() {  # tracked and untracked-not-ignored files of this checkout: what every device call sends
  local root
  root=$(git rev-parse --show-toplevel)
  (cd "$root" && git ls-files -z -co --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
    awk '{s += $1} END {print s + 0}')
}

download() {
  local dir=${1:-.peerwheels} part_mib wheels
  part_mib=${PART_MIB:-$(( 64 - $(mib "$(travelling_bytes)") - 2 ))}
  [ "$part_mib" -gt 60 ] && part_mib=60
  if [ "$part_mib" -lt 8 ]; then echo "peer_wheels: only ${part_mib} MiB a call is left beside the tree" >&2; exit 1; fi
  wheels=$dir/wheels
  rm -rf "$dir"/p[0-9]* "$dir/pieces"
  mkdir -p "$wheels" "$dir/pieces"
  py -m pip download --no-deps -q -d "$wheels" --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    "${FLASHINFER[@]}" "${FA4[@]}" "${CUEQUIVARIANCE[@]}"
  check_requirements "$wheels" || { echo "peer_wheels: carry them, or name them in MACHINE or SKIPPED" >&2; return 1; }
  py - "$dir" "$((part_mib * 1048576))" <<'PY'
import hashlib, os, sys
dir_, part = sys.argv[1], int(sys.argv[2])
wheels = os.path.join(dir_, "wheels")
names = sorted(n for n in os.listdir(wheels) if n.endswith(".whl"))

def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

items = []  # (name, path, size): whole wheels and pieces of the larger ones (name.whl.partNN, in order)
for name in names:
    path = os.path.join(wheels, name)
    size = os.path.getsize(path)
    if size <= part:
        items.append((name, path, size))
        continue
    with open(path, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part), b"")):
            piece = os.path.join(dir_, "pieces", f"{name}.part{i:02d}")
            with open(piece, "wb") as out:
                out.write(block)
            items.append((os.path.basename(piece), piece, len(block)))
bins = []  # first fit, largest first
for item in sorted(items, key=lambda it: -it[2]):
    for b in bins:
        if b["size"] + item[2] <= part:
            b["items"].append(item)
            b["size"] += item[2]
            break
    else:
        bins.append({"items": [item], "size": item[2]})
item_sums = "".join(f"{sha(p)}  {n}\n" for n, p, _ in sorted(items))
wheel_sums = "".join(f"{sha(os.path.join(wheels, n))}  {n}\n" for n in names)
plan = "".join(f"p{k}  {n}\n" for k, b in enumerate(bins, 1) for n, _, _ in sorted(b["items"]))
for k, b in enumerate(bins, 1):
    folder = os.path.join(dir_, f"p{k}")
    os.makedirs(folder)
    for n, p, _ in b["items"]:
        os.link(p, os.path.join(folder, n))
    for name, text in (("ITEMS.sha256", item_sums), ("WHEELS.sha256", wheel_sums), ("PLAN", plan),
                       ("PARTS", f"{len(bins)}\n")):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
total = sum(os.path.getsize(os.path.join(wheels, n)) for n in names)
print(f"{len(names)} wheels, {total / 2**20:.1f} MiB; parts of at most {part >> 20} MiB: {len(bins)} device calls")
for n in names:
    print(f"  {os.path.getsize(os.path.join(wheels, n)) / 2**20:7.2f} MiB  {n}")
for k, b in enumerate(bins, 1):
    print(f"  call {k}: carry [\"{dir_}/p{k}\"]  {b['size'] / 2**20:.1f} MiB: {', '.join(n for n, _, _ in b['items'])}")
PY
  echo "each call: bash scripts/peer_wheels.sh collect $dir  (exit 3 until the last part has come)"
}

check_requirements() {  # every Requires-Dist (no extra) of every wheel: in the set, on the machine, or skipped
  py - "$1" "$MACHINE $SKIPPED" <<'PY'
import os, re, sys, zipfile
folder, known = sys.argv[1], sys.argv[2].split()
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
dists, needs = set(), {}
for name in sorted(os.listdir(folder)):
    if not name.endswith(".whl"):
        continue
    with zipfile.ZipFile(os.path.join(folder, name)) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    dists.add(norm(re.search(r"^Name: (.+)$", meta, re.M).group(1).strip()))
    for req in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        if "extra ==" in req or 'python_version < "3.1' in req or "win32" in req and "!=" not in req:
            continue
        needs.setdefault(norm(re.match(r"[A-Za-z0-9._-]+", req).group(0)), set()).add(name.split("-")[0])
missing = {n: by for n, by in needs.items() if n not in dists and n not in {norm(k) for k in known}}
for n, by in sorted(missing.items()):
    print(f"peer_wheels: {n} (required by {', '.join(sorted(by))}) is neither carried, on the machine, nor "
          "skipped on purpose", file=sys.stderr)
sys.exit(1 if missing else 0)
PY
}

collect() {
  local dir=${1:-.peerwheels} bad missing parts
  mkdir -p "$STORE"
  for part in "$dir"/p[0-9]*/; do
    [ -d "$part" ] || continue
    cp -f "$part"/* "$STORE"/
    echo "peer_wheels: took $(basename "$part")"
  done
  if [ ! -f "$STORE/ITEMS.sha256" ]; then
    echo "peer_wheels: no part has come yet (carry $dir/p1 ...)" >&2
    exit 3
  fi
  cd "$STORE"
  bad=$(sha256sum -c ITEMS.sha256 2>/dev/null | grep -v ': OK$' | sed 's/: FAILED.*$//' || true)
  missing=""
  for f in $bad; do
    if [ -e "$f" ]; then echo "peer_wheels: $f is here but its checksum does not hold" >&2; exit 1; fi
    missing="$missing $f"
  done
  if [ -n "$missing" ]; then
    parts=$(for f in $missing; do awk -v f="$f" '$2 == f {print $1}' PLAN; done | sort -uV | tr '\n' ' ')
    echo "peer_wheels: $(( $(wc -l < ITEMS.sha256) - $(wc -w <<< "$missing") )) of $(wc -l < ITEMS.sha256) files" \
      "here; still to carry: ${parts}(of $(cat PARTS) parts)"
    exit 3
  fi
  for wheel in $(awk '{print $2}' WHEELS.sha256); do
    if [ ! -f "$wheel" ]; then cat "$wheel".part* > "$wheel"; fi
  done
  sha256sum --quiet -c WHEELS.sha256 || { echo "peer_wheels: a joined wheel does not check" >&2; exit 1; }
  if ! cmp -s WHEELS.sha256 "$SITE/.peer_wheels.sha256" 2>/dev/null; then
    py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      $(awk '{print $2}' WHEELS.sha256)
    cp WHEELS.sha256 "$SITE/.peer_wheels.sha256"
    echo "peer_wheels: installed $(wc -l < WHEELS.sha256) wheels into $SITE"
  fi
  env_line
  PYTHONPATH=$SITE:$PTH_DIR${PYTHONPATH:+:$PYTHONPATH} py - $IMPORTS <<'PY'
import importlib, importlib.metadata, sys
for pair in sys.argv[1:]:
    module, dist = pair.split(":")
    try:
        importlib.import_module(module)
        print(f"imports: {module} ({dist} {importlib.metadata.version(dist)})")
    except Exception as exc:  # report every one, whatever it raises
        print(f"does not import: {module}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
PY
}

env_line() {
  echo "export PYTHONPATH=$SITE:$PTH_DIR\${PYTHONPATH:+:\$PYTHONPATH}"
}

case ${1:-} in
  download) shift; download "$@" ;;
  collect) shift; collect "$@" ;;
  env) env_line ;;
  *) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 2 ;;
esac

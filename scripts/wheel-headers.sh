# Sourced by scripts/get-cudnn-frontend.sh and scripts/get-cutlass.sh: header-only dependencies
# taken from a PyPI wheel (the registry plm may use), only the named folders of it kept.
#
# wheel_extract PACKAGE VERSION WORKDIR PREFIX...
#   downloads PACKAGE==VERSION's wheel into WORKDIR (any x86_64 build: the headers are the same)
#   and extracts the members under each PREFIX (e.g. include/) into WORKDIR/x.
# Environment: PIP (default: python3 -m pip).
wheel_extract() {
  local package=$1 version=$2 work=$3
  shift 3
  local pip=${PIP:-python3 -m pip}
  $pip download --quiet --no-deps --only-binary=:all: --dest "$work" "$package==$version" ||
    $pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 --dest "$work" "$package==$version"
  local wheel
  wheel=$(ls "$work"/"${package//-/_}"-*.whl | head -1)
  python3 - "$wheel" "$work/x" "$@" <<'PY'
import sys, zipfile
keep = tuple(sys.argv[3:])
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(keep)])
PY
}

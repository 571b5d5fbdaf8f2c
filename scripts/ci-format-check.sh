#!/usr/bin/env bash
# Fails when any C++ file differs from .clang-format's layout and lists the files that do.
# Fix with: clang-format -i <files>
set -uo pipefail
cd "$(dirname "$0")/.."

format=${CLANG_FORMAT:-clang-format}
if ! command -v "$format" > /dev/null; then
  echo "format check: $format not found (bash scripts/setup-debian.sh installs it)" >&2
  exit 1
fi

mapfile -t files < <(git ls-files -- 'src/*.cpp' 'src/*.hpp' 'src/*.cu' 'app/*.cpp' 'app/*.hpp' \
                                     'test/*.cpp' 'test/*.hpp' 'bench/*.cpp' 'bench/*.hpp' \
                                     'validation/*.cpp' 'validation/*.hpp')
differ=()
for file in "${files[@]}"; do
  [ -f "$file" ] || continue
  if ! "$format" --style=file --dry-run --Werror "$file" > /dev/null 2>&1; then
    differ+=("$file")
  fi
done

if [ ${#differ[@]} -ne 0 ]; then
  echo "format check: ${#differ[@]} of ${#files[@]} files differ from .clang-format:"
  printf '  %s\n' "${differ[@]}"
  echo "fix with: $format -i ${differ[*]}"
  exit 1
fi
echo "format check: ${#files[@]} files match .clang-format"

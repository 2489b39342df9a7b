#!/usr/bin/env bash
# Checks that every tracked C++/CUDA/HIP source is formatted as .clang-format says, with the
# pinned clang-format (14, Debian's clang-format-14): the same version everywhere, since other
# versions format some constructs differently. Lists the files that differ and exits 1.
#
#   tools/check_format.sh          # check (CI)
#   tools/check_format.sh --fix    # format them in place
#
# X-macro tables are laid out by hand between "// clang-format off" and "// clang-format on".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CF=${CLANG_FORMAT:-clang-format-14}
if ! command -v "$CF" >/dev/null 2>&1; then
  echo "check_format.sh: $CF not found (apt-get install clang-format-14, or tools/install_deps.sh)" >&2
  exit 2
fi
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.h' '*.cu')
if [[ ${1:-} == --fix ]]; then
  "$CF" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$CF" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "check_format.sh: ${#bad[@]} of ${#files[@]} files are not formatted ($CF):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "format them with: tools/check_format.sh --fix" >&2
  exit 1
fi
echo "check_format.sh: ${#files[@]} files formatted ($CF)"

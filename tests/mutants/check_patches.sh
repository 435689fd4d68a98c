#!/usr/bin/env bash
# ctest mutants_apply: every mutant of INDEX has one patch, the patch applies to this tree
# (`git apply --check`) and it touches exactly the file INDEX names. A patch the code moved away
# from would otherwise show only as "invalid(apply)" in a mutation run on the GPU machine; the fix
# is `python3 tests/mutants/regen.py` after adjusting its table.
set -uo pipefail
cd "$(dirname "$0")/../.."
# This tree alone: inside an enclosing repository (a vendored copy) git apply would take paths
# relative to that repository's root.
export GIT_CEILING_DIRECTORIES=$(dirname "$PWD")
dir=tests/mutants
status=0 n=0
while IFS=$'\t' read -r id cls file desc; do
  [[ -z $id || $id == \#* ]] && continue
  n=$((n + 1))
  patches=("$dir/${id}"_*.patch)
  if [[ ${#patches[@]} -ne 1 || ! -f ${patches[0]} ]]; then
    echo "mutant $id: expected one $dir/${id}_*.patch, found ${#patches[@]}"; status=1; continue
  fi
  p=${patches[0]}
  touched=$(git apply --numstat "$p" 2>&1 | awk '{print $3}')
  if [[ $touched != "$file" ]]; then
    echo "mutant $id: $p touches '${touched//$'\n'/ }', INDEX says '$file'"; status=1
  fi
  if ! out=$(git apply --check "$p" 2>&1); then
    echo "mutant $id: $p does not apply to this tree (regenerate: python3 $dir/regen.py): $out"
    status=1
  fi
done <"$dir/INDEX"
[[ $n -gt 0 ]] || { echo "no mutant in $dir/INDEX"; exit 1; }
[[ $status -eq 0 ]] && echo "$n mutants: each has one patch that applies and mutates its INDEX file"
exit $status

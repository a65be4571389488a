#!/usr/bin/env bash
# `pip install` for the Makefile's venvs, done by uv: a cold build of .venv-vllm took pip 298 s and uv 29 s on the
# 2-core CI machine, minutes that CI's 90-minute limit otherwise takes from the tests. uv reads no pip configuration,
# so the package sources pip is configured with (index-url, extra-index-url, find-links: a site's mirror or wheel
# directory) are handed to it, and searched as pip searches them: the best version over all of them. Bytecode is
# compiled at install, as pip does: with PYTHONDONTWRITEBYTECODE set (these machines set it) every process would
# otherwise compile what it imports, and print the SyntaxWarnings of third-party sources (megatron-core has some)
# into the output the tests read.
# Usage: tools/venv_install.sh VENV_PYTHON [uv pip install arguments...]
set -euo pipefail
python=$1
shift
"$python" -m pip install -q uv
args=(--quiet --python "$python" --index-strategy unsafe-best-match --compile-bytecode)
while IFS= read -r line; do  # `pip config list`: scope.key='value', a list's items separated by spaces
  key=${line#*.}
  key=${key%%=*}
  value=${line#*=\'}
  value=${value%\'}
  case $key in
    index-url) args+=(--index-url "$value") ;;
    extra-index-url) for v in $value; do args+=(--extra-index-url "$v"); done ;;
    find-links) for v in $value; do args+=(--find-links "$v"); done ;;
  esac
done < <("$python" -m pip config list 2>/dev/null)
exec "$(dirname "$python")/uv" pip install "${args[@]}" "$@"

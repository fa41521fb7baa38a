#!/bin/sh
# The objects given hold no VEX-encoded AVX-VNNI instruction ({vex} vpdpwssd,
# vpdpbusd, ...). Highway's AVX3_DL target lets GCC emit them (its target
# string enables avxvnni), but its run-time check asks for AVX512-VNNI only,
# which CPUs without AVX-VNNI (Zen 4, Ice Lake) have: there they would be
# illegal instructions. Exit 77 (skipped) without objdump.
command -v objdump > /dev/null || { echo "objdump is not installed"; exit 77; }
listing=$(objdump -d "$@") || { echo "objdump could not read $*"; exit 1; }
found=$(printf '%s\n' "$listing" | grep -E '\{vex\} *vpdp')
if [ -n "$found" ]; then
  echo "VEX-encoded AVX-VNNI instructions:"
  echo "$found" | head -20
  exit 1
fi
echo "no VEX-encoded AVX-VNNI instruction in $# objects"

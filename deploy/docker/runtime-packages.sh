#!/bin/sh
# Prints the Debian/Ubuntu packages that own the shared libraries the given
# binaries load, one a line as dpkg names them (with the architecture when
# the package is multi-arch: libc6:amd64): what the runtime image installs.
# Fails, naming each library, when ldd finds no file for one or no package
# owns it, so a missing library stops the image build instead of being left
# out.
#
# On a merged /usr (Debian 12, Ubuntu 22.04 and later) ldd prints
# /lib/x86_64-linux-gnu/... while dpkg records most libraries under
# /usr/lib/x86_64-linux-gnu/... (and a few, libc6's, under /lib): each
# library is looked up by the path ldd gives, its twin with or without
# /usr, and the same two for the file a symlink points to.
#   runtime-packages.sh BINARY...
set -eu
[ "$#" -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }

listing=$(ldd "$@")
missing=$(echo "$listing" | awk '$2 == "=>" && $3 == "not" {print $1}' | sort -u)
if [ -n "$missing" ]; then
  echo "runtime-packages.sh: ldd finds no file for:" $missing >&2
  exit 1
fi

twin() {
  case "$1" in
    /usr/*) echo "${1#/usr}" ;;
    *) echo "/usr$1" ;;
  esac
}

# One line a library: the library, then the paths dpkg may know it by. ldd
# lists "name => /path (0x...)" and the loader as "/path (0x...)"; the
# "/path/of/binary:" headers it prints for several binaries are not libraries.
candidates=$(echo "$listing" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(0x/ {print $1}' | sort -u |
  while read -r library; do
    real=$(readlink -f "$library")
    echo "$library $library $(twin "$library") $real $(twin "$real")"
  done)
[ -n "$candidates" ] || { echo "runtime-packages.sh: ldd lists no libraries for $*" >&2; exit 1; }

# One dpkg query for all of them ("pkg:arch: /path", "pkg1, pkg2: /path").
owners=$(dpkg -S $(echo "$candidates" | cut -d' ' -f2- | tr ' ' '\n' | sort -u) 2>/dev/null | grep -v '^diversion ' || true)

packages=$(printf '%s\n--\n%s\n' "$owners" "$candidates" | awk '
  $0 == "--" { listed = 1; next }
  !listed { split($0, parts, ": "); owner[parts[2]] = parts[1]; next }
  {
    for (i = 2; i <= NF; ++i) if ($i in owner) break
    if (i > NF) { unowned = unowned " " $1; next }
    n = split(owner[$i], packages, ", ")
    for (j = 1; j <= n; ++j) print packages[j]
  }
  END {
    if (unowned != "") {
      print "runtime-packages.sh: no installed package owns:" unowned > "/dev/stderr"
      exit 1
    }
  }')
echo "$packages" | sort -u

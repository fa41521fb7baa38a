"""The include graph keeps the rooms of docs/ARCHITECTURE.md apart: the
kernels include nothing of the service; the record format (service/records)
and the tiers (service/store/tiers) include the kernels, the records, the
common helpers and each other, never the store above them, the backend or
anything that speaks gRPC; and no two units (a header and its sources, e.g.
snapshot.h and snapshot.cc) include each other, directly or around a loop."""

import os
import re
import sys
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SOURCES = (".h", ".cc", ".cu", ".cuh")
# The helpers every room above the kernels may use (turbokv_common).
COMMON = {"service/byte_size.h", "service/error_side.h", "service/log.h", "service/text_file.h",
          "service/status_macros.h"}


def files(folder):
    for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
        for name in names:
            if name.endswith(SOURCES):
                path = os.path.join(dirpath, name)
                yield os.path.relpath(path, ROOT)


def includes(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [i for i in INCLUDE.findall(f.read()) if i.startswith(("service/", "kernels/", "proto/", "client/"))]


class LayersTest(unittest.TestCase):
    def assert_only(self, folder, allowed):
        wrong = [f"{path} includes {target}" for path in files(folder) for target in includes(path)
                 if not any(target.startswith(a) if a.endswith("/") else target == a for a in allowed)]
        self.assertEqual(wrong, [], f"{folder} reaches above its layer")

    def test_kernels_include_nothing_of_the_service(self):
        self.assert_only("kernels", ["kernels/"])

    def test_records_include_only_the_kernels_and_the_helpers(self):
        self.assert_only("service/records", ["kernels/", "service/records/", *COMMON])

    def test_tiers_never_include_the_store(self):
        self.assert_only("service/store/tiers", ["kernels/", "service/records/", "service/store/tiers/", *COMMON])

    def test_no_two_units_include_each_other(self):
        # A unit: a header and the sources of the same name beside it.
        graph = {}
        for path in files("service"):
            unit = os.path.splitext(path)[0]
            for target in includes(path):
                other = os.path.splitext(target)[0]
                if target.startswith("service/") and other != unit:
                    graph.setdefault(unit, set()).add(other)
        loops = []
        state = {}

        def visit(unit, stack):
            state[unit] = "open"
            stack.append(unit)
            for other in sorted(graph.get(unit, ())):
                if state.get(other) == "open":
                    loops.append(" -> ".join(stack[stack.index(other):] + [other]))
                elif other not in state:
                    visit(other, stack)
            stack.pop()
            state[unit] = "done"

        for unit in sorted(graph):
            if unit not in state:
                visit(unit, [])
        self.assertEqual(loops, [], "units that include each other")


if __name__ == "__main__":
    sys.exit(unittest.main())

#!/usr/bin/env python3
"""The tensor-core split kernels' inner loop in SASS, against a GPU's budget.

Reads nvdisasm's listing of a cubin (scripts/cuda-resources.sh makes one of
kernels/cuda/attention_tc.cu) and, for every TensorCoreSplitKernel in it,
finds the loop that attends one token group (the backward branch whose body
holds the most HMMA, the smallest such body), counts its instructions, and
divides them by the bytes of cache one group is (16 tokens of keys and
values of the kernel's codecs). A warp that issues more instructions a byte
than a GPU's schedulers issue per byte its memory delivers cannot read the
cache at the memory's rate, however the loads are hidden:

    budget = SMs x 4 schedulers x clock / memory bandwidth

Usage: sass-loop.py LISTING CODE_BYTES_JSON
  CODE_BYTES_JSON: {"128": {"turbo4": 66, ...}, ...}, a record's bytes per
  codec and head dim (cuda-resources.sh takes them from turbokv-bench codec).
"""
import collections
import json
import re
import sys

# Codec numbers as kernels/layout.h's CodecKind has them (the kernels'
# template arguments); 0 is the kernel that reads every codec.
CODECS = {0: "any", 1: "f16", 2: "q8_0", 3: "q4_0", 4: "turbo2", 5: "turbo3", 6: "turbo4"}

# Published figures: SMs, boost clock (GHz), memory bandwidth (TB/s).
GPUS = {"H100 SXM": (132, 1.98, 3.35), "H200": (132, 1.98, 4.8)}

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
KERNEL = re.compile(r"^\.text\.(\S*TensorCoreSplitKernel\S*):")
# TensorCoreSplitKernelILi128ELi1ELi4ELi2ELi6ELi6EE: D, NT, warps, stages, K, V.
ARGS = re.compile(r"TensorCoreSplitKernel" + r"ELi".join([r"ILi(\d+)"] + [r"(\d+)"] * 5) + "EE")


def kernels(lines):
    """(mangled name, [instruction text], {label: index}) per kernel."""
    name, body, labels = None, [], {}
    for line in lines:
        m = KERNEL.match(line)
        if m or line.startswith(".text."):
            if name:
                yield name, body, labels
            name, body, labels = (m.group(1) if m else None), [], {}
            continue
        if name is None:
            continue
        m = LABEL.match(line)
        if m:
            labels[m.group(1)] = len(body)
            continue
        m = INSTRUCTION.match(line)
        if m:
            body.append(m.group(2))
    if name:
        yield name, body, labels


def opcode(text):
    words = text.split()
    if words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0]


def group_loop(body, labels):
    """The instructions of the innermost loop holding the most HMMA."""
    best = None
    for i, text in enumerate(body):
        m = BRANCH.search(text)
        if not m or labels.get(m.group(1), i + 1) > i:
            continue
        loop = body[labels[m.group(1)]:i + 1]
        key = (sum(opcode(t) == "HMMA" for t in loop), -len(loop))
        if best is None or key > best[0]:
            best = (key, loop)
    return [t for t in best[1] if opcode(t) != "NOP"] if best else []


def main():
    lines = open(sys.argv[1]).read().splitlines()
    code_bytes = json.load(open(sys.argv[2]))
    budgets = {gpu: sms * 4 * ghz / tbps / 1e3 for gpu, (sms, ghz, tbps) in GPUS.items()}
    print("budget (warp instructions a byte of cache at the memory's rate): " +
          ", ".join(f"{gpu} {b:.2f}" for gpu, b in budgets.items()))
    print(f"{'d':>4} {'nt':>2} {'w':>2} {'s':>2} {'keys/values':<14} {'loop':>5} {'HMMA':>4} {'bytes':>5} "
          f"{'instr/B':>7}  most issued")
    rows = []
    for name, body, labels in kernels(lines):
        m = ARGS.search(name)
        if not m:
            continue
        d, nt, warps, stages, k, v = map(int, m.groups())
        loop = group_loop(body, labels)
        if not loop:
            print(f"sass-loop: no loop with HMMA in {name}", file=sys.stderr)
            return 1
        keys, values = CODECS[k], CODECS[v]
        sizes = code_bytes[str(d)]
        if keys == "any":  # the bytes of the pair it is timed on
            group_bytes = None
        else:
            group_bytes = 16 * (sizes[keys] + sizes[values])
        counts = collections.Counter(opcode(t) for t in loop)
        per_byte = f"{len(loop) / group_bytes:7.2f}" if group_bytes else f"{'-':>7}"
        rows.append((d, nt, warps, stages, k, v))
        print(f"{d:>4} {nt:>2} {warps:>2} {stages:>2} {keys + '/' + values:<14} {len(loop):>5} "
              f"{counts['HMMA']:>4} {group_bytes or '-':>5} {per_byte}  " +
              " ".join(f"{op} {n}" for op, n in counts.most_common(6)))
    if not rows:
        print("sass-loop: no TensorCoreSplitKernel in the listing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

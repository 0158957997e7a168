"""Read a kernel's SASS (from `nvdisasm`): find its main loop, count what one trip runs.

The compile check captures the cubin ptxas writes for each Pallas kernel and
disassembles it with `nvdisasm -c` (the `nvidia-cuda-nvdisasm` wheel). This
module parses that text, finds the loop that runs the step, and counts the
instructions of one trip through it, per warp:

* loops are found from the control flow: a branch (`BRA`) to an address at
  or before its own closes a loop over [target, branch] (the code Triton and
  ptxas emit is structured, so each loop is one contiguous range; a branch to
  itself, the trap after `EXIT`, is not a loop);
* the step's loop is the innermost loop that contains every matrix-multiply
  instruction (`HMMA`, `HGMMA`) found inside loops. A loop that does only dot
  work (no floating-point arithmetic besides the MMAs: a dot split in K
  chunks) is not a step, so the search moves out to the loop around it;
* one trip is the loop's body counted once: a loop nested inside it (a dot
  split in K chunks) is counted once per trip as well, and reported in
  `inner_loops`, since its trip count is not in the code.

`NOP`s (alignment padding) are not counted.
"""

from __future__ import annotations

import dataclasses
import re

_INSTRUCTION = re.compile(
    r"^\s*/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<pred>@!?U?P[T0-9]\s+)?(?P<op>[A-Z][A-Z0-9_.]*)"
    r"(?P<rest>[^;]*);")
_LABEL = re.compile(r"^\s*(?P<label>\.L_x_\d+|[A-Za-z_.$][\w.$]*):\s*$")
_SECTION = re.compile(r"^\s*\.section\s+\.text\.(?P<name>[\w.$]+)")
_TARGET = re.compile(r"`\((?P<label>[^)]+)\)")

# Floating-point arithmetic other than the MMAs: a loop without any is dot work.
_FLOAT_MATH = re.compile(r"^(F(ADD|MUL|FMA|MNMX|SETP|SET|CHK)|H(ADD2|MUL2|FMA2|MNMX2|SET2|SETP2)"
                         r"|MUFU|F2F|F2FP|FRND|DADD|DMUL|DFMA)(\.|$)")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One SASS instruction: its address, opcode (with modifiers) and operands."""

  address: int
  opcode: str
  text: str
  target: str | None = None   # a branch's label


@dataclasses.dataclass
class Function:
  """One kernel's code: its instructions in address order and its labels."""

  name: str
  instructions: list[Instruction] = dataclasses.field(default_factory=list)
  labels: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Loop:
  """A loop: the instructions at addresses [start, end] (end: its back branch)."""

  start: int
  end: int

  def contains(self, other: Loop) -> bool:
    return self.start <= other.start and other.end <= self.end and self != other


def parse(text: str) -> dict[str, Function]:
  """The functions of `nvdisasm -c` output, by name.

  Args:
    text: the disassembly (one `.section .text.<name>` per kernel).

  Returns:
    {kernel name: Function}.

  Example:
    >>> sample = '''
    ...   .section .text.k,"ax",@progbits
    ... .L_x_0:
    ...   /*0000*/   IADD3 R1, R1, 0x1, RZ ;
    ...   /*0010*/   @P0 BRA `(.L_x_0) ;
    ...   /*0020*/   EXIT ;'''
    >>> f = parse(sample)["k"]
    >>> [i.opcode for i in f.instructions], f.labels, f.instructions[1].target
    (['IADD3', 'BRA', 'EXIT'], {'.L_x_0': 0}, '.L_x_0')
  """
  functions: dict[str, Function] = {}
  current: Function | None = None
  pending: list[str] = []
  for line in text.splitlines():
    m = _SECTION.match(line)
    if m:
      current = functions.setdefault(m.group("name"), Function(m.group("name")))
      pending = []
      continue
    if current is None:
      continue
    m = _LABEL.match(line)
    if m:
      pending.append(m.group("label"))
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    address = int(m.group("addr"), 16)
    for label in pending:
      current.labels[label] = address
    pending = []
    opcode = m.group("op")
    target = _TARGET.search(m.group("rest"))
    current.instructions.append(Instruction(
        address, opcode, line.strip(),
        target.group("label") if target and opcode.startswith("BRA") else None))
  return functions


def loops(function: Function) -> list[Loop]:
  """Every loop of `function`: a branch back to an address before it.

  Args:
    function: a parsed kernel.

  Returns:
    The loops, outermost first (by start, then longest).

  Example:
    >>> f = parse('''.section .text.k
    ... .L_x_0:
    ...   /*0000*/   NOP ;
    ... .L_x_1:
    ...   /*0010*/   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;
    ...   /*0020*/   @P1 BRA `(.L_x_1) ;
    ...   /*0030*/   @P0 BRA `(.L_x_0) ;
    ... .L_x_2:
    ...   /*0040*/   BRA `(.L_x_2);''')["k"]
    >>> loops(f)
    [Loop(start=0, end=48), Loop(start=16, end=32)]
  """
  found = set()
  for ins in function.instructions:
    if ins.target is None or ins.target not in function.labels:
      continue
    start = function.labels[ins.target]
    if start < ins.address:
      found.add(Loop(start, ins.address))
  return sorted(found, key=lambda l: (l.start, -l.end))


def _body(function: Function, loop: Loop) -> list[Instruction]:
  return [i for i in function.instructions if loop.start <= i.address <= loop.end]


def _is_mma(op: str) -> bool:
  return op.startswith(("HMMA", "HGMMA", "IMMA", "DMMA"))


def _dot_only(function: Function, loop: Loop) -> bool:
  return not any(_FLOAT_MATH.match(i.opcode) for i in _body(function, loop))


def step_loops(function: Function) -> list[Loop]:
  """The loops that each run a step: innermost loops holding an MMA.

  A loop holding an MMA but no floating-point arithmetic besides it (a dot
  split in K chunks) stands for the loop around it. A forward kernel has one
  step loop; the backward kernel has three (the window run forward saving
  checkpoints, a segment's recomputation, the VJP steps).

  Args:
    function: a parsed kernel.

  Returns:
    The step loops in address order (none when no loop holds an MMA).

  Example:
    >>> f = parse('''.section .text.k
    ... .L_x_0:
    ...   /*0000*/   MUFU.TANH R2, R2 ;
    ... .L_x_1:
    ...   /*0010*/   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;
    ...   /*0020*/   @P1 BRA `(.L_x_1) ;
    ...   /*0030*/   @P0 BRA `(.L_x_0) ;''')["k"]
    >>> step_loops(f)  # the K loop at 0x10 does only dot work
    [Loop(start=0, end=48)]
  """
  all_loops = loops(function)
  mma = [i.address for i in function.instructions if _is_mma(i.opcode)]
  candidates = set()
  for loop in all_loops:
    if not any(loop.start <= a <= loop.end for a in mma):
      continue
    while _dot_only(function, loop):
      parents = [l for l in all_loops if l.contains(loop)]
      if not parents:
        break
      loop = min(parents, key=lambda l: l.end - l.start)
    candidates.add(loop)
  innermost = [l for l in candidates if not any(l.contains(o) for o in candidates)]
  return sorted(innermost, key=lambda l: l.start)


def step_loop(function: Function) -> Loop | None:
  """The main step loop: of `step_loops`, the one with the most MMAs.

  Args:
    function: a parsed kernel.

  Returns:
    The loop (the first on a tie), or None when no loop holds an MMA.

  Example:
    >>> f = parse('''.section .text.k
    ... .L_x_0:
    ...   /*0000*/   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;
    ...   /*0010*/   FADD R0, R0, R1 ;
    ...   /*0020*/   @P0 BRA `(.L_x_0) ;
    ... .L_x_1:
    ...   /*0030*/   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;
    ...   /*0040*/   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;
    ...   /*0050*/   FADD R0, R0, R1 ;
    ...   /*0060*/   @P0 BRA `(.L_x_1) ;''')["k"]
    >>> step_loop(f)
    Loop(start=48, end=96)
  """
  found = step_loops(function)
  if not found:
    return None
  return max(found, key=lambda l: (sum(_is_mma(i.opcode) for i in _body(function, l)), -l.start))


def count(instructions: list[Instruction]) -> dict[str, int]:
  """Instruction counts by kind (NOPs excluded).

  Args:
    instructions: e.g. a loop's body.

  Returns:
    {"instructions", "hmma", "hgmma", "ldsm", "lds", "sts", "bar", "mufu",
    "ldg", "stg", "ldl", "stl"}: how many of each (LDL/STL: local memory,
    where ptxas spills).

  Example:
    >>> f = parse('''.section .text.k
    ...   /*0000*/   LDSM.16.M88.4 R4, [R2] ;
    ...   /*0010*/   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;
    ...   /*0020*/   BAR.SYNC.DEFER_BLOCKING 0x0 ;
    ...   /*0030*/   NOP ;''')["k"]
    >>> {k: v for k, v in count(f.instructions).items() if v}
    {'instructions': 3, 'hmma': 1, 'ldsm': 1, 'bar': 1}
  """
  ops = [i.opcode for i in instructions if i.opcode != "NOP"]
  base = [op.split(".")[0] for op in ops]
  return {
      "instructions": len(ops),
      "hmma": sum(b == "HMMA" for b in base),
      "hgmma": sum(b == "HGMMA" for b in base),
      "ldsm": sum(b == "LDSM" for b in base),
      "lds": sum(b == "LDS" for b in base),
      "sts": sum(b in ("STS", "STSM") for b in base),
      "bar": sum(b == "BAR" for b in base),
      "mufu": sum(b == "MUFU" for b in base),
      "ldg": sum(b == "LDG" for b in base),
      "stg": sum(b == "STG" for b in base),
      "ldl": sum(b == "LDL" for b in base),
      "stl": sum(b == "STL" for b in base),
  }


def _operands(instruction: Instruction) -> list[str]:
  m = _INSTRUCTION.match(instruction.text)
  rest = m.group("rest") if m else ""
  return [o.strip().split(".")[0].lstrip("-|") for o in rest.split(",") if o.strip()]


def mma_chain(instructions: list[Instruction]) -> int:
  """The longest chain of MMAs each accumulating into the one before's result.

  An MMA (`HMMA D, A, B, C`) waits for the MMA that wrote its accumulator
  `C`, so a [16, K] x [K, N] dot split in K steps of 16 is a chain K/16 deep
  per accumulator: the chain's depth, not the MMA count, sets the dot's
  latency in a step. Registers are followed by the base register an
  instruction names (an accumulator is a run of registers from it); any
  other instruction writing that register ends the chain.

  Args:
    instructions: e.g. a loop's body, in address order.

  Returns:
    The depth (0 without MMAs).

  Example:
    >>> f = parse('''.section .text.k
    ...   /*0000*/   HMMA.16816.F32.BF16 R0, R4, R8, RZ ;
    ...   /*0010*/   HMMA.16816.F32.BF16 R12, R4, R10, RZ ;
    ...   /*0020*/   HMMA.16816.F32.BF16 R0, R6.reuse, R8, R0 ;
    ...   /*0030*/   FADD R12, R12, 1 ;
    ...   /*0040*/   HMMA.16816.F32.BF16 R12, R6, R10, R12 ;''')["k"]
    >>> mma_chain(f.instructions)  # R0: 2 deep; the FADD cut R12's chain
    2
  """
  depth: dict[str, int] = {}
  longest = 0
  for instruction in instructions:
    operands = _operands(instruction)
    if not operands:
      continue
    if _is_mma(instruction.opcode):
      d = depth.get(operands[-1], 0) + 1
      depth[operands[0]] = d
      longest = max(longest, d)
    else:
      depth.pop(operands[0], None)
  return longest


def loop_report(function: Function) -> dict:
  """What one trip of the step's loop runs, per warp, and the kernel's totals.

  Args:
    function: a parsed kernel.

  Returns:
    {"loop": [start, end] addresses of `step_loop` or None, "per_trip":
    counts of its body (`count`, with "mma_chain": `mma_chain`, and
    "float_math": floating-point instructions besides the MMAs), "inner_loops": [{"start", "end", **counts}]
    nested in it, "other_step_loops": the same for the kernel's other step
    loops, "loops": how many loops the kernel has, "total": counts of the
    whole kernel}.

  Example:
    >>> f = parse('''.section .text.k
    ...   /*0000*/   MOV R0, RZ ;
    ... .L_x_0:
    ...   /*0010*/   HMMA.16816.F32.BF16 R0, R4, R8, R0 ;
    ...   /*0020*/   MUFU.TANH R0, R0 ;
    ...   /*0030*/   @P0 BRA `(.L_x_0) ;
    ...   /*0040*/   EXIT ;''')["k"]
    >>> r = loop_report(f)
    >>> r["loop"], r["per_trip"]["instructions"], r["per_trip"]["hmma"], r["total"]["instructions"]
    ([16, 48], 3, 1, 5)
  """
  loop = step_loop(function)
  all_loops = loops(function)
  out: dict = {"loop": None, "per_trip": None, "inner_loops": [], "other_step_loops": [],
               "loops": len(all_loops), "total": count(function.instructions)}
  if loop is None:
    return out
  out["loop"] = [loop.start, loop.end]
  body = _body(function, loop)
  out["per_trip"] = count(body)
  out["per_trip"]["mma_chain"] = mma_chain(body)
  # Floating-point arithmetic besides the MMAs: the step's elementwise math.
  out["per_trip"]["float_math"] = sum(bool(_FLOAT_MATH.match(i.opcode)) for i in body)
  out["inner_loops"] = [dict(start=l.start, end=l.end, **count(_body(function, l)))
                        for l in all_loops if loop.contains(l)]
  out["other_step_loops"] = [dict(start=l.start, end=l.end, **count(_body(function, l)))
                             for l in step_loops(function) if l != loop]
  return out


# The H200 (sm_90) per-SM limits the occupancy follows.
H200_LIMITS = {"registers": 65_536, "shared_memory_bytes": 228 * 1024, "warps": 64,
               "blocks": 32, "reserved_shared_per_block": 1024,
               "register_unit_per_warp": 256}


def programs_per_sm(registers: int, shared_memory_bytes: int, warps: int,
                    limits: dict | None = None) -> dict:
  """How many programs (thread blocks) of a kernel one SM holds at once.

  Registers are allocated per warp in units of 256 (so per thread in steps
  of 8); each block also takes 1 KB of shared memory the runtime reserves.

  Args:
    registers: per thread (`ptxas -v`).
    shared_memory_bytes: per program (the launch's dynamic + static).
    warps: per program.
    limits: per-SM limits (default: the H200's, `H200_LIMITS`).

  Returns:
    {"programs": the minimum, "by_registers", "by_shared_memory",
    "by_warps", "by_blocks"}.

  Example:
    >>> programs_per_sm(128, 73_728, 8)["programs"], programs_per_sm(246, 204_800, 8)["programs"]
    (2, 1)
  """
  lim = dict(H200_LIMITS, **(limits or {}))
  unit = lim["register_unit_per_warp"]
  per_warp = -(-registers * 32 // unit) * unit
  by = {
      "by_registers": lim["registers"] // (per_warp * warps) if per_warp else lim["blocks"],
      "by_shared_memory": lim["shared_memory_bytes"] // (
          shared_memory_bytes + lim["reserved_shared_per_block"]),
      "by_warps": lim["warps"] // warps,
      "by_blocks": lim["blocks"],
  }
  return {"programs": min(by.values()), **by}

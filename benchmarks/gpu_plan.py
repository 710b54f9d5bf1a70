"""XLA:GPU's plan for a step, compiled for a GPU that is not there (an H200 or a V100).

JAX's CUDA PJRT plugin (``jax-cuda12-pjrt`` and ``jax-cuda12-plugin``, the version of the
installed jaxlib: the ``gpu-plan`` extra) makes a compile-only device from a GPU target
description (``benchmarks/gpu_targets/<name>.txtpb``, XLA's ``GpuTargetConfigProto`` text
format). :func:`compile_plan` traces a step on abstract arguments placed on that device,
lowers and compiles it: XLA:GPU's whole pipeline for that GPU runs (fusion, scheduling,
command buffers, buffer assignment) with no GPU, no driver and no CUDA libraries. It gives
back a :class:`Plan`: the optimized HLO, the thunk sequence, each kernel with the bytes it
reads and writes (and its dot flops), the temporaries (``memory_analysis()``), and every
host round trip.

What this is not: no autotuning runs (XLA's default GEMM configs), the cuDNN graphs are not
built, nothing is executed. Times derived from a plan (:meth:`Plan.predicted_seconds`) are a
roofline prediction from the compiled program, never a measurement.

Used by ``tests/test_gpu_plan.py`` (the GPU program's regression tests, on the CPU) and by
``make gpu-plan`` (``benchmarks/gpu_plan_report.py``). Not part of the package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import re
import tempfile
from typing import Any
from typing import Callable
from typing import Iterator
from typing import NamedTuple

# The plugin checks the CUDA libraries' versions when it registers; a compile-only device
# needs none of them. Read when JAX first initialises its backends.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax

_HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS_DIR = os.path.join(_HERE, "gpu_targets")


class Target(NamedTuple):
  """A GPU target: its description file and the published peaks a prediction uses.

  ``half_flops``: dense float16 tensor-core FLOP/s; ``float32_flops``: what a float32 dot
  gets by XLA's default precision (TF32 tensor cores where the GPU has them, else its
  float32 units); ``bandwidth``: memory bytes/s. Sources: the ``.txtpb`` file's header.
  """

  name: str
  label: str
  file: str
  bandwidth: float
  half_flops: float
  float32_flops: float

  def text(self) -> str:
    with open(os.path.join(TARGETS_DIR, self.file)) as f:
      return f.read()


TARGETS = {
  "h200": Target("h200", "NVIDIA H200 SXM (sm_90)", "h200.txtpb", 4.8e12, 989.5e12, 494.7e12),
  "v100": Target("v100", "NVIDIA V100 SXM2 32 GB (sm_70)", "v100.txtpb", 900e9, 125e12, 15.7e12),
}

PLUGIN_MODULE = "jax_plugins.xla_cuda12"


def plugin_installed() -> bool:
  """Whether JAX's CUDA plugin is importable (the ``gpu-plan`` extra)."""
  try:
    return importlib.util.find_spec(PLUGIN_MODULE) is not None
  except (ImportError, ValueError):
    return False


@functools.cache
def device(target: str) -> jax.Device:
  """The compile-only CUDA device of ``target`` (``"h200"`` or ``"v100"``)."""
  from jax.experimental import topologies

  topo = topologies.get_topology_desc(
    platform="cuda", topology_name="", target_config=TARGETS[target].text(), topology="1x1x1"
  )
  (dev,) = topo.devices
  return dev


def place(tree: Any, dev: jax.Device) -> Any:
  """``tree``'s arrays as ``ShapeDtypeStruct``s placed on ``dev``."""
  sharding = jax.sharding.SingleDeviceSharding(dev)
  return jax.tree_util.tree_map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
  )


# ----------------------------------------------------------------------------- HLO text

_BYTES = {
  "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
  "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
  "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (a tuple's arrays summed)."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return int(total)


def _dims(shape: str) -> list[int]:
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dtype(shape: str) -> str:
  m = _ARRAY.search(shape)
  return m.group(1) if m else ""


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str
  root: bool
  param_index: int = -1  # a parameter's number: "parameter(3)"


def _parse_instr(line: str) -> Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  rest = m.group(3)
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.index(" ") if " " in rest else len(rest)
    # a layout like f32[2]{0} or {1,0:T(...)} is part of the shape token
  shape, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  close = _balanced(rest, op.end() - 1)
  args = rest[op.end() : close - 1]
  operands = re.findall(r"%([\w.\-]+)", args)
  index = int(args) if op.group(1) == "parameter" and args.strip().isdigit() else -1
  return Instr(m.group(2), shape, op.group(1), operands, rest[close:], bool(m.group(1)), index)


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
  """The computations of an HLO module (name -> instructions) and the entry's name."""
  comps: dict[str, list[Instr]] = {}
  entry, current = "", None
  for line in text.splitlines():
    h = _HEADER.match(line)
    if h and not line.startswith(" "):
      current = h.group(2)
      comps[current] = []
      if h.group(1):
        entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is not None:
      ins = _parse_instr(line)
      if ins is not None:
        comps[current].append(ins)
  return comps, entry


def _called(attrs: str, key: str) -> list[str]:
  m = re.search(key + r"=\{?([%\w.\-, ]+)\}?", attrs)
  return re.findall(r"%([\w.\-]+)", m.group(1)) if m else []


# ----------------------------------------------------------------------------- the plan

#: Instructions that are no kernel: views, tuples, control flow (whose bodies are walked).
_NOT_KERNELS = {
  "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
  "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
  "copy-done", "send-done", "recv-done", "get-dimension-size",
}  # fmt: skip
_HOST_OPS = {"send", "recv", "infeed", "outfeed", "send-done", "recv-done"}


@dataclasses.dataclass
class Kernel:
  """One kernel launch of the plan (a fusion, a custom call, a copy...), per execution.

  ``count``: how many times a step launches it (the trip counts of its enclosing loops; 0 in
  the body of a loop of unknown trip count, which is priced as not taken).
  ``bytes_read``: its operands, where a fusion reads only a slice of one (a scan's
  ``dynamic-slice``) that slice, and not the buffer it updates in place (a
  ``dynamic-update-slice``); ``bytes_written``: its output (the update, for an in-place
  update). ``flops``: of its dots (and cuDNN attention), else 0; ``dot_dtype`` their
  input dtype.
  """

  name: str
  opcode: str
  kind: str
  shape: str
  bytes_read: int
  bytes_written: int
  flops: float
  dot_dtype: str
  count: int
  body: str  # the fused computation's opcodes, space-separated ("" for no fusion)

  @property
  def bytes(self) -> int:
    return self.bytes_read + self.bytes_written


def _fusion_io(
  comps: dict[str, list[Instr]], fused: str, operand_bytes: list[int], out_bytes: int
) -> tuple[int, int]:
  """Bytes read and written by a fusion: sliced reads and in-place updates counted as such."""
  body = comps.get(fused, [])
  by_name = {i.name: i for i in body}
  params = {i.param_index: i for i in body if i.opcode == "parameter"}
  users: dict[str, list[Instr]] = {}
  for i in body:
    for o in i.operands:
      users.setdefault(o, []).append(i)

  def alias(name: str) -> list[Instr]:
    """The users of ``name`` through bitcasts."""
    out = []
    for u in users.get(name, []):
      out += alias(u.name) if u.opcode == "bitcast" else [u]
    return out

  read = 0
  for idx, nbytes in enumerate(operand_bytes):
    p = params.get(idx)
    us = alias(p.name) if p is not None else []
    if us and all(
      u.opcode == "dynamic-slice" and u.operands[0] in _chain(p, by_name, users) for u in us
    ):
      read += sum(shape_bytes(u.shape) for u in us)
    elif us and all(
      u.opcode == "dynamic-update-slice" and u.operands[0] in _chain(p, by_name, users) for u in us
    ):
      read += 0
    else:
      read += nbytes
  root = next((i for i in body if i.root), None)
  written = out_bytes
  if root is not None:
    outs = [by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    written = 0
    for o in outs:
      while o.opcode == "bitcast" and o.operands[0] in by_name:
        o = by_name[o.operands[0]]
      if o.opcode == "dynamic-update-slice" and o.operands[1] in by_name:
        written += shape_bytes(by_name[o.operands[1]].shape)
      else:
        written += shape_bytes(o.shape)
  return read, written


def _chain(p: Instr, by_name: dict[str, Instr], users: dict[str, list[Instr]]) -> set[str]:
  """``p``'s name and the names of the bitcasts of it."""
  names, todo = {p.name}, [p.name]
  while todo:
    for u in users.get(todo.pop(), []):
      if u.opcode == "bitcast" and u.name not in names:
        names.add(u.name)
        todo.append(u.name)
  return names


def _dot_flops(comps: dict[str, list[Instr]], comp: str) -> tuple[float, str]:
  """The flops of the dots of a computation, and the dtype of their first input."""
  shapes = {i.name: i.shape for i in comps.get(comp, [])}
  flops, dtype = 0.0, ""
  for i in comps.get(comp, []):
    if i.opcode != "dot":
      continue
    lhs = shapes.get(i.operands[0], "")
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs)
    k = 1
    if contracting:
      dims = _dims(lhs)
      k = math.prod(dims[int(d)] for d in contracting.group(1).split(",") if d)
    flops += 2.0 * math.prod(_dims(i.shape)) * k
    dtype = dtype or _dtype(lhs)
  return flops, dtype


def _attention_flops(ins: Instr, shapes: dict[str, str]) -> float:
  """cuDNN fused attention: 4 B H T S D forward (halved when causal); 2.5x that backward."""
  q = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
  if len(q) != 4:
    return 0.0
  b, d1, d2, dh = q  # BTNH or BNTH: the sequence is the longer of the middle two
  seq = max(d1, d2)
  forward = 4.0 * b * d1 * d2 * dh * seq  # QK^T and PV: 2 * 2 * B * N * T * S * D
  if "CAUSAL" in ins.attrs.upper():
    forward /= 2
  return forward


@dataclasses.dataclass
class Plan:
  """XLA:GPU's plan for one step on one target (see the module docstring for its limits)."""

  target: Target
  hlo: str
  thunks: str
  kernels: list[Kernel]
  memory: dict[str, int]
  host_round_trips: list[str]
  thunks_run: str = ""  # the thunk sequence after XLA's thunk passes (command buffers)
  thunk_names: dict[int, str] = dataclasses.field(default_factory=dict)  # id -> HLO name

  @property
  def host_predicates(self) -> list[str]:
    """The ``while`` and ``conditional`` thunks whose predicate the host reads.

    Those of the thunk sequence that runs (after XLA's thunk passes) outside any command
    buffer: inside one, a ``while`` or ``conditional`` is a CUDA graph conditional node,
    its predicate read on the device (``--xla_gpu_enable_command_buffer`` with ``WHILE``,
    ``CONDITIONAL`` and every command their bodies need, on CUDA >= 12.3).
    """
    return host_read_predicates(self.thunks_run or self.thunks, self.thunk_names, self.hlo)

  @property
  def temp_bytes(self) -> int:
    return self.memory["temp_size_in_bytes"]

  @property
  def launches(self) -> int:
    return sum(k.count for k in self.kernels)

  @property
  def bytes_read(self) -> int:
    return sum(k.bytes_read * k.count for k in self.kernels)

  @property
  def bytes_written(self) -> int:
    return sum(k.bytes_written * k.count for k in self.kernels)

  def kernel_seconds(self, k: Kernel, mfu: float) -> float:
    """A kernel's roofline: its dots at ``mfu`` of the peak of their dtype, or its bytes."""
    peak = self.target.half_flops if k.dot_dtype in ("f16", "bf16") else self.target.float32_flops
    return max(k.flops / (peak * mfu) if k.flops else 0.0, k.bytes / self.target.bandwidth)

  def predicted_seconds(self, mfu: float = 0.45) -> float:
    """The step's predicted time: every kernel's roofline, summed (launches not priced)."""
    return sum(self.kernel_seconds(k, mfu) * k.count for k in self.kernels)

  def find(self, predicate: Callable[[Kernel], bool]) -> list[Kernel]:
    return [k for k in self.kernels if predicate(k)]

  def summary(self, mfu: float = 0.45) -> dict[str, Any]:
    return {
      "kernels": len(self.kernels),
      "launches": self.launches,
      "bytes_read": self.bytes_read,
      "bytes_written": self.bytes_written,
      "dot_flops": sum(k.flops * k.count for k in self.kernels),
      "float32_dot_flops": sum(
        k.flops * k.count for k in self.kernels if k.flops and k.dot_dtype == "f32"
      ),
      "temp_bytes": self.temp_bytes,
      "memory": dict(self.memory),
      "host_round_trips": list(self.host_round_trips),
      "predicted_ms": 1e3 * self.predicted_seconds(mfu),
    }


def _kernels(text: str) -> tuple[list[Kernel], list[str]]:
  comps, entry = parse_hlo(text)
  kernels: list[Kernel] = []
  host: list[str] = []

  def walk(comp: str, count: int) -> None:
    shapes = {i.name: i.shape for i in comps.get(comp, [])}
    for ins in comps.get(comp, []):
      if ins.opcode == "while":
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
        if trip is None:
          host.append(
            f"{ins.name}: while without a known trip count (its predicate read by the host)"
          )
        # Unknown trip count: priced as a loop not taken (its condition once, its body never),
        # the case of jls.retry_on_overflow's loop when nothing overflows.
        n = int(trip.group(1)) if trip else 0
        for c in _called(ins.attrs, "condition"):
          walk(c, count * (n + 1))
        for c in _called(ins.attrs, "body"):
          walk(c, count * n)
        continue
      if ins.opcode == "conditional":
        host.append(f"{ins.name}: conditional (its branch index read by the host)")
        # Priced as its cheapest branch (fewest flops, then bytes): the case of
        # jls.retry_on_overflow's conditionals when nothing overflows.
        branches = []
        for c in (
          _called(ins.attrs, "branch_computations")
          + _called(ins.attrs, "true_computation")
          + _called(ins.attrs, "false_computation")
        ):
          before = len(kernels)
          walk(c, count)
          branches.append(kernels[before:])
          del kernels[before:]
        if branches:
          cost = lambda ks: (sum(k.flops * k.count for k in ks), sum(k.bytes * k.count for k in ks))
          kernels.extend(min(branches, key=cost))
        continue
      if ins.opcode == "call":
        for c in _called(ins.attrs, "to_apply"):
          walk(c, count)
        continue
      if ins.opcode in _HOST_OPS:
        host.append(f"{ins.name}: {ins.opcode} (a host transfer)")
      if ins.opcode == "custom-call" and re.search(
        r'custom_call_target="[^"]*callback', ins.attrs, re.I
      ):
        host.append(f"{ins.name}: host callback")
      if "S(5)" in ins.shape and ins.opcode in ("copy-start", "copy"):
        host.append(f"{ins.name}: copy to host memory")
      if ins.opcode in _NOT_KERNELS:
        continue
      operand_bytes = [shape_bytes(shapes.get(o, "")) for o in ins.operands]
      out_bytes = shape_bytes(ins.shape)
      kind, body, flops, dot_dtype = ins.opcode, "", 0.0, ""
      if ins.opcode == "fusion":
        (fused,) = _called(ins.attrs, "calls") or [""]
        m = re.search(r"kind=(\w+)", ins.attrs)
        kind = m.group(1) if m else "fusion"
        read, written = _fusion_io(comps, fused, operand_bytes, out_bytes)
        flops, dot_dtype = _dot_flops(comps, fused)
        body = " ".join(i.opcode for i in comps.get(fused, []))
      else:
        read, written = sum(operand_bytes), out_bytes
        if ins.opcode == "custom-call":
          m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
          kind = m.group(1) if m else "custom-call"
          if "fmha" in kind.lower() or "fmha" in ins.attrs.lower():
            flops = _attention_flops(ins, shapes) * (2.5 if "Backward" in kind else 1.0)
            dot_dtype = _dtype(shapes.get(ins.operands[0], "")) if ins.operands else ""
          elif "gemm" in kind or "matmul" in kind:
            flops = 2.0 * math.prod(_dims(ins.shape)) * _contracting(ins, shapes)
            dot_dtype = _dtype(shapes.get(ins.operands[0], "")) if ins.operands else ""
      kernels.append(
        Kernel(ins.name, ins.opcode, kind, ins.shape, read, written, flops, dot_dtype, count, body)
      )

  walk(entry, 1)
  return kernels, host


_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")


_THUNK_META = re.compile(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)')


def host_read_predicates(
  thunks: str, names: dict[int, str] | None = None, hlo: str = ""
) -> list[str]:
  """The ``kWhile``/``kConditional`` thunks of a thunk sequence dump outside every
  ``kCommandBuffer`` (nesting read from the indentation): the host copies their predicate
  back and waits for it (XLA's ``WhileThunk::ExecuteOnStream``: ``Memcpy`` then
  ``BlockHostUntilDone``). A ``while`` with a known trip count is left out (the thunk runs
  its body that many times without reading the predicate) when ``names`` (thunk id -> HLO
  instruction, from the dump's ``thunk_metadata``) and ``hlo`` say so."""
  known = set()
  if hlo:
    comps, _ = parse_hlo(hlo)
    known = {
      i.name
      for instrs in comps.values()
      for i in instrs
      if i.opcode == "while" and "known_trip_count" in i.attrs
    }
  found: list[str] = []
  stack: list[tuple[int, str]] = []
  for line in thunks.splitlines():
    m = _THUNK.match(line)
    if m is None:
      continue
    indent, kind = len(m.group(1)), m.group(2)
    while stack and stack[-1][0] >= indent:
      stack.pop()
    stack.append((indent, kind))
    if kind not in ("kWhile", "kConditional") or any(k == "kCommandBuffer" for _, k in stack):
      continue
    thunk_id = int(line.split(":")[0])
    name = (names or {}).get(thunk_id, "")
    if kind == "kWhile" and name in known:
      continue
    found.append(f"{thunk_id:03d}: {kind} {name}".rstrip())
  return found


def _contracting(ins: Instr, shapes: dict[str, str]) -> int:
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
  lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
  if not m or not lhs:
    return 1
  return math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1)))


def compile_plan(
  step: Callable[..., Any],
  args: tuple[Any, ...],
  target: str = "h200",
  *,
  donate_argnums: tuple[int, ...] = (0,),
  dump_dir: str | None = None,
  compiler_options: dict[str, Any] | None = None,
) -> Plan:
  """Compiles ``step(*args)`` for ``target`` and reads XLA:GPU's plan back.

  Args:
    step: the training step (a function of arrays and pytrees of arrays).
    args: its arguments: arrays or ``ShapeDtypeStruct``s (placed on the target here).
    target: ``"h200"`` or ``"v100"`` (:data:`TARGETS`).
    donate_argnums: the arguments the step donates (its state, as a training loop would).
    dump_dir: where XLA writes its dump (a temporary directory, removed, by default).
    compiler_options: XLA options for this program (``--xla_...`` flags without the
      dashes: ``{"xla_gpu_enable_command_buffer": "FUSION,WHILE,CONDITIONAL"}``).

  Returns:
    The :class:`Plan`.
  """
  dev = device(target)
  placed = place(args, dev)
  with tempfile.TemporaryDirectory(prefix="gpu-plan-") as tmp:
    out = dump_dir or tmp
    options = {
      "xla_dump_to": out,
      "xla_dump_hlo_as_text": True,
      "xla_dump_hlo_pass_re": "",
      "xla_gpu_dump_llvmir": False,
      **(compiler_options or {}),
    }
    traced = jax.jit(step, donate_argnums=donate_argnums).trace(*placed)
    compiled = traced.lower().compile(compiler_options=options)
    names = os.listdir(out)
    hlo_file = [n for n in names if n.endswith("gpu_after_optimizations.txt")]
    thunk_file = [n for n in names if n.endswith("thunk_sequence.txt")]
    if len(hlo_file) != 1 or len(thunk_file) != 1:
      raise RuntimeError(f"expected one optimized HLO and one thunk sequence in the dump: {names}")
    with open(os.path.join(out, hlo_file[0])) as f:
      hlo = f.read()
    with open(os.path.join(out, thunk_file[0])) as f:
      thunks = f.read()
    # Written only when a thunk pass (the command buffer conversion) changed the sequence.
    run_file = [n for n in names if n.endswith("thunk_sequence_after_thunk_passes.txt")]
    thunks_run = thunks
    if run_file:
      with open(os.path.join(out, run_file[0])) as f:
        thunks_run = f.read()
    thunk_names: dict[int, str] = {}
    for n in [n for n in names if n.endswith("thunk_metadata.txt")]:
      with open(os.path.join(out, n)) as f:
        thunk_names = {int(i): a for a, i in _THUNK_META.findall(f.read())}
  m = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
  memory = {k: int(getattr(m, k)) for k in fields + ("temp_size_in_bytes",)}
  kernels, host = _kernels(hlo)
  return Plan(TARGETS[target], hlo, thunks, kernels, memory, host, thunks_run, thunk_names)


@contextlib.contextmanager
def cudnn_answered(target: str = "h200") -> Iterator[None]:
  """JAX's Python-side cuDNN version check answered with the target's cuDNN version.

  ``jax.nn.dot_product_attention(..., implementation="cudnn")`` asks the local CUDA libraries
  for cuDNN's version at trace time, which a machine without them cannot answer; a
  compile-only target answers from its description (``dnn_version_info``).
  """
  from jax._src.cudnn import fused_attention_stablehlo as fused

  m = re.search(r"dnn_version_info\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", TARGETS[target].text())
  version = int(m.group(1)) * 10000 + int(m.group(2)) * 100 if m else 0
  saved = fused.check_cudnn_version
  fused.check_cudnn_version = lambda: version
  try:
    yield
  finally:
    fused.check_cudnn_version = saved


def _key(k: Kernel) -> tuple[str, str, str]:
  return (k.kind, re.sub(r"\{[^}]*\}", "", k.shape), k.body)


def diff(plan: Plan, reference: Plan) -> tuple[list[Kernel], list[Kernel]]:
  """The kernels of ``plan`` that ``reference`` has not, and those it lacks (by kind, shape and
  fused body; names differ between compiles)."""
  return _unmatched(plan.kernels, reference.kernels), _unmatched(reference.kernels, plan.kernels)


def _unmatched(kernels: list[Kernel], others: list[Kernel]) -> list[Kernel]:
  """The kernels of ``kernels`` left once each of ``others`` has matched one (by ``_key``)."""
  pool = [_key(k) for k in others]
  left = []
  for k in kernels:
    if _key(k) in pool:
      pool.remove(_key(k))
    else:
      left.append(k)
  return left

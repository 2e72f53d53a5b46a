"""Following the data through the ops a probe forward recorded (``probe``): which projections' outputs reach nothing but
their layer's output (the trimmed recompute may skip their matmuls), and whether the logits leave the model as its LM
head made them (the fused loss runs the head itself). Tensors are identified by their storage; a view shares its
input's, so views pass the data on by themselves.
"""
from __future__ import annotations


class Op:
    """One op of the probe forward: its inputs' and outputs' storages (the tensors themselves are held, so
    no storage is freed and its identity reused during the probe: fake tensors cost no memory)."""

    __slots__ = ("packet", "inputs", "outputs", "args", "kwargs", "held")

    def __init__(self, packet, inputs, outputs, args, kwargs, held):
        self.packet, self.inputs, self.outputs, self.args, self.kwargs = packet, inputs, outputs, args, kwargs
        self.held = held


_PASS = {"add", "clone", "native_dropout", "dropout", "_to_copy", "alias"}


def _passes(op: Op) -> bool:
    """Whether ``op`` hands its input on unchanged in meaning to a residual sum (adds, copies, a zero dropout)."""
    name = getattr(op.packet, "__name__", str(op.packet))
    if name not in _PASS:
        return False
    if name == "add":
        return op.kwargs.get("alpha", 1) == 1
    if name in ("native_dropout", "dropout"):
        return len(op.args) > 1 and op.args[1] == 0
    if name == "_to_copy":
        source = op.args[0]
        return op.kwargs.get("dtype", source.dtype) == source.dtype
    return True


def _feeds_only_output(start: int, ops: list[Op], output: int | None) -> bool:
    """Whether storage ``start`` reaches nothing but the layer's output storage, through ops that pass it on."""
    frontier, done, reached = [start], set(), False
    while frontier:
        key = frontier.pop()
        if key in done:
            continue
        done.add(key)
        reached |= key == output
        for op in ops:
            if key not in op.inputs or not op.outputs:
                continue  # a query of metadata (prim.device)
            if op.outputs == [key]:
                if getattr(op.packet, "__name__", "").endswith("_"):
                    return False  # written in place (Llama 4's shared expert: out.add_(routed)): the recompute's
                continue  # skipped matmul would hand the writer its fill; a view of the same storage passes on
            if not _passes(op):
                return False
            follow = op.outputs[:1] if getattr(op.packet, "__name__", "") == "native_dropout" else op.outputs
            frontier.extend(k for k in follow if k != key)
    return reached


# what may happen to the LM head's logits before the forward returns them, for hf_accel's fused loss to compute what
# the model does (it applies a final soft-cap itself)
_LOGIT_VIEWS = {"_to_copy", "clone", "contiguous", "alias", "slice", "select", "view", "_unsafe_view", "reshape"}
_SOFTCAP = {"div", "tanh", "mul"}


def plain_head(outside: list[Op], head_out: int | None, softcap: bool) -> bool:
    """Whether the logits leave the forward as the LM head made them (a soft-cap aside where the config has one):
    no scale, no bias, nothing the fused loss, which runs the head itself, would leave out. ``outside``: the ops run
    outside the decoder layers; ``head_out``: the storage of the head's output."""
    if head_out is None:
        return False
    frontier, done = [head_out], set()
    allowed = _LOGIT_VIEWS | (_SOFTCAP if softcap else set())
    while frontier:
        key = frontier.pop()
        if key in done:
            continue
        done.add(key)
        for op in outside:
            if key not in op.inputs or not op.outputs or op.outputs == [key]:
                continue
            if getattr(op.packet, "__name__", "") not in allowed:
                return False
            frontier.extend(k for k in op.outputs if k != key)
    return True


def output_projections(ops_by_layer: list[list[Op]], linear_out: list[dict[int, str]],
                       layer_out: list[int | None]) -> tuple[str, ...]:
    """The projection paths that feed nothing but their layer's output in every decoder layer that has them (per
    layer: its ops, its linears' output storages -> paths, its output's storage)."""
    verdicts: dict[str, bool] = {}
    for index, linears in enumerate(linear_out):
        ops, output = ops_by_layer[index], layer_out[index]
        for key, name in linears.items():
            verdicts[name] = verdicts.get(name, True) and _feeds_only_output(key, ops, output)
    return tuple(name for name, ok in verdicts.items() if ok)

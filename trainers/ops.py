"""Which aten operators the model really runs, and whether a device runs them natively.

``capture_ops`` runs one forward and backward of :class:`trainers.model.GPT` with every tensor on
the ``meta`` device (shapes and dtypes, no storage: a 70B model costs nothing) under a
``TorchDispatchMode`` that records each aten operator below autograd, i.e. what a backend must
implement, forward and backward alike.

Fused attention needs one special case. ``F.scaled_dot_product_attention`` is a composite op
that picks its kernel per device: on ``meta`` it would fall back to the math path and the
capture would show ``bmm`` + ``_safe_softmax``, not the fused kernel the model asks for on a
real device. So the capture intercepts that call (a ``TorchFunctionMode``) and records it as
one opaque op, :data:`FUSED_ATTENTION` forward and :data:`FUSED_ATTENTION_BACKWARD` backward
(ATen's names for the flash kernel), with nothing recorded from inside it.

``probe_ops`` runs a small copy of the model (same structure, toy sizes) forward and backward on
a real device under a dispatch mode that grades every aten op as it executes there: ``native``,
``fallback`` (it ran on the host: torch_npu warns that the op "will fall back to run on the
CPU", or the output lands on the host; for fused attention, the math path ran instead of a
fused kernel) or ``error`` (it raised; the probe then computes it on the host and goes on).
Real inputs flow from op to op, so no op is fed made-up arguments. Only a real NPU gives an NPU
table; on the CPU every op is native, which is what the tests check. Imports torch only.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from trainers import rules
from trainers.config import ModelConfig, from_dict
from trainers.model import GPT, count_params, cross_entropy

FUSED_ATTENTION = "aten::_scaled_dot_product_flash_attention"
FUSED_ATTENTION_BACKWARD = "aten::_scaled_dot_product_flash_attention_backward"
# torch_npu's names for its fused attention kernel and its backward (model.attn_impl=npu_fused)
NPU_FUSED_ATTENTION = "npu::npu_fusion_attention"
NPU_FUSED_ATTENTION_BACKWARD = "npu::npu_fusion_attention_grad"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FALLBACK_WORDS = ("fall back", "fallback", "falls back")


@dataclass
class OpCapture:
    """Operators of one forward + backward: name -> number of calls, the dtypes seen, and
    where the model's parameters lived (``meta``: nothing was allocated)."""

    counts: Dict[str, int] = field(default_factory=dict)
    dtypes: Dict[str, List[str]] = field(default_factory=dict)
    param_devices: List[str] = field(default_factory=list)
    n_params: int = 0

    @property
    def names(self) -> List[str]:
        return sorted(self.counts)


class _Recorder(TorchDispatchMode):
    def __init__(self, capture: OpCapture):
        super().__init__()
        self.capture = capture
        self.paused = False

    def note(self, name: str, args: Any, kwargs: Any) -> None:
        cap = self.capture
        cap.counts[name] = cap.counts.get(name, 0) + 1
        seen = cap.dtypes.setdefault(name, [])
        for a in _leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and str(a.dtype).replace("torch.", "") not in seen:
                seen.append(str(a.dtype).replace("torch.", ""))

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused, before = True, self.paused
        try:
            yield
        finally:
            self.paused = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            self.note(func._schema.name, args, kwargs)
        return func(*args, **kwargs)


class _OpaqueAttention(torch.autograd.Function):
    """Fused attention as one op in the capture: shapes flow, nothing inside is recorded."""

    @staticmethod
    def forward(ctx, q, k, v, rec, names):
        ctx.rec, ctx.shapes, ctx.names = rec, (q, k, v), names
        rec.note(names[0], (q, k, v), {})
        with rec.pause():
            return q.new_empty(q.shape[:-1] + (v.shape[-1],))

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.shapes
        ctx.rec.note(ctx.names[1], (grad, q, k, v), {})
        with ctx.rec.pause():
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None


class _InterceptAttention(TorchFunctionMode):
    """Records fused attention as the kernel the model asks for: ATen's flash kernel, or
    torch_npu's fused kernel under ``attn_impl=npu_fused`` (whose stand-in off the NPU is
    scaled_dot_product_attention, so the call is caught the same way)."""

    def __init__(self, rec: _Recorder, names: tuple = (FUSED_ATTENTION, FUSED_ATTENTION_BACKWARD)):
        super().__init__()
        self.rec, self.names = rec, names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _OpaqueAttention.apply(q, k, v, self.rec, self.names)
        return func(*args, **kwargs)


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _leaves(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _leaves(x)
    else:
        yield tree


def capture_ops(model: Dict[str, Any], seq_len: int = 16, batch: int = 1, compute_dtype: str = "fp32") -> OpCapture:
    """Record the aten operators of one training step's forward and backward of ``GPT(model)``,
    built and run on the meta device. ``compute_dtype`` bf16/fp16 runs the model in that dtype
    (autocast has no meta backend), which records the same casts (``_to_copy``) and 16-bit
    kernels autocast would use. Activation checkpointing is left out: it re-runs the same
    forward operators, so the operator set is the same with or without it (and the autograd
    engine does not carry torch-function modes into the recompute, where attention would
    escape the interception)."""
    args = from_dict(ModelConfig, {**model, "activation_checkpointing": False})
    seq_len = max(1, min(int(seq_len), args.max_seq_len))
    with torch.device("meta"):
        net = GPT(args)
    if compute_dtype != "fp32":
        net = net.to(DTYPES[compute_dtype])
    net.train()
    cap = OpCapture(param_devices=sorted({p.device.type for p in net.parameters()}), n_params=count_params(net))
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    rec = _Recorder(cap)
    npu = args.attn_impl == "npu_fused"
    names = (NPU_FUSED_ATTENTION, NPU_FUSED_ATTENTION_BACKWARD) if npu else (FUSED_ATTENTION, FUSED_ATTENTION_BACKWARD)
    with _InterceptAttention(rec, names), rec:
        loss = cross_entropy(net(tokens), tokens)
        loss.backward()
    return cap


def _to(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to(x, device) for x in tree)
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    return tree


def _synchronize(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


def _fell_back(caught: List[warnings.WarningMessage]) -> Optional[str]:
    for w in caught:
        text = str(w.message)
        if any(word in text.lower() for word in FALLBACK_WORDS):
            return text.splitlines()[0][:300]
    return None


class _Prober(TorchDispatchMode):
    """Runs every op on the device and grades it; an op that raises is graded ``error`` and
    computed on the host instead, so one missing kernel does not hide the ones after it."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.results: Dict[str, Dict[str, str]] = {}

    def _grade(self, name: str, status: str, detail: str = "") -> None:
        rank = {"native": 0, "fallback": 1, "error": 2}
        old = self.results.get(name)
        if old is None or rank[status] > rank[old["status"]]:
            self.results[name] = {"status": status, "detail": detail}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = func(*args, **kwargs)
                _synchronize(self.device)
        except Exception as err:  # noqa: BLE001 - a failing kernel is the finding
            self._grade(name, "error", f"{type(err).__name__}: {err}"[:300])
            host = torch.device("cpu")
            return _to(func(*_to(args, host), **_to(kwargs, host)), self.device)
        why = _fell_back(caught)
        on_device = all(t.device.type == self.device.type for t in _leaves(out) if isinstance(t, torch.Tensor))
        if why or not on_device:
            self._grade(name, "fallback", why or "output on the host")
        else:
            self._grade(name, "native")
        return out


def small_model(model: Dict[str, Any]) -> Dict[str, Any]:
    """The same structure (norm, MLP, positions, attention, GQA, tying) at toy sizes: the op set
    depends on the structure, and the probe must run on any device in seconds."""
    heads = 4
    grouped = rules.kv_heads(model["n_heads"], model["n_kv_heads"]) < model["n_heads"]
    return {
        **model,
        "vocab_size": 64,
        "d_model": 32,
        "n_layers": 1,
        "n_heads": heads,
        "n_kv_heads": 2 if grouped else -1,
        "d_ff": 64,
        "max_seq_len": 16,
        "loss_chunks": 1,  # the head and loss at once: the same operators as per chunk, plus a split
    }


def probe_ops(
    device: str,
    model: Optional[Dict[str, Any]] = None,
    plugin: Optional[str] = None,
    compute_dtype: str = "fp32",
    seed: int = 0,
) -> Dict[str, Dict[str, str]]:
    """Run a small copy of ``model`` (default: ModelConfig defaults) forward and backward on
    ``device`` with every aten op graded; return ``{op: {"status": native|fallback|error|unused,
    "detail": ...}}`` for the ops of :func:`capture_ops` plus any the device ran in addition
    (``unused``: captured on meta but reached through another kernel on this device).

    ``plugin`` (``torch_npu``) is imported first so that its device exists. A host fallback is
    told by its warning (torch_npu: "... will fall back to run on the CPU") or by outputs that
    land on the host. Fused attention is graded by what ``F.scaled_dot_product_attention``
    dispatched to: a fused kernel (any op with "attention" in its name) is native, the math
    path (bmm + softmax) is a fallback."""
    if plugin:
        __import__(plugin)
    dev = torch.device(device)
    small = small_model(model or {})
    wanted = capture_ops(small, seq_len=8, batch=2, compute_dtype=compute_dtype).names
    torch.manual_seed(seed)
    net = GPT(from_dict(ModelConfig, {**small, "activation_checkpointing": False})).to(dev).train()
    tokens = torch.randint(0, small["vocab_size"], (2, 9), device=dev)
    autocast = (
        torch.autocast(device_type=dev.type, dtype=DTYPES[compute_dtype])
        if compute_dtype != "fp32"
        else contextlib.nullcontext()
    )
    prober = _Prober(dev)
    with prober:
        with autocast:
            logits = net(tokens[:, :-1])
        loss = cross_entropy(logits, tokens[:, 1:])
        loss.backward()
        _synchronize(dev)
    results = dict(prober.results)
    ran_fused = sorted(n for n in results if "attention" in n and "math" not in n)
    for name in (FUSED_ATTENTION, FUSED_ATTENTION_BACKWARD):
        if name not in wanted or name in results:
            continue
        kernels = [n for n in ran_fused if n.endswith("backward") == name.endswith("backward")]
        if kernels:
            worst = max((results[n] for n in kernels), key=lambda r: r["status"] != "native")
            results[name] = {"status": worst["status"], "detail": "ran as " + ", ".join(kernels)}
        else:
            results[name] = {"status": "fallback", "detail": "no fused attention kernel: the math path ran"}
    for name in wanted:  # the device reached these through another kernel: nothing to grade
        results.setdefault(name, {"status": "unused", "detail": "not dispatched on this device"})
    return dict(sorted(results.items()))

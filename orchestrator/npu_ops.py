"""``python -m orchestrator.npu_ops``: the aten operators a torch_npu release registers for the NPU,
read from its own sources, as the operator table the planner checks a model against
(``chip.op_table``, ``orchestrator/planner/operators.py``).

    python -m orchestrator.npu_ops \\
        --op-plugin third_party/op-plugin/op_plugin/config/op_plugin_functions.yaml \\
        --native torch_npu/csrc/aten/npu_native_functions.yaml --torch 2.7 \\
        --source "torch_npu v7.3.0-pytorch2.7.1, op-plugin 7213914" \\
        --out conf/op_tables/torch_npu-v7.3.0-pytorch2.7.1.json

Run at build time on a checkout of the release (the op-plugin submodule at the commit the tag
pins), never at run time. Two files name what a release registers:

- op-plugin's ``op_plugin_functions.yaml``: its ``official`` and ``symint`` sections are aten
  operators, each ``func`` with the torch versions its kernels cover (``acl_op``, ``op_api``, ...):
  ``all_version`` (the file's ``all_version`` list), ``[vA, vB]`` or ``[vA, newest]`` (a range,
  inclusive) or ``vA, vB`` (a list), as op-plugin's own ``codegen/utils.py get_version`` reads
  them. An operator counts for torch ``--torch`` when one of its kernels covers that version.
  Its ``custom`` section is torch_npu's own ``npu_*`` operators, not aten's: left out.
- torch_npu's ``npu_native_functions.yaml``: the ``supported`` and ``symint`` entries (a name,
  or a ``func``) it implements itself (tensor factories, copies, views' storage).

The table keeps each operator's name without its overload (``aten::add``), as the capture of a
model counts them; the overloads registered are kept beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set

import yaml

from orchestrator import cli

# keys of an op-plugin entry that hold a kernel's torch versions
KERNEL_KEYS = ("acl_op", "op_api", "dvm")
_NAME = re.compile(r"^\s*([A-Za-z0-9_]+)(\.[A-Za-z0-9_]+)?")


def versions(value: Any, all_version: List[str]) -> List[str]:
    """The torch versions one kernel entry covers (op-plugin's ``get_version``)."""
    if value is None:
        return []
    if isinstance(value, list):
        lo = all_version.index(str(value[0]).strip())
        hi = None if str(value[1]).strip() == "newest" else all_version.index(str(value[1]).strip())
        return all_version[lo:] if hi is None else all_version[lo : hi + 1]
    if str(value) == "all_version":
        return list(all_version)
    return [v.strip() for v in str(value).split(",") if v.strip()]


def _name(func: str) -> Optional[str]:
    """``name.overload`` of a schema (``add.Tensor(Tensor self, ...) -> Tensor``)."""
    m = _NAME.match(str(func))
    return (m.group(1) + (m.group(2) or "")) if m else None


def op_plugin_ops(doc: Dict[str, Any], torch_version: str) -> Set[str]:
    """``name.overload`` of every aten operator op-plugin registers for ``torch_version`` (``v2.7``)."""
    all_version = [str(v).strip() for v in doc.get("all_version") or []]
    out: Set[str] = set()
    for section in ("official", "symint"):
        for entry in doc.get(section) or []:
            name = _name(entry.get("func", ""))
            covered = any(torch_version in versions(entry.get(k), all_version) for k in KERNEL_KEYS if k in entry)
            if name and covered:
                out.add(name)
    return out


def native_ops(doc: Dict[str, Any]) -> Set[str]:
    """``name.overload`` of what torch_npu's ``npu_native_functions.yaml`` implements itself."""
    out: Set[str] = set()
    for section in ("supported", "symint"):
        for entry in doc.get(section) or []:
            name = _name(entry.get("func", "") if isinstance(entry, dict) else entry)
            if name:
                out.add(name)
    return out


def table(registered: Iterable[str], source: str, torch_version: str) -> Dict[str, Any]:
    """The shipped table: ``aten::name`` -> its registered overloads (``default`` for none)."""
    ops: Dict[str, List[str]] = {}
    for full in sorted(set(registered)):
        base, _, overload = full.partition(".")
        ops.setdefault(f"aten::{base}", []).append(overload or "default")
    return {"source": source, "torch": torch_version, "n_ops": len(ops), "ops": ops}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.npu_ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--op-plugin", required=True, type=Path, help="op-plugin's op_plugin_functions.yaml")
    ap.add_argument("--native", required=True, type=Path, help="torch_npu's npu_native_functions.yaml")
    ap.add_argument("--torch", required=True, help="the torch minor version the release is built for (2.7)")
    ap.add_argument("--source", required=True, help="what the files came from (release tag, op-plugin commit)")
    ap.add_argument("--out", required=True, type=Path, help="the table, JSON")
    cli.add_json_arg(ap, "the table's figures")
    args = ap.parse_args(argv)
    version = "v" + args.torch.lstrip("v")
    try:
        plugin = yaml.safe_load(args.op_plugin.read_text())
        if version not in [str(v).strip() for v in plugin.get("all_version") or []]:
            raise ValueError(f"--torch {args.torch}: {args.op_plugin} covers {plugin.get('all_version')}")
        native = yaml.safe_load(args.native.read_text())
        ops = op_plugin_ops(plugin, version) | native_ops(native)
    except (OSError, ValueError, yaml.YAMLError, AttributeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = table(ops, args.source, args.torch)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    info = {"out": str(args.out), "source": args.source, "torch": args.torch, "ops": out["n_ops"]}
    info["overloads"] = len(ops)
    print(json.dumps(info) if args.json else ", ".join(f"{k} {v}" for k, v in info.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

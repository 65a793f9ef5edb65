"""Ascend NPU profiles: the compute / communication split and the top operators that torch_npu's own
offline analysis writes (an NPU trace has no ``events()`` to account, see ``trainers.trace_accounting``)."""

from __future__ import annotations

import csv
import glob
import os
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence

from trainers.trace_accounting import Breakdown, is_comm, top_rows

# Ascend NPU: torch_npu's own analysis output (Ascend/pytorch, torch_npu/profiler/analysis/).
# step_trace_time.csv, written by prof_view/_trace_step_time_parser.py (TraceStepTimeParser.title):
#   Device_id, Step, Computing, Communication(Not Overlapped), Overlapped, Communication, Free, Stage, Bubble,
#   Communication(Not Overlapped and Exclude Receive), Preparing
# in microseconds, one row per device and step (Step empty when no schedule marks steps), where
# Overlapped = Communication - Communication(Not Overlapped).
# op_statistic.csv: prof_bean/_op_statistic_bean.py (OpStatisticBean.HEADERS):
#   OP Type, Core Type, Count, Total Time(us), Min Time(us), Avg Time(us), Max Time(us), Ratio(%)
# Both are read by header name, so a column added or moved in another version does not shift the others.
NPU_OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"  # prof_common_func/_constant.py: Constant.OUTPUT_DIR


def _float(value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return 0.0
    return v if v == v else 0.0  # NaN


def _column(header: Sequence[str], *names: str) -> Optional[str]:
    """The header entry equal to one of ``names``, ignoring case and surrounding spaces."""
    norm = {h.strip().lower(): h for h in header if h}
    for n in names:
        if n.lower() in norm:
            return norm[n.lower()]
    return None


def read_step_trace_time(path: str, wall_s: float = 0.0) -> Breakdown:
    """The breakdown summed over the rows (steps) of a ``step_trace_time.csv``. The wall is the host's
    ``wall_s`` or, if longer, the device's own Computing + Communication(Not Overlapped) + Free."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        cols = {
            "compute": _column(header, "Computing"),
            "comm": _column(header, "Communication"),
            "not_overlapped": _column(header, "Communication(Not Overlapped)"),
            "overlapped": _column(header, "Overlapped"),
            "free": _column(header, "Free"),
        }
        if cols["compute"] is None or cols["comm"] is None:
            raise ValueError(f"{path}: no Computing / Communication columns in {header}")
        sums = dict.fromkeys(cols, 0.0)
        for row in reader:
            for key, col in cols.items():
                if col is not None:
                    sums[key] += _float(row.get(col))
    compute, comm = sums["compute"] / 1e6, sums["comm"] / 1e6
    if cols["overlapped"] is not None:
        overlap = sums["overlapped"] / 1e6
    elif cols["not_overlapped"] is not None:
        overlap = comm - sums["not_overlapped"] / 1e6
    else:
        overlap = 0.0
    overlap = min(max(overlap, 0.0), compute, comm)
    device_wall = compute + comm - overlap + sums["free"] / 1e6
    return Breakdown(max(wall_s, device_wall), compute, comm, overlap)


def read_op_statistic(path: str) -> List[Dict[str, Any]]:
    """Ops by total device time from an ``op_statistic.csv`` (rows per OP Type and Core Type, merged)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        name_col = _column(header, "OP Type", "Op Type", "Type", "Name")
        time_col = _column(header, "Total Time(us)", "Total Time")
        count_col = _column(header, "Count")
        if name_col is None or time_col is None:
            raise ValueError(f"{path}: no OP Type / Total Time(us) columns in {header}")
        times: Dict[str, float] = defaultdict(float)
        calls: Dict[str, int] = defaultdict(int)
        for row in reader:
            name = (row.get(name_col) or "").strip()
            times[name] += _float(row.get(time_col)) / 1e6
            calls[name] += int(_float(row.get(count_col))) if count_col else 0
    return top_rows(times, calls, is_comm)


def newest_ascend_dir(root: str, worker: str) -> Optional[str]:
    """The newest ``<worker>_<pid>_<time>_ascend_pt`` directory under ``root`` (the name torch_npu's
    ``_profiler_path_creator.py: ProfPathCreator.create_prof_dir`` gives each profile)."""
    found = [d for d in glob.glob(os.path.join(root, f"{worker}_*_ascend_pt")) if os.path.isdir(d)]
    return max(found, key=os.path.getmtime) if found else None

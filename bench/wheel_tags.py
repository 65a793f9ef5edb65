"""Wheel file names and their tags, against what the lent GPU machine installs.

    from bench.wheel_tags import parse_wheel, tag_ok
    parse_wheel("graphene-3.4.3-py2.py3-none-any.whl")  # ("graphene", "3.4.3", [(py, abi, platform), ...])
    tag_ok("cp312", "abi3", "manylinux_2_17_x86_64")    # True: the machine's CPython 3.12 installs it

The machine's side of the tags (its CPython, the newest glibc its wheels may need, the platform
tags ``pip download`` asks for) and PEP 503's project names, which a wheel's file name is read
into. ``bench/device_bundle.py`` builds the bundle with these; :class:`BundleError` is what stops
it, here because :func:`parse_wheel` raises it.
"""

from __future__ import annotations

import re
from typing import List, Tuple

PYTHON = (3, 12)  # the machine's python3 is 3.12.3
# torch 2.11+cu130 there needs glibc 2.28 itself, so manylinux_2_28 and older tags fit the machine;
# pip matches each manylinux_2_N exactly, so the older ones are named one by one
MAX_GLIBC = (2, 28)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64"]
PLATFORMS += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


class BundleError(RuntimeError):
    pass


def normalize(name: str) -> str:
    """PEP 503's normalised project name (``PyYAML`` and ``pyyaml``, ``typing_extensions`` and
    ``typing-extensions`` are one project)."""
    return re.sub(r"[-_.]+", "-", name).lower()


WHEEL_RE = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-(?P<build>\d[^-]*))?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


def parse_wheel(filename: str) -> Tuple[str, str, List[Tuple[str, str, str]]]:
    """(project, version, [(python, abi, platform) tags]) from a wheel's file name (PEP 427,
    compressed tag sets such as ``py2.py3`` expanded)."""
    m = WHEEL_RE.match(filename)
    if not m:
        raise BundleError(f"{filename}: not a wheel file name")
    tags = [(p, a, pl) for p in m["py"].split(".") for a in m["abi"].split(".") for pl in m["plat"].split(".")]
    return normalize(m["name"]), m["version"], tags


def platform_ok(plat: str) -> bool:
    if plat == "any":
        return True
    if plat in ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"):
        return True
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", plat)
    return bool(m) and (int(m[1]), int(m[2])) <= MAX_GLIBC


def tag_ok(py: str, abi: str, plat: str, python: Tuple[int, int] = PYTHON) -> bool:
    """Whether the machine's CPython ``python`` on x86-64 manylinux installs a wheel of this tag:
    ``cp312-cp312``, ``cp3N-abi3`` with N <= 12, or pure Python (``py3``/``py312``/``cp312``
    with abi ``none``), on ``any`` or a manylinux x86-64 platform it has the glibc for."""
    if not platform_ok(plat):
        return False
    cp = f"cp{python[0]}{python[1]}"
    if abi == cp:
        return py == cp
    if abi == "abi3":
        m = re.fullmatch(r"cp(\d)(\d+)", py)
        return bool(m) and int(m[1]) == python[0] and int(m[2]) <= python[1]
    if abi == "none":
        return py in (f"py{python[0]}", f"py{python[0]}{python[1]}", cp)
    return False

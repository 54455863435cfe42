"""Checks what a repaired wheel's compiled files need from outside the wheel.

    python scripts/wheel_libraries.py WHEEL [WHEEL ...]     (in .venv-build: auditwheel, pyelftools)

Every shared library a compiled file of the wheel names (DT_NEEDED) must be in the wheel itself (what
auditwheel grafted into kda_kernels.libs/), on the library list of the manylinux policy the wheel's
tag names (auditwheel's own policy table), or the OpenMP runtime libgomp.so.1, which kda takes from
the process by design (torch's copy or the system's: one OpenMP runtime for kda's threads and
torch's). Prints each file's needs; exits 1 naming anything else.
"""

import io
import json
import re
import sys
import zipfile
from pathlib import Path

import auditwheel
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

BY_DESIGN = {"libgomp.so.1"}
# glibc's dynamic loader (named for its TLS entry points) is part of every manylinux system; the
# policy tables leave it out because auditwheel never treats the loader as a dependency.
LOADER = re.compile(r"^ld-linux-(x86-64|aarch64)\.so\.[12]$")


def policy_libraries(tag: str) -> set[str]:
    table = json.loads((Path(auditwheel.__file__).parent / "policy" / "manylinux-policy.json").read_text())
    for policy in table:
        if policy["name"] == tag:
            return set(policy["lib_whitelist"])
    raise SystemExit(f"wheel_libraries: no manylinux policy named {tag}")


def needed(data: bytes) -> list[str]:
    elf = ELFFile(io.BytesIO(data))
    names = []
    for section in elf.iter_sections():
        if isinstance(section, DynamicSection):
            names += [tag.needed for tag in section.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
    return names


def check(wheel: Path) -> bool:
    found = re.search(r"-(manylinux_\d+_\d+)_(x86_64|aarch64)\.whl$", wheel.name)
    if not found:
        print(f"{wheel.name}: not a repaired manylinux wheel")
        return False
    allowed = policy_libraries(found.group(1))
    ok = True
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        inside = {Path(n).name for n in names}
        for name in names:
            data = z.read(name)
            if not data.startswith(b"\x7fELF"):
                continue
            needs = needed(data)
            outside = [n for n in needs if n not in inside | allowed | BY_DESIGN and not LOADER.match(n)]
            print(f"{wheel.name}: {name} needs {', '.join(needs) or 'nothing'}")
            if outside:
                ok = False
                print(f"  outside the wheel and the {found.group(1)} policy: {', '.join(outside)}")
    return ok


if __name__ == "__main__":
    results = [check(Path(arg)) for arg in sys.argv[1:]]
    sys.exit(0 if results and all(results) else 1)

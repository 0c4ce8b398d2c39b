"""Run the comparisons, print one table, and rewrite their sections of RESULTS.md.

    python -m benchmarks.run [spawn queue m2m arrays torch pool throughput run_sync loader
                              serving cuda ray ray_spawn] [--quick] [--no-write]

Each comparison runs in its own interpreter (``python -m benchmarks.bench_<name>``): spawn
children re-import their parent's main module, and that must be the small comparison
module, not this runner; and no comparison inherits another's threads or children.
RESULTS.md is generated whole: a header, then one section per comparison (its run line,
the machine's facts, its table and notes). A run of some comparisons rewrites their
sections and keeps the others' as the file has them.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from subprocess import PIPE, STDOUT

from benchmarks import _common as c

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TITLES = {
    "spawn": "Spawn and failure propagation",
    "queue": "Small-message round trip",
    "m2m": "Many-to-many throughput (4 producers, 2 consumers)",
    "arrays": "Arrays through a queue",
    "torch": "torch tensors through a queue",
    "pool": "Pool",
    "throughput": "Per-call throughput: 32 concurrent one-call tasks on two workers",
    "run_sync": "run_sync and the default pool",
    "loader": "Data loading",
    "serving": "Serving: dynamic batching (pool.batched against pool.apply)",
    "cuda": "CuPy arrays as CUDA IPC handles (needs a GPU)",
    "ray": "aiomp.ray.Pool on a local Ray instance (needs Ray)",
    "ray_spawn": "aiomp.ray.spawn on a two-node local Ray cluster (needs Ray and torch)",
}
NAMES = tuple(TITLES)  # in the order they run and RESULTS.md lists them
RESULTS = os.path.join(HERE, "RESULTS.md")
#: A comparison that runs longer than this is stopped and reported as an error.
TIMEOUT = 300
#: One comparison's section in RESULTS.md, from its begin marker to its end marker.
SECTION = re.compile(r"<!-- results:(\w+):begin -->.*?<!-- results:\1:end -->", re.DOTALL)


def machine_facts() -> str:
    from importlib import metadata

    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    versions = [f"aiomp {aiomp_version()}"]
    for pkg in ("anyio", "numpy", "torch", "aiomultiprocess", "uvloop", "trio-parallel"):
        try:
            versions.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{pkg} (not installed)")
    return (
        f"{os.cpu_count()} cores ({model[1] if model else '?'}), Linux {platform.release()}, "
        f"Python {platform.python_version()}; " + ", ".join(versions)
    )


def aiomp_version() -> str:
    """aiomp's version and the commit the working tree is on (it may hold more)."""
    try:
        import aiomp

        version = aiomp.__version__
    except ImportError:
        return "(not importable)"
    git = ["git", "rev-parse", "--short", "HEAD"]
    try:
        head = subprocess.run(git, cwd=ROOT, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        head = ""
    head = head.strip()
    return f"{version} (working tree at {head})" if head else version


def run_one(name: str, quick: bool) -> dict[str, Any]:
    """Run one comparison in a fresh interpreter; its rows, or an error row."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", f"benchmarks.bench_{name}", "--json", out]
    if quick:
        cmd.append("--quick")
    load = os.getloadavg()[0]
    t0 = c.now()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=TIMEOUT, stdout=PIPE, stderr=STDOUT, text=True)
        output, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out_b = exc.stdout or b""
        output = out_b.decode() if isinstance(out_b, bytes) else out_b
        code = f"timed out after {TIMEOUT} s"
    elapsed = c.now() - t0
    load = (load + os.getloadavg()[0]) / 2
    try:
        if code != 0:
            tail = "\n".join(output.strip().splitlines()[-15:])
            print(f"[{name}] failed ({code}):\n{tail}", file=sys.stderr)
            last = tail.splitlines()[-1] if tail else ""
            row = c.row(
                f"{name}: the comparison failed", None, None, "—", None, f"exit {code}: {last}"
            )
            row["status"] = "error"
            return {"name": name, "rows": [row], "notes": [], "elapsed": elapsed, "load": load}
        import json

        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    finally:
        os.unlink(out)
    result["elapsed"] = elapsed
    result["load"] = load
    return result


def section(result: dict[str, Any], when: str, facts: str) -> str:
    name = result["name"]
    return "\n".join(
        [
            f"<!-- results:{name}:begin -->",
            f"### {TITLES.get(name, name)}",
            "",
            f"Run {when} (`python -m benchmarks.run {name}`, {result['elapsed']:.0f} s, "
            f"1-min load average {result['load']:.2f} during the run). {facts}.",
            "",
            c.report(result["rows"], result["notes"]),
            f"<!-- results:{name}:end -->",
        ]
    )


HEADER = """# aiomp benchmark results

Generated by `python -m benchmarks.run`: do not edit by hand. Every figure is a median, and
every ratio is aiomp's time over a baseline's time measured in the same run. How it
measures, and the targets: benchmarks/README.md. Why the code is built as it is:
docs/decisions/.
"""


def write_results(results: list[dict[str, Any]], when: str, facts: str) -> None:
    """Rewrite RESULTS.md: the header, then each comparison's section in NAMES order, the
    new ones from ``results``, the others as the file has them."""
    try:
        with open(RESULTS) as f:
            sections = {m.group(1): m.group(0) for m in SECTION.finditer(f.read())}
    except FileNotFoundError:
        sections = {}
    for result in results:
        sections[result["name"]] = section(result, when, facts)
    with open(RESULTS, "w") as f:
        f.write(HEADER + "".join(f"\n{sections[n]}\n" for n in NAMES if n in sections))


USAGE = "usage: python -m benchmarks.run [--quick] [--no-write] [NAME ...]; NAME is one of "


def main(argv: list[str]) -> int:
    options = {a for a in argv if a.startswith("-")}
    if options - {"--quick", "--no-write"}:
        # --help included: an unknown option must not start (and write) a full run
        print(USAGE + ", ".join(NAMES), file=sys.stderr)
        return 0 if options & {"-h", "--help"} else 2
    quick = "--quick" in argv
    write = "--no-write" not in argv
    names = [a for a in argv if not a.startswith("-")] or list(NAMES)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        print(f"unknown comparison(s) {unknown}; choose from {', '.join(NAMES)}", file=sys.stderr)
        return 2
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    facts = machine_facts()
    print(f"{when}: {facts}", flush=True)
    results = []
    for name in names:
        print(f"\n== {name} ==", flush=True)
        result = run_one(name, quick)
        print(c.report(result["rows"], result["notes"]), flush=True)
        results.append(result)
    rows = [r for res in results for r in res["rows"]]
    print("\n== all ==")
    print(c.format_table(rows))
    if write and not quick:
        write_results(results, when, facts)
        print(f"\nwrote {os.path.relpath(RESULTS)}")
    elif write:
        print("\n(--quick: RESULTS.md left as it was)")
    return 1 if any(r["status"] in ("FAIL", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

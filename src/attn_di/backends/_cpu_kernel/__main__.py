"""``python -m attn_di.backends._cpu_kernel [build|status] [--isa ISA] [--force] [--verbose]``.

``build`` compiles CPU_ATTN's kernel for this CPU (or ``--isa``) into the cache unless a
good build is there (``--force``: rebuild anyway), and exits 1 with the reason if it
cannot; ``status`` loads it (building if needed) and prints which path CPU_ATTN takes, or
exits 2 with one error line if ``ATTN_DI_CPU_KERNEL`` holds an unknown value.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from attn_di.backends import _cpu_kernel
from attn_di.exceptions import AttnDIError


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m attn_di.backends._cpu_kernel")
    parser.add_argument("command", choices=["build", "status"], nargs="?", default="status")
    parser.add_argument("--isa", choices=sorted(_cpu_kernel.ISAS), default=None)
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a good build is in the cache"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "status":
        try:
            status = _cpu_kernel.kernel_status()
        except AttnDIError as exc:
            print(f"{parser.prog}: error: {exc.message()}", file=sys.stderr)
            if exc.hint:
                print(f"hint: {exc.hint}", file=sys.stderr)
            return 2
        print(f"CPU_ATTN runs: {status.describe()}")
        if status.bfloat16:
            print(f"CPU_ATTN bfloat16: {status.bfloat16}")
        return 0
    start = time.perf_counter()
    try:
        library = _cpu_kernel.build(args.isa, verbose=args.verbose, force=args.force)
    except Exception as exc:  # report any build failure as one line
        print(f"CPU_ATTN's kernel was not built: {exc}", file=sys.stderr)
        hint = getattr(exc, "hint", None)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        return 1
    print(f"CPU_ATTN's kernel: {library} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

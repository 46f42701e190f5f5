"""An example engine that receives its attention backend by injection.

Run: ``python examples/engine/engine.py``. The engine's constructor asks for
``Provide[BackendContainer.CUSTOM]``; the script registers the example's ToyBackend for
CUSTOM, runs a few decode steps, then swaps the backend with ``container.override``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from dependency_injector.wiring import Provide, inject

from attn_di import AttentionBackendEnum, BackendContainer, get_container, register_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))  # make toy_backend importable

MEMBER = AttentionBackendEnum.CUSTOM


class ToyEngine:
    """Decodes a sequence of random vectors through the injected backend's impl.

    Args:
        backend_cls: injected from the wired container's CUSTOM provider.
        head_size: vector length.
    """

    @inject
    def __init__(
        self,
        backend_cls: type[Any] = Provide[BackendContainer.CUSTOM],
        head_size: int = 8,
    ) -> None:
        self.backend_cls = backend_cls
        self.head_size = head_size
        self.impl = backend_cls.get_impl_cls()(head_size=head_size, scale=head_size**-0.5)
        self.kv_cache: list[tuple[list[float], list[float]]] = []

    def step(self, query: list[float], key: list[float], value: list[float]) -> list[float]:
        """Run one decode step for one token; returns its attention output."""
        return list(self.impl.forward(query, key, value, self.kv_cache))

    def decode(self, steps: int, seed: int = 0) -> list[list[float]]:
        """Decode ``steps`` tokens of seeded random q/k/v; returns every step's output."""
        rng = random.Random(seed)
        outputs = []
        for _ in range(steps):
            q, k, v = ([rng.uniform(-1, 1) for _ in range(self.head_size)] for _ in range(3))
            outputs.append(self.step(q, k, v))
        return outputs


def main() -> int:
    container = get_container()
    register_backend(MEMBER, "toy_backend.ToyBackend")
    container.wire(modules=[__name__], warn_unresolved=True)
    try:
        engine = ToyEngine()
        last = engine.decode(steps=16)[-1]
        print(f"{MEMBER.name} -> {MEMBER.get_path()} ({container.source(MEMBER)})")
        print(
            f"  injected {engine.backend_cls.get_name()}: last output[:4] = "
            f"{[round(x, 4) for x in last[:4]]}"
        )
        with container.override(MEMBER, "toy_backend.UniformBackend"):
            swapped = ToyEngine()
            last = swapped.decode(steps=16)[-1]
            print(
                f"  inside override: injected {swapped.backend_cls.get_name()}: "
                f"last output[:4] = {[round(x, 4) for x in last[:4]]}"
            )
        print(f"  after the block: injected {ToyEngine().backend_cls.get_name()}")
    finally:
        container.unwire()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a benchmark returns: named figures, each with the hardware bound and the peer's figure
for the same quantity where it has them, printed as ratios (docs/benchmarks.md asks every benchmark
for its ratio to the bound of its own workload, and to a peer run in the same run)."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.bench.ceilings import DeviceCeilings


def fmt(x: float) -> str:
    """A figure as people read it: thousands separated, four significant digits below."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


@dataclass(frozen=True)
class Figure:
    """One measured quantity. `bound` and `peer` are in the same unit as `value`; for a time
    (higher_is_better False) the ratio is bound / value, so 1.0 is the bound either way."""

    name: str
    value: float
    unit: str = ""
    bound: float | None = None
    peer: float | None = None
    higher_is_better: bool = True
    peer_name: str | None = None
    """Who `peer` is, where the workload itself runs it (W5's transformers); else --peer's."""
    bound_name: str | None = None
    """What `bound` is where it is no hardware bound (start-up's goal); recorded as NAME/bound."""

    def _ratio(self, other: float | None) -> float | None:
        if other is None or other <= 0 or self.value <= 0:
            return None
        return self.value / other if self.higher_is_better else other / self.value

    @property
    def ratio_to_bound(self) -> float | None:
        return self._ratio(self.bound)

    @property
    def ratio_to_peer(self) -> float | None:
        return self._ratio(self.peer)

    def line(self, peer_name: str | None = None) -> str:
        text = f"{self.name}: {fmt(self.value)} {self.unit}".rstrip()
        notes = []
        if self.ratio_to_bound is not None:
            notes.append(f"{self.ratio_to_bound:.4g} of {self.bound_name or 'the hardware bound'} "
                         f"({fmt(self.bound)} {self.unit})".replace(" )", ")"))
        if self.ratio_to_peer is not None:
            notes.append(f"{self.ratio_to_peer:.3f}x {self.peer_name or peer_name or 'the peer'} "
                         f"({fmt(self.peer)} {self.unit})".replace(" )", ")"))
        return text + (f"  [{'; '.join(notes)}]" if notes else "")

    def record(self) -> dict[str, float]:
        """The figure as record entries: NAME, and NAME/bound, NAME/peer for the ratios."""
        out = {self.name: round(self.value, 6)}
        if self.ratio_to_bound is not None:
            out[f"{self.name}/bound"] = float(f"{self.ratio_to_bound:.4g}")
        if self.ratio_to_peer is not None:
            out[f"{self.name}/peer"] = float(f"{self.ratio_to_peer:.4g}")
        return out


def print_figures(figures: list[Figure], peer_name: str | None = None,
                  ceilings: DeviceCeilings | None = None) -> None:
    """The figures, one a line, and the ceilings their hardware bounds were taken at."""
    if not figures:
        return
    print("figures:", flush=True)
    for f in figures:
        print(f"  {f.line(peer_name)}", flush=True)
    if ceilings is not None and any(f.bound is not None and f.bound_name is None
                                    for f in figures):
        print(f"  hardware bound at: {ceilings.describe()}", flush=True)


def as_record(figures: list[Figure]) -> dict[str, float]:
    out: dict[str, float] = {}
    for f in figures:
        out.update(f.record())
    return out

"""The one error a workload raises for a flag it cannot honour (printed as a usage error)."""


class BenchUsageError(ValueError):
    """A flag the workload cannot honour; the tool prints it naming the workload, exit 2."""


class BenchFailed(RuntimeError):
    """The run measured what it should and found it wrong (e.g. TP parity below its floor):
    the tool prints the figures, records nothing and exits 1."""

    def __init__(self, message: str, figures: list) -> None:
        super().__init__(message)
        self.figures = figures

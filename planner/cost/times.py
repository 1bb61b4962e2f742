"""The time terms of a layer's or a module's passes: one definition for the layer terms, the module sums, the module
cost and the Plan's ``ModuleTime`` (whose schema names and describes them, ``planner.contract.schema.PASS_TIME_DOCS``)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(kw_only=True, frozen=True, slots=True)
class PassTimes:
    """Seconds of compute and of the layer collectives, by cause (``PASS_TIME_DOCS``)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    tp_comm_s: float = 0.0
    sp_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0

    def terms(self) -> dict[str, float]:
        """The terms by name (of a record that has more fields)."""
        return {name: getattr(self, name) for name in PASS_TIME_FIELDS}

    def pass_times(self) -> "PassTimes":
        """These terms alone."""
        return PassTimes(**self.terms())

    def plus(self, other: "PassTimes", times: float = 1.0) -> "PassTimes":
        """These terms with ``times`` copies of ``other``'s added."""
        return PassTimes(**{name: getattr(self, name) + times * getattr(other, name) for name in PASS_TIME_FIELDS})

    def scaled(self, factor: float) -> "PassTimes":
        """Every term times ``factor`` (one micro-batch's terms -> a step's)."""
        return PassTimes().plus(self, factor)

    @property
    def collectives_s(self) -> float:
        """The layer collectives: TP + SP + CP + EP."""
        return self.tp_comm_s + self.sp_comm_s + self.cp_comm_s + self.ep_comm_s

    @property
    def total_s(self) -> float:
        """Compute and layer collectives together."""
        return self.forward_s + self.backward_s + self.recompute_s + self.collectives_s


PASS_TIME_FIELDS = tuple(f.name for f in fields(PassTimes))

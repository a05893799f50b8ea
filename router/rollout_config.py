"""The `rollout:` key of a model with versions, parsed: how a candidate version is rolled out.

The candidate's share of the name's traffic rises through `steps`; each step lasts at least
`step_min_s` and until the candidate has answered `min_samples` requests, and the decision rule
(`router.serving.rollout`) then advances, promotes the candidate after the last step, or rolls
it back as soon as its answers are worse than the stable version's. `false_alarm_rate` is the
rule's stated chance of rolling back a candidate that is as good as the stable version, over the
whole rollout. The candidate being one of the model's versions, and not its stable version, is
checked with the rest of the model's section (`router.config`).
"""

from __future__ import annotations

from itertools import pairwise

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["DEFAULT_STEPS", "RolloutConfig"]

#: The candidate's weight (percent of the name's requests) at each step, when the file names none.
DEFAULT_STEPS = (5.0, 25.0, 50.0, 100.0)


class RolloutConfig(BaseModel):
    """One rollout: the candidate, its steps and the decision rule's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    candidate: str = Field(min_length=1, description="the version being rolled out")
    steps: list[float] = Field(
        default_factory=lambda: list(DEFAULT_STEPS),
        min_length=1,
        max_length=20,
        description="the candidate's weight in percent at each step, increasing, each in (0, 100]",
    )
    step_min_s: float = Field(60.0, ge=0, description="the least time a step lasts, in seconds")
    min_samples: int = Field(
        200, ge=1, description="candidate answers a step needs before it can advance (and before its final look)"
    )
    false_alarm_rate: float = Field(
        0.01, description="chance of rolling back a candidate as good as the stable version, over the whole rollout"
    )
    min_agreement: float = Field(
        0.9, description="least mean agreement of the candidate's answers with the stable's on the same inputs, 0 to 1"
    )

    @field_validator("steps")
    @classmethod
    def _increasing_percents(cls, value: list[float]) -> list[float]:
        for step in value:
            if not 0 < step <= 100:
                raise ValueError(f"each step is a weight in percent in (0, 100], got {step} in {value}")
        for before, after in pairwise(value):
            if after <= before:
                raise ValueError(f"steps must increase, got {after} after {before} in {value}")
        return value

    @field_validator("false_alarm_rate")
    @classmethod
    def _alpha(cls, value: float) -> float:
        if not 0 < value < 0.5:
            raise ValueError(f"false_alarm_rate is a probability in (0, 0.5), e.g. 0.01; got {value}")
        return value

    @field_validator("min_agreement")
    @classmethod
    def _agreement(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"min_agreement is a share in [0, 1] (1.0: answers the same), got {value}")
        return value

"""The data-relevant part of a training device mesh."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from batchweave._checks import as_int

__all__ = ["Mesh", "check_mesh"]

MAX_DEGREE = 1 << 20
"""Largest ``dp`` or ``cp`` (stored manifests and footers with a larger one fail to decode)."""


class Mesh(BaseModel):
    """Data-parallel (``dp``) and context-parallel (``cp``) degrees of a training run.

    A TGB holds ``dp * cp`` slices; slice ``(d, c)`` (CP chunk ``c`` of DP replica ``d``) sits at
    index ``d * cp + c``. Tensor- and pipeline-parallel ranks read what their DP/CP peers read, so
    they are not part of the mesh stored with the data.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(ge=1, le=MAX_DEGREE)
    cp: int = Field(default=1, ge=1, le=MAX_DEGREE)

    def __init__(self, *, dp: int, cp: int = 1) -> None:
        # Checked here, not by pydantic, so a mistake is one line naming the degree (pydantic's
        # message is a multi-line ValidationError, and its lax mode takes True, "4" and 1.0).
        super().__init__(dp=_degree("dp", dp), cp=_degree("cp", cp))

    # Marks the override as pydantic's own __init__ (as pydantic's RootModel does), so that
    # validating a stored mesh (a manifest or footer being decoded) does not call it: there the
    # field constraints refuse a bad value with a ValidationError naming ``mesh.dp``, which the
    # decoders report as a FormatError, not a bare TypeError.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @property
    def slices(self) -> int:
        """Number of slices in one TGB: ``dp * cp``."""
        return self.dp * self.cp

    def slice_index(self, dp_rank: int, cp_rank: int) -> int:
        """Position of slice ``(dp_rank, cp_rank)`` in a TGB's slice list."""
        if type(dp_rank) is not int or type(cp_rank) is not int:
            dp_rank, cp_rank = as_int("dp_rank", dp_rank), as_int("cp_rank", cp_rank)
        if not (0 <= dp_rank < self.dp and 0 <= cp_rank < self.cp):
            name, value, size = (
                ("dp_rank", dp_rank, self.dp)
                if not 0 <= dp_rank < self.dp
                else ("cp_rank", cp_rank, self.cp)
            )
            raise ValueError(
                f"slice ({dp_rank}, {cp_rank}) is outside mesh dp={self.dp}, cp={self.cp}: "
                f"{name} must be in [0, {size}), got {value}"
            )
        return dp_rank * self.cp + cp_rank

    def __str__(self) -> str:
        return f"dp={self.dp}, cp={self.cp}"


def _degree(name: str, value: object) -> int:
    """``value`` as a plain ``int`` in ``[1, MAX_DEGREE]``; ``TypeError`` or ``ValueError``."""
    degree = as_int(name, value)  # True, "4" and 4.0 are mistakes, as for ranks
    if not 1 <= degree <= MAX_DEGREE:
        bound = ">= 1" if degree < 1 else f"<= {MAX_DEGREE}"
        raise ValueError(f"Mesh {name} must be {bound}, got {degree}")
    return degree


def check_mesh(mesh: object) -> None:
    """Refuse a mesh that is not a :class:`Mesh`: a tuple or dict fails later, far from here."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a batchweave.Mesh, got the {type(mesh).__name__} {mesh!r}; "
            "e.g. mesh=batchweave.Mesh(dp=8, cp=2)"
        )

"""The data-relevant part of a training device mesh."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from batchweave._checks import as_int

__all__ = ["Mesh"]


class Mesh(BaseModel):
    """Data-parallel (``dp``) and context-parallel (``cp``) degrees of a training run.

    A TGB holds ``dp * cp`` slices; slice ``(d, c)`` (CP chunk ``c`` of DP replica ``d``) sits at
    index ``d * cp + c``. Tensor- and pipeline-parallel ranks read what their DP/CP peers read, so
    they are not part of the mesh stored with the data.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(ge=1, le=1 << 20)
    cp: int = Field(default=1, ge=1, le=1 << 20)

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

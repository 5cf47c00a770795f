"""Which bytes a training rank reads: rank coordinates and the step/slice projection.

Pure arithmetic, no I/O. Two questions are answered here:

1. **Coordinates.** Which ``(dp_rank, cp_rank)`` does global rank ``RANK`` of ``WORLD_SIZE`` hold?
   Ranks are laid out by an ``order`` string naming the four parallel dimensions fastest-varying
   first, Megatron-LM style: the default ``"tp-cp-dp-pp"`` means consecutive ranks differ in
   tensor-parallel rank first, then context-parallel, then data-parallel, then pipeline stage.
   Tensor- and pipeline-parallel peers get the same ``(dp_rank, cp_rank)`` and so read the same
   slice.

2. **Projection.** The namespace stores TGBs of a *stored* mesh ``(DP, CP)``; the training job
   may run a different *consumer* mesh ``(DP', CP')`` (a job resized between checkpoints). No data
   is rewritten: along the data-parallel axis, consumer logical step ``s`` and replica ``r`` read
   global replica slice ``g = s * DP' + r``, i.e. replica ``g % DP`` of TGB ``g // DP``. With DP
   doubled, one logical step spans two TGBs; with DP halved, a TGB spans two logical steps and
   each rank reads alternate replicas. Along the context-parallel axis, ``CP'`` must divide
   ``CP``: consumer CP rank ``c'`` reads the ``CP / CP'`` consecutive stored chunks
   ``c' * CP/CP' ...``, which lie next to each other in the TGB (slice index ``d * CP + c``).

A projection may be *anchored*: after resuming with a different ``DP'`` the logical step counter
continues where the checkpoint left it, and so does the data. Anchor ``(S0, G0)`` maps logical
step ``s`` to ``g = G0 + (s - S0) * DP' + r``; the unanchored projection is ``S0 = G0 = 0``, the
formula above.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from batchweave._checks import as_int
from batchweave._mesh import Mesh, check_mesh

__all__ = [
    "DEFAULT_RANK_ORDER",
    "Projection",
    "RankCoordinates",
    "SliceLocation",
    "coordinates_for_rank",
    "coordinates_from_env",
    "resume_anchor",
]

DEFAULT_RANK_ORDER = "tp-cp-dp-pp"
"""Fastest-varying dimension first, as Megatron-LM's default ``tp-cp-ep-dp-pp`` without ``ep``."""

_DIMENSIONS = frozenset({"tp", "cp", "dp", "pp"})


@dataclass(frozen=True)
class RankCoordinates:
    """Where one global rank sits in the ``tp x cp x dp x pp`` device grid."""

    rank: int
    world_size: int
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int


def _parse_order(order: str, name: str = "order") -> tuple[str, ...]:
    """The dimensions ``order`` names, fastest-varying first; ``name`` is the argument's, for
    errors (a :class:`~batchweave.Consumer`'s is ``rank_order``)."""
    if not isinstance(order, str):
        raise TypeError(
            f"{name} must be a str, got the {type(order).__name__} {order!r}; e.g. "
            f"{name}={DEFAULT_RANK_ORDER!r}"
        )
    dims = tuple(part.strip() for part in order.lower().split("-"))
    if sorted(dims) != sorted(_DIMENSIONS):
        raise ValueError(
            f"rank order {order!r} must name each of tp, cp, dp, pp exactly once, fastest-varying "
            f"first, e.g. {DEFAULT_RANK_ORDER!r}"
        )
    return dims


def coordinates_for_rank(
    rank: int,
    world_size: int,
    *,
    mesh: Mesh,
    tp: int = 1,
    pp: int = 1,
    order: str = DEFAULT_RANK_ORDER,
) -> RankCoordinates:
    """Return the coordinates of global ``rank`` in a ``tp x mesh.cp x mesh.dp x pp`` grid.

    ``order`` names the dimensions fastest-varying first (``"tp-cp-dp-pp"``: ranks ``0..tp-1``
    form one tensor-parallel group). ``world_size`` must equal ``tp * cp * dp * pp``.
    """
    # Plain ints: coordinates end up in state_dict()s, and a float or NumPy rank would make
    # float or NumPy coordinates.
    rank, world_size = as_int("rank", rank), as_int("world_size", world_size)
    # A tuple or dict mesh, or a non-str order, would fail below with a bare AttributeError.
    check_mesh(mesh)
    dims = _parse_order(order)
    tp, pp = as_int("tp", tp), as_int("pp", pp)
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp degrees must be >= 1, got tp={tp}, pp={pp}")
    sizes = {"tp": tp, "cp": mesh.cp, "dp": mesh.dp, "pp": pp}
    expected = tp * mesh.cp * mesh.dp * pp
    if world_size != expected:
        if world_size > 0 and world_size % mesh.slices == 0:
            hint = (
                f"the mesh fits if tp x pp = {world_size // mesh.slices}: pass the job's tp= and "
                "pp= degrees"
            )
        else:
            hint = (
                f"WORLD_SIZE must be a multiple of dp x cp = {mesh.slices}: check the mesh "
                "(Mesh(dp=..., cp=...) are the training job's degrees) and WORLD_SIZE"
            )
        raise ValueError(
            f"WORLD_SIZE={world_size} does not match tp={tp} x cp={mesh.cp} x dp={mesh.dp} x "
            f"pp={pp} = {expected}; {hint}, or pass explicit dp_rank/cp_rank"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    coords: dict[str, int] = {}
    rest = rank
    for dim in dims:
        rest, coords[dim] = divmod(rest, sizes[dim])
    return RankCoordinates(
        rank=rank,
        world_size=world_size,
        dp_rank=coords["dp"],
        cp_rank=coords["cp"],
        tp_rank=coords["tp"],
        pp_rank=coords["pp"],
    )


def _env_int(environ: Mapping[str, str], name: str) -> int:
    raw: object = environ.get(name)
    if raw is None:
        raise ValueError(
            f"environment variable {name} is not set; launch with torchrun (which sets RANK and "
            "WORLD_SIZE) or pass dp_rank and cp_rank explicitly"
        )
    if not isinstance(raw, str):
        # An int is taken as it is; int() of a float would truncate RANK=1.9 to rank 1.
        try:
            return as_int(name, raw)
        except TypeError:
            raise TypeError(
                f"environment variable {name}={raw!r} is not an integer but a "
                f"{type(raw).__name__}: environ maps names to strings, as os.environ does "
                f"(e.g. {{{name!r}: '1'}})"
            ) from None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def coordinates_from_env(
    mesh: Mesh,
    *,
    tp: int = 1,
    pp: int = 1,
    order: str = DEFAULT_RANK_ORDER,
    environ: Mapping[str, str] | None = None,
) -> RankCoordinates:
    """Derive this process's coordinates from ``RANK`` and ``WORLD_SIZE`` (as torchrun sets them).

    See :func:`coordinates_for_rank` for the layout; ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    if not isinstance(env, Mapping):
        raise TypeError(
            f"environ must be a mapping of environment variables (like os.environ), got the "
            f"{type(env).__name__} {env!r}"
        )
    check_mesh(mesh)  # before RANK and WORLD_SIZE: a mesh that is no Mesh is the mistake
    _parse_order(order)
    return coordinates_for_rank(
        _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE"), mesh=mesh, tp=tp, pp=pp, order=order
    )


class SliceLocation(NamedTuple):
    """What one rank reads for one logical step: consecutive slices of one TGB.

    A consumer builds one per step: a tuple costs a fraction of a frozen dataclass.
    """

    tgb_step: int
    """Step (index in the manifest's TGB list) of the TGB holding the slices."""
    replica: int
    """Stored DP replica ``d`` the slices belong to."""
    slices: tuple[int, ...]
    """Slice indices ``d * CP + c`` in the TGB, consecutive and ascending."""


@dataclass(frozen=True)
class Projection:
    """Maps consumer logical steps and ranks onto stored TGB slices (see the module docstring)."""

    stored: Mesh
    """The mesh the namespace's TGBs were written with."""
    consumer: Mesh
    """The mesh of the training job reading them."""
    anchor_step: int = 0
    """Logical step at which ``anchor_replica`` is read by consumer replica 0."""
    anchor_replica: int = 0
    """Global replica-slice index ``g`` (TGB ``g // DP``, replica ``g % DP``) at ``anchor_step``."""

    def __post_init__(self) -> None:
        if self.stored.cp % self.consumer.cp:
            raise ValueError(
                f"consumer mesh ({self.consumer}) cannot read a namespace stored with mesh "
                f"({self.stored}): the consumer's cp={self.consumer.cp} must divide the stored "
                f"cp={self.stored.cp}, because a stored context-parallel chunk cannot be split "
                "without knowing the payload; use cp that divides the stored cp or re-produce "
                "the data"
            )
        if self.anchor_step < 0 or self.anchor_replica < 0:
            raise ValueError(
                f"projection anchor must be non-negative, got step {self.anchor_step}, "
                f"replica slice {self.anchor_replica}"
            )

    @property
    def chunks_per_rank(self) -> int:
        """Stored CP chunks each consumer CP rank reads per step: ``CP / CP'``."""
        return self.stored.cp // self.consumer.cp

    def global_replica(self, step: int, dp_rank: int) -> int:
        """Global replica-slice index ``g`` read by consumer replica ``dp_rank`` at ``step``."""
        if step < self.anchor_step:
            raise ValueError(
                f"logical step {step} precedes this projection's anchor step {self.anchor_step}"
            )
        if not 0 <= dp_rank < self.consumer.dp:
            raise ValueError(f"dp_rank {dp_rank} is outside the consumer mesh ({self.consumer})")
        return self.anchor_replica + (step - self.anchor_step) * self.consumer.dp + dp_rank

    def locate(self, step: int, dp_rank: int, cp_rank: int) -> SliceLocation:
        """The TGB and slice indices consumer rank ``(dp_rank, cp_rank)`` reads at ``step``."""
        if not 0 <= cp_rank < self.consumer.cp:
            raise ValueError(f"cp_rank {cp_rank} is outside the consumer mesh ({self.consumer})")
        tgb_step, replica = divmod(self.global_replica(step, dp_rank), self.stored.dp)
        k = self.chunks_per_rank
        first = replica * self.stored.cp + cp_rank * k
        slices = (first,) if k == 1 else tuple(range(first, first + k))
        return SliceLocation(tgb_step, replica, slices)

    def first_tgb_step(self, step: int) -> int:
        """The first TGB step that logical ``step`` reads (consumer replica 0's)."""
        return self.global_replica(step, 0) // self.stored.dp

    def tgb_span(self, step: int) -> tuple[int, int]:
        """TGB steps ``[first, end)`` that logical ``step`` reads across all consumer ranks."""
        last = self.global_replica(step, self.consumer.dp - 1) // self.stored.dp
        return self.first_tgb_step(step), last + 1

    def end_step(self, committed_tgbs: int) -> int:
        """First logical step not complete when TGB steps ``[0, committed_tgbs)`` are committed.

        A logical step is complete when every consumer replica's slice is committed; ranks only
        deliver complete steps, so at a sealed namespace every rank stops at the same step (a
        trailing partial step, fewer than ``DP'`` replica slices, is never delivered: see
        :meth:`undelivered`).
        """
        available = committed_tgbs * self.stored.dp - self.anchor_replica
        return self.anchor_step + max(0, available // self.consumer.dp)

    def undelivered(self, committed_tgbs: int) -> range:
        """Global replica slices committed in TGB steps ``[0, committed_tgbs)`` but past
        :meth:`end_step`: the trailing partial step, too few for the consumer's ``DP'``.

        Empty unless ``DP'`` does not evenly fit what is committed. At a sealed namespace no
        consumer of this mesh delivers them; one resumed from the final state with a smaller
        ``DP'`` (re-anchored there) does.
        """
        end = self.end_step(committed_tgbs)
        first = self.anchor_replica + (end - self.anchor_step) * self.consumer.dp
        return range(first, max(first, committed_tgbs * self.stored.dp))

    def first_step_from(self, tgb_step: int) -> int:
        """The first logical step (from the anchor on) that reads no TGB step below ``tgb_step``.

        After TGB steps below a manifest's ``base_step`` were reclaimed, this is the first
        logical step this projection can still deliver.
        """
        missing = tgb_step * self.stored.dp - self.anchor_replica
        return self.anchor_step + max(0, -(-missing // self.consumer.dp))

    def rebase(self, step: int, consumer: Mesh) -> Projection:
        """A projection for ``consumer`` continuing exactly where this one is at ``step``.

        Logical step ``step`` of the result reads the replica slices this projection would have
        read next, so resizing DP between checkpoints neither skips nor repeats data.
        """
        if consumer == self.consumer:
            return self
        anchor_step, anchor_replica = resume_anchor(
            step,
            dp=self.consumer.dp,
            anchor_step=self.anchor_step,
            anchor_replica=self.anchor_replica,
            new_dp=consumer.dp,
        )
        return Projection(
            stored=self.stored,
            consumer=consumer,
            anchor_step=anchor_step,
            anchor_replica=anchor_replica,
        )


def resume_anchor(
    step: int, *, dp: int, anchor_step: int, anchor_replica: int, new_dp: int
) -> tuple[int, int]:
    """The anchor ``(S0, G0)`` with which consumers of ``new_dp`` replicas continue at ``step``.

    ``dp``, ``anchor_step`` and ``anchor_replica`` describe the projection that read the steps
    before ``step`` (a saved consumer state). With the same DP the anchor is kept; with another
    one the result is anchored at ``step`` itself, on the first replica slice not read yet.

    Every rank of the job must re-anchor at the same ``step``: the logical step the *job* resumes
    at. A reader that delivers only every ``stride``-th step must not re-anchor at its own first
    step (``step + worker``), or workers anchor ``worker * (new_dp - dp)`` replica slices apart;
    re-anchor once at the job's step and shift the re-anchored state instead.
    """
    if step < anchor_step:
        raise ValueError(f"logical step {step} precedes the anchor step {anchor_step}")
    if new_dp == dp:
        return anchor_step, anchor_replica
    return step, anchor_replica + (step - anchor_step) * dp

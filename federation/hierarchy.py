"""Hierarchical allreduce: rings per site, a ring of site leaders, a broadcast back.

The schedule is pure (:class:`Topology`, :func:`plan`): a round's participants are grouped by
site (each site reduces over its own broker); the **leader** of a site is its lowest-ranked
participant in ``sorted()`` order. Election needs no message: every member derives the same
leader from the round's participant list, and the fleet only names live nodes, so a leader that
died is replaced in the next round by the next member of its site in that order.

One hierarchical allreduce of tag ``T`` (:class:`HierarchicalAllreduce`), per member:

1. ``T.g``: SUM-allreduce over the site's members (today's ring or direct path, site broker).
2. ``T.x``: the site leaders SUM-allreduce their site sums over the backbone (a second ring,
   whose topics the site brokers bridge to the backbone broker); a ``mean`` divides by the
   round's participant count once, on each leader, after this level. Every leader holds the
   same bytes (the ring's promise), so the division gives the same bytes on every leader.
3. ``T.b``: each leader broadcasts that result over its site's ring (forwarded bytes).

So every member of every site returns the same bytes. Summation order: a member's value enters
its site's partial sum in that site's ring order, the site sums enter in the leaders' ring order;
the result is bit-identical everywhere and within float32 rounding of ``numpy.sum`` (exactly
equal when the sums are exact, e.g. integer-valued float32), as the flat ring promises.

Failures: any level failing on a member raises :class:`RoundAborted` there and nobody returns a
partial result. A leader that fails level 2 sends ABORT for ``T.b`` to its site at once, so its
members stop now instead of at their deadline; a dead leader's site members time out in ``T.b``
(or fail in ``T.g``) and the other leaders time out in ``T.x``. The round's two-phase commit
(PROTOCOL.md section 7) runs its vote through :meth:`HierarchicalAllreduce.vote`: one slot per
*site* holding that site's count of prepared members, commit iff every site's count equals its
size. A vote is ``len(sites)`` floats, not ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from federation import bounds as b
from federation import robust
from federation.checks import clip_l2
from federation.errors import RoundAborted, TransportError, UpdateRejected
from federation.ring import ReduceOp, RingAllreduce

__all__ = ["Topology", "Role", "plan", "round_sites", "HierarchicalAllreduce", "HierarchicalCollective",
           "LEVEL_SITE", "LEVEL_BACKBONE", "LEVEL_BROADCAST"]

# Tag suffixes of the three collectives of one hierarchical call (tags are ids: [A-Za-z0-9_.-]).
LEVEL_SITE, LEVEL_BACKBONE, LEVEL_BROADCAST = ".g", ".x", ".b"
LEVEL_CLAIMS = ".c"  # a screened call's claims gather (itself a hierarchical SUM: T.c.g, T.c.x, T.c.b)


def _claimed_norm(row: np.ndarray) -> np.float32:
    """A member's whole-update norm from its chunk norms, rounded up to float32 (never undercuts);
    ``robust.NON_FINITE`` for a non-finite claim."""
    v = robust.norm_of_claim(row)
    if not math.isfinite(v):
        return np.float32(robust.NON_FINITE)
    f = np.float32(v)
    f = f if float(f) >= v else np.nextafter(f, np.float32(np.inf))
    return f if np.isfinite(f) else np.float32(robust.NON_FINITE)


@dataclass(frozen=True)
class Topology:
    """The round's participants grouped by site: ``sites[name]`` is its members, sorted."""

    sites: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def of(cls, site_of: Mapping[str, str]) -> Topology:
        """From ``member -> site`` (every participant of the round, each in one site)."""
        groups: dict[str, list[str]] = {}
        for member, site in site_of.items():
            groups.setdefault(site, []).append(member)
        return cls(tuple((s, tuple(sorted(groups[s]))) for s in sorted(groups)))

    @classmethod
    def from_groups(cls, groups: Mapping[str, Iterable[str]]) -> Topology:
        """From ``site -> members``; a member named in two sites is a ValueError."""
        site_of: dict[str, str] = {}
        for site, members in groups.items():
            for m in members:
                if m in site_of:
                    raise ValueError(f"member {m!r} is in sites {site_of[m]!r} and {site!r}")
                site_of[m] = site
        empty = [s for s, ms in groups.items() if not list(ms)]
        if empty:
            raise ValueError(f"site {empty[0]!r} has no members")
        return cls.of(site_of)

    @property
    def members(self) -> list[str]:
        return sorted(m for _, ms in self.sites for m in ms)

    @property
    def size(self) -> int:
        return sum(len(ms) for _, ms in self.sites)

    def group(self, site: str) -> tuple[str, ...]:
        for s, ms in self.sites:
            if s == site:
                return ms
        raise ValueError(f"no site {site!r} in this round")

    def site_of(self, member: str) -> str:
        for s, ms in self.sites:
            if member in ms:
                return s
        raise ValueError(f"{member!r} is not a participant of this round")

    def leaders(self) -> list[str]:
        """One leader per site (its lowest-ranked member), in site order."""
        return [ms[0] for _, ms in self.sites]

    def without(self, dead: Iterable[str]) -> Topology:
        """The topology of the next round once ``dead`` are left out (new leaders where needed)."""
        gone = set(dead)
        return Topology(tuple((s, tuple(m for m in ms if m not in gone)) for s, ms in self.sites
                              if any(m not in gone for m in ms)))


def round_sites(participants: Iterable[str], site_of: Mapping[str, str | None], *,
                per_site: int = b.SITE_PARTICIPANTS_MAX) -> dict[str, list[str]] | None:
    """The sites a RoundCommand names for ``participants`` (None: one flat ring).

    Members are grouped by the site their status declares (none: ``default``); a round whose
    members all share one site and fit one ring stays flat. A site larger than ``per_site`` is cut
    into near-equal consecutive groups (in sorted order) named ``{site}.{k}``, each its own ring
    with its own leader, on the same broker.
    """
    groups: dict[str, list[str]] = {}
    for m in sorted(set(participants)):
        groups.setdefault(site_of.get(m) or "default", []).append(m)
    if len(groups) == 1 and sum(len(ms) for ms in groups.values()) <= per_site:
        return None
    out: dict[str, list[str]] = {}
    for site in sorted(groups):
        ms = groups[site]
        if len(ms) <= per_site:
            out[site] = ms
            continue
        k = -(-len(ms) // per_site)
        size, extra = divmod(len(ms), k)
        start = 0
        for i in range(k):
            stop = start + size + (1 if i < extra else 0)
            out[f"{site[:58]}.{i}"] = ms[start:stop]
            start = stop
    if len(out) > b.SITES_MAX:
        raise ValueError(f"{len(out)} sites: a round takes at most {b.SITES_MAX}")
    return out


@dataclass(frozen=True)
class Role:
    """What one member does in a hierarchical call."""

    member: str
    site: str
    group: tuple[str, ...]  # its site's members (level 1 and 3)
    leader: str  # its site's leader (root of level 3)
    leaders: tuple[str, ...]  # the level-2 ring (empty role in it unless ``is_leader``)

    @property
    def is_leader(self) -> bool:
        return self.member == self.leader


def plan(topology: Topology, member: str) -> Role:
    """``member``'s role: the same answer on every member for the same topology."""
    site = topology.site_of(member)
    group = topology.group(site)
    return Role(member, site, group, group[0], tuple(topology.leaders()))


class HierarchicalAllreduce:
    """One member's hierarchical allreduce (see the module docstring).

    ``site`` is a :class:`RingAllreduce` on the site broker's transport; ``backbone`` one on the
    bridged inter-site transport (only leaders use it; None on a member that can never lead is
    allowed, and a call that makes it a leader then fails). Both must have the same member id.
    """

    def __init__(self, site: RingAllreduce, backbone: RingAllreduce | None) -> None:
        if backbone is not None and backbone.member_id != site.member_id:
            raise ValueError("site and backbone engines must belong to the same member")
        self.site = site
        self.backbone = backbone
        self.member_id = site.member_id

    def allreduce(self, vec: np.ndarray, *, topology: Topology, tag: str, op: ReduceOp | str = "mean",
                  timeout: float = 30.0, site_screen: Any = None, backbone_screen: Any = None) -> np.ndarray:
        """Sum or mean over every participant of ``topology``; bit-identical on every member.

        ``site_screen`` / ``backbone_screen``: the ``screen=(claim, decide)`` of the level-1 and
        level-2 rings (:meth:`RingAllreduce.allreduce`); ``backbone_screen`` is a function of the
        leader's site sum returning that pair (the claim is the norms of the sum)."""
        op = ReduceOp(op)
        role = plan(topology, self.member_id)
        group = list(role.group)
        try:
            partial = self.site.allreduce(vec, group=group, tag=tag + LEVEL_SITE, op=ReduceOp.SUM,
                                          timeout=timeout, screen=site_screen)
        except (RoundAborted, TransportError) as exc:
            if role.is_leader and self.backbone is not None and len(role.leaders) > 1:
                # Tell the other leaders now: they wait for our site's sum.
                self.backbone.abort(tag + LEVEL_BACKBONE, list(role.leaders), f"site {role.site}: {exc}")
            raise
        total: np.ndarray | None = None
        if role.is_leader:
            try:
                total = self._backbone(partial, role, topology, tag, op, timeout, backbone_screen)
            except (RoundAborted, TransportError) as exc:
                # Tell our site now: its members wait for our broadcast.
                self.site.abort(tag + LEVEL_BROADCAST, group, f"site leader {self.member_id}: {exc}")
                raise
        return self.site.broadcast(total, root=role.leader, group=group, tag=tag + LEVEL_BROADCAST,
                                   timeout=timeout)

    def _backbone(self, partial: np.ndarray, role: Role, topology: Topology, tag: str, op: ReduceOp,
                  timeout: float, backbone_screen: Any = None) -> np.ndarray:
        if len(role.leaders) == 1:
            total = partial
        else:
            if self.backbone is None:
                raise RoundAborted(f"{self.member_id} leads site {role.site} but has no backbone link",
                                   member=self.member_id, hint="give every node of a site the backbone")
            # The ring, never the direct path: the leaders' sums are whole vectors, and the
            # vote's failure table (PROTOCOL.md section 7) is the ring's.
            total = self.backbone.allreduce(partial, group=list(role.leaders), tag=tag + LEVEL_BACKBONE,
                                            op=ReduceOp.SUM, timeout=timeout, algorithm="ring",
                                            screen=backbone_screen(partial) if backbone_screen else None)
        if op == ReduceOp.MEAN:
            total = np.divide(total, np.float32(topology.size), dtype=np.float32)
        return total

    def vote(self, prepared: bool, *, topology: Topology, tag: str, timeout: float = 30.0) -> list[str]:
        """The two-phase commit's vote across levels: the sites where not every member prepared
        (empty = commit). One float per site travels, whatever the sites' sizes."""
        sites = [s for s, _ in topology.sites]
        slots = np.zeros(len(sites), np.float32)
        if prepared:
            slots[sites.index(topology.site_of(self.member_id))] = 1.0
        counts = self.allreduce(slots, topology=topology, tag=tag, op=ReduceOp.SUM, timeout=timeout)
        return [s for (s, ms), c in zip(topology.sites, counts, strict=True) if c != len(ms)]

    def close(self) -> None:
        self.site.close()
        if self.backbone is not None:
            self.backbone.close()


class HierarchicalCollective:
    """A node's collective for one hierarchical round: the calls a round makes (edgenode's
    ``Collective`` port) mapped onto :class:`HierarchicalAllreduce` over ``topology``.

    * ``allreduce``: the hierarchy (``group`` must be the round's participants). Uncompressed,
      unscreened means only: outlier screening checks claims per ring and compressed codecs keep
      per-ring error feedback, neither of which spans levels yet (the fleet's hierarchical
      commands ask for neither); asking for them fails the call before anything is sent.
    * ``broadcast``: a SUM where every member but the root contributes ``-0.0``: ``x + (-0.0)``
      is ``x`` bit for bit for every float (``+0.0`` included), so every member gets the root's
      bytes, across sites.
    * ``exchange`` (robust aggregations' all-gather): refused, as above.
    """

    def __init__(self, site: RingAllreduce, backbone: RingAllreduce | None, topology: Topology) -> None:
        self.engine = HierarchicalAllreduce(site, backbone)
        self.topology = topology
        self.member_id = site.member_id

    def _check_group(self, group: list[str]) -> None:
        if sorted(group) != self.topology.members:
            raise ValueError("a hierarchical collective spans the round's participants: "
                             f"got {len(group)} of {self.topology.size}")

    def allreduce(self, vec: np.ndarray, *, group: list[str], tag: str, op: Any = "mean",
                  timeout: float = 30.0, compression: Any = "none", clip_norm: float | None = None,
                  claims: np.ndarray | None = None, screen: Any = None,
                  algorithm: str = "auto") -> np.ndarray:
        self._check_group(group)
        if claims is not None or str(compression) != "none":
            raise RoundAborted(f"round {tag!r}: a hierarchical round takes uncompressed means",
                               member=self.member_id,
                               hint="run it with compression none and aggregation mean")
        x = np.asarray(vec, np.float32)
        if clip_norm is not None:
            x, _ = clip_l2(x, clip_norm)
        if screen is not None:
            return self._screened(x, screen, tag, ReduceOp(op), timeout)
        return self.engine.allreduce(x, topology=self.topology, tag=tag, op=op, timeout=timeout)

    def _screened(self, x: np.ndarray, screen: Any, tag: str, op: ReduceOp, timeout: float) -> np.ndarray:
        """Outlier screening across levels (PROTOCOL.md section 10, "Screening across levels").

        1. Claims: every member's whole-update norm (from the norms of its site ring's chunks,
           rounded up to float32) is gathered to everyone through the hierarchy (``T.c``: a SUM of
           one slot per participant). Every member then screens the same n norms with the
           caller's ``decide`` (round-wide median), so every member keeps the same set.
        2. Level 1 (``T.g``): the site ring exchanges the chunk norms one hop, as a flat ring does;
           each site checks that its members' rows give the very norms the gather carried (a
           member or leader that altered a slot of the gather makes that site abort the round),
           then checks every partial sum against the kept members' claims.
        3. Level 2 (``T.x``): a leader claims the norms of its site's sum; a claim above the sum of
           its site's kept norms (the triangle inequality) is rejected naming the leader, and the
           backbone ring checks the leaders' partial sums against their claims.
        4. Level 3 (``T.b``): a member rejects a broadcast result whose norm exceeds the kept
           members' norms added up (divided by n for a mean), naming its leader.
        """
        row, decide = screen
        topo, me = self.topology, self.member_id
        members = topo.members
        n = len(members)
        role = plan(topo, me)
        site = list(role.group)
        contributes = bool(np.any(np.asarray(row) != 0))
        site_row = robust.chunk_norms(x, len(site)) if contributes else np.zeros(len(site), np.float32)
        slots = np.full(n, -0.0, np.float32)
        slots[members.index(me)] = _claimed_norm(site_row)
        norms = self.engine.allreduce(slots, topology=topo, tag=tag + LEVEL_CLAIMS, op=ReduceOp.SUM,
                                      timeout=timeout)
        claims = np.zeros((n, n), np.float32)
        claims[:, 0] = norms
        bounds, send = decide(claims, None)
        kept = {members[j] for j in range(n) if np.asarray(bounds[j]).any()}
        mass = {s: sum(float(norms[members.index(m)]) for m in ms if m in kept) for s, ms in topo.sites}
        tol = max(robust.claims_tolerance(n, False), 1.0 + 4.0 * n * 2.0 ** -24)

        def site_decide(rows: np.ndarray, _vectors: Any) -> tuple[np.ndarray, bool]:
            for i, m in enumerate(site):
                want, got = norms[members.index(m)], _claimed_norm(np.asarray(rows[i], np.float32))
                if want.tobytes() != got.tobytes():
                    raise UpdateRejected(f"round {tag!r}: {m}'s claimed norm reached the round as "
                                         f"{float(want):.6g} but its site as {float(got):.6g}: a member or "
                                         f"a site leader altered the gathered claims", member=None)
            out = np.asarray(rows, np.float64).copy()
            for i, m in enumerate(site):
                if m not in kept:
                    out[i] = 0.0  # excluded members and members without samples send zeros
            return out, bool(send)

        def backbone_screen(partial: np.ndarray) -> tuple[np.ndarray, Any]:
            leaders = sorted(topo.leaders())

            def decide_leaders(rows: np.ndarray, _vectors: Any) -> tuple[np.ndarray, bool]:
                for i, leader in enumerate(leaders):
                    got, bound = robust.norm_of_claim(np.asarray(rows[i])), mass[topo.site_of(leader)] * tol
                    if not got <= bound:
                        raise UpdateRejected(f"round {tag!r}: site leader {leader} claims a site sum of "
                                             f"norm {got:.6g}, more than its site's kept updates add up to "
                                             f"({bound:.6g})", member=leader)
                return np.asarray(rows, np.float64), True

            return robust.chunk_norms(partial, len(leaders)), decide_leaders

        result = self.engine.allreduce(x, topology=topo, tag=tag, op=op, timeout=timeout,
                                       site_screen=(site_row, site_decide), backbone_screen=backbone_screen)
        limit = sum(mass.values()) * tol / (n if op == ReduceOp.MEAN else 1)
        got = float(np.linalg.norm(np.asarray(result, np.float64))) if np.isfinite(result).all() else math.inf
        if not got <= limit:
            raise UpdateRejected(f"round {tag!r}: the result broadcast by site leader {role.leader} has "
                                 f"norm {got:.6g}, more than the kept updates allow ({limit:.6g})",
                                 member=role.leader)
        return result

    def broadcast(self, vec: np.ndarray | None, *, root: str, group: list[str], tag: str,
                  timeout: float = 30.0) -> np.ndarray:
        self._check_group(group)
        length = np.zeros(1, np.float32)
        if self.member_id == root:
            if vec is None:
                raise ValueError("the root of a broadcast needs a vector")
            length[0] = np.asarray(vec).size
        # The length first (an exact sum), then the root's bytes plus everyone else's -0.0.
        size = int(self.engine.allreduce(length, topology=self.topology, tag=tag + ".n",
                                         op="sum", timeout=timeout)[0])
        x = (np.asarray(vec, np.float32) if self.member_id == root
             else np.full(size, -0.0, np.float32))
        return self.engine.allreduce(x, topology=self.topology, tag=tag, op="sum",
                                     timeout=timeout)

    def exchange(self, vec: np.ndarray, *, group: list[str], tag: str, timeout: float = 30.0,
                 compression: Any = "none") -> np.ndarray:
        raise RoundAborted(f"round {tag!r}: a hierarchical round has no all-gather (robust aggregations)",
                           member=self.member_id, hint="run it with aggregation mean")

    def reset_feedback(self) -> None:
        self.engine.site.reset_feedback()

    def abort(self, tag: str, peers: list[str], reason: str) -> None:
        role = plan(self.topology, self.member_id)
        for t in (tag, tag + LEVEL_CLAIMS):  # a screened call gathers its claims first
            self.engine.site.abort(t + LEVEL_SITE, list(role.group), reason)
            if role.is_leader and self.engine.backbone is not None:
                self.engine.backbone.abort(t + LEVEL_BACKBONE, list(role.leaders), reason)

    def cancel(self, reason: str) -> bool:
        hit = self.engine.site.cancel(reason)
        if self.engine.backbone is not None:
            hit = self.engine.backbone.cancel(reason) or hit
        return hit

    def close(self) -> None:
        """The engines belong to the node (they outlive the round)."""

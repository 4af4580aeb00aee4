"""Router policy: speculative path or plain path, decided per request with a typed reason.

Owns: the decision rules of DESIGN.md (mode overrides, MoE gate, live α per
segment against break-even, in-flight hysteresis on the SpecEngine) and the hysteresis state.
α is per position everywhere here — the live α, ``min_alpha`` and the SpecEngine's break-even α
(``cluster.speculative.acceptance``) — so the gate compares like with like.
Ignores: where in-flight counts and α come from (the Router deployment feeds them) and how a
request travels (Ray handles, gRPC).

Rule order (first match wins):
1. mode PLAIN -> plain (MODE_PLAIN); a scoring request (``max_tokens`` 0: the prompt's
   log-probabilities, nothing generated, so nothing to draft) in mode AUTO -> plain (SCORING): a
   prefill-only request would only slow the SpecEngine's interactive requests.
2. constrained (json_schema / regex) -> plain (CONSTRAINED) only when ``grammar_speculation`` is
   off. By default constrained requests route like any other: the SpecEngine speculates under the
   grammar (drafts cut where the grammar rejects them, verification under the grammar's masks:
   lossless, ``cluster.engine.speculation``), and its α counts in the segment's α.
3. speculative path not available (no drafter, SpecEngine not ready) -> plain (SPEC_UNAVAILABLE).
4. MoE target whose gate is closed for the request's segment -> plain (MOE_UNVALIDATED) — except
   every ``moe_probe_every``-th such request, which goes through the hysteresis rule as a probe
   (PROBE_MOE_UNVALIDATED when it speculates; the Router forwards it with mode SPECULATIVE, the
   one mark the SpecEngine lets draft in a closed segment). The SpecEngine measures the probes'
   acceptance per segment and opens the segment's gate once a window of enough draft tokens
   reaches its threshold (``cluster.speculative.moe``); from then on the segment follows rules 5-9.
5. mode SPECULATIVE -> speculative (MODE_SPECULATIVE); the client asked and nothing forbids it.
6. live α of the request's segment below ``min_alpha`` — by default ("auto") the SpecEngine's
   break-even α from its measured step costs, ``FALLBACK_MIN_ALPHA`` while it reports none —
   (with at least ``min_alpha_samples`` draft tokens measured) -> plain (BELOW_BREAK_EVEN) —
   except every ``probe_every``-th such request, which goes through the hysteresis rule as a
   probe (PROBE_BELOW_BREAK_EVEN when it speculates), so that the segment's α keeps being
   measured and a segment that improves comes back. A segment exactly at ``min_alpha`` is not
   below it: it goes on to rule 7. A request with a prediction skips this rule: the segment's α
   is its drafter's, and the request drafts from its own prediction (it goes on to rule 7, so load
   still sends it plain). Live α is the SpecEngine's recent (decayed) per-position
   estimate (``live_alpha`` in its stats), not a lifetime average. A request is judged by its
   acceptance class's α in the segment (``live_alpha_by_class``: greedy, sampled, logits shaped by
   penalties or ``logit_bias``; ``cluster.common.acceptance_class.acceptance_class``) once that class
   has ``min_alpha_samples`` draft tokens measured there, else by the segment's; each class is
   gated and probed apart. Drafts are accepted about half as often at temperature 0.7 as greedy,
   so a segment's greedy requests can pay where its sampled ones do not.
7. hysteresis on SpecEngine in-flight: while routing to spec, stay until in-flight reaches
   ``exit_threshold`` (-> plain, ABOVE_EXIT_THRESHOLD); while routing plain, go back once in-flight
   is below ``enter_threshold`` (BELOW_ENTER_THRESHOLD), else stay plain (HYSTERESIS_PLAIN).
   A segment with settings of its own (``RouterConfig.segments``, written by ``specserve map``)
   uses its min_alpha (rule 6) and its thresholds with a hysteresis bit of its own; unset ones
   (and a segment not listed) the global ones, on the global bit.
8. overflow balance (``balance_overflow``): when rule 7 says plain but the SpecEngine would serve
   the request sooner, go speculative anyway (OVERFLOW_BALANCED); the hysteresis bit is not
   touched. A request is routed once, on arrival: without this a burst larger than the
   BatchEngine's batch queues there while the SpecEngine drains its few requests and idles.
   "Sooner" is measured once both paths have completed ``overflow_min_samples`` requests of the
   segment: each path's service time per generated token fitted against the number of requests
   running beside, with queueing beyond its capacity at its measured drain rate
   (``cluster.routing.load_latency``), predicted for both paths at their counts now plus this
   request. Until then it is the capacity rule: the SpecEngine is less full than the BatchEngine
   relative to their capacities (in-flight / max_num_seqs x replicas), which never fires below the
   BatchEngine's capacity.
9. measured plain (``plain_when_faster``): when rule 7 says speculative but, by the same measured
   latency (both paths with ``overflow_min_samples`` completions of the segment), the BatchEngine
   would serve the request more than ``plain_faster_margin`` faster per token, go plain
   (MEASURED_PLAIN_FASTER); the hysteresis bit is not touched. The thresholds are calibrated for
   the typical segment; one with a middling α can be slower speculated well below the exit
   threshold (chat at 8 concurrent on 2 CPU cores). The margin keeps near-ties on the
   hysteresis's choice, and every ``probe_every``-th such request still speculates so that the
   SpecEngine's fit for the segment stays current (it would otherwise go stale and keep the
   segment plain after the load that made plain faster is gone).
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

from cluster.common.acceptance_class import class_name, classed_context
from cluster.common.request import SpecMode
from cluster.common.segments import DEFAULT_SEGMENT
from cluster.routing.load_latency import Joining, LoadLatencyModel


class Path(enum.Enum):
    SPECULATIVE = "speculative"
    PLAIN = "plain"


class RouteReason(enum.Enum):
    MODE_PLAIN = "mode_plain"
    SCORING = "scoring"  # max_tokens 0: nothing is generated, so nothing to speculate
    MODE_SPECULATIVE = "mode_speculative"
    CONSTRAINED = "constrained"
    SPEC_UNAVAILABLE = "spec_unavailable"
    MOE_UNVALIDATED = "moe_unvalidated"
    PROBE_MOE_UNVALIDATED = "probe_moe_unvalidated"  # a closed MoE segment's periodic measurement
    BELOW_BREAK_EVEN = "below_break_even"
    PROBE_BELOW_BREAK_EVEN = "probe_below_break_even"  # a gated segment's periodic measurement
    BELOW_ENTER_THRESHOLD = "below_enter_threshold"
    ABOVE_EXIT_THRESHOLD = "above_exit_threshold"
    HYSTERESIS_SPECULATIVE = "hysteresis_speculative"  # between thresholds, staying speculative
    HYSTERESIS_PLAIN = "hysteresis_plain"  # between thresholds, staying plain
    OVERFLOW_BALANCED = "overflow_balanced"  # plain by hysteresis, but the BatchEngine is fuller
    MEASURED_PLAIN_FASTER = "measured_plain_faster"  # speculative by hysteresis, but measured slower


@dataclass(slots=True, frozen=True)
class RouteDecision:
    path: Path
    reason: RouteReason


FALLBACK_MIN_ALPHA = 0.5  # the seed's break-even rule of thumb, used until the engine measures one


@dataclass(slots=True, frozen=True)
class SegmentRouting:
    """One segment's own router settings (``specserve map`` writes them from the segment's
    crossover); None falls back to the global setting. A segment with its own thresholds has its
    own hysteresis bit, compared with the same SpecEngine in-flight count. (A segment's drafter
    and K policy are the SpecEngine's: ``cluster.common.config.SegmentSpeculation``.)"""

    enter_threshold: int | None = None
    exit_threshold: int | None = None
    min_alpha: float | str | None = None


def _check_router_knobs(enter: int, exit_: int, min_alpha, where: str) -> None:
    if enter < 1:
        raise ValueError(f"{where}enter_threshold must be >= 1, got {enter}")
    if exit_ < enter:
        raise ValueError(f"{where}exit_threshold ({exit_}) must be >= enter_threshold ({enter})")
    if min_alpha != "auto" and (isinstance(min_alpha, (str, bool)) or not 0.0 <= float(min_alpha) <= 1.0):
        raise ValueError(f"{where}min_alpha must be \"auto\" or a number in [0, 1], got {min_alpha!r}")


@dataclass(slots=True)
class RouterConfig:
    """enter_threshold: route to spec again once its in-flight count is below this.
    exit_threshold: leave spec once its in-flight count reaches this (> enter_threshold: the gap is
    the hysteresis band). min_alpha: a segment whose live α (per position) is below this goes plain;
    "auto" takes the break-even α the SpecEngine derives from its measured draft and verification
    costs (with a cheap verification it is far below the seed's rule of thumb of 0.5, which is
    the fallback while the engine reports none). min_alpha_samples: draft tokens a
    segment needs before its α is trusted. probe_every: one in this many requests of a segment
    below break-even still speculates, to keep measuring it (0: never). moe_probe_every: the same
    for a segment whose MoE gate is closed: its probes are what opens it (0: never opens live).
    balance_overflow: send a
    request that hysteresis sends plain to the SpecEngine when it would be served sooner there —
    by measured latency under load once each path has ``overflow_min_samples`` completed requests
    of the segment, by fullness relative to capacity before (needs both capacities in the
    EngineView). plain_when_faster: send a request that hysteresis sends speculative to the
    BatchEngine when measured latency says it would be served more than ``plain_faster_margin``
    (a fraction) faster per token there. grammar_speculation: constrained requests may speculate
    (the engine verifies drafts under the grammar); off sends them all plain (rule 2).
    paths_share_hardware: "auto" (the Router decides from where the engines run), True or False:
    whether the latency model counts the other path's running requests in a path's service time
    (``cluster.routing.load_latency``, "Shared hardware")."""

    enter_threshold: int = 4
    exit_threshold: int = 8
    min_alpha: float | str = "auto"
    min_alpha_samples: int = 64
    probe_every: int = 16
    balance_overflow: bool = True
    overflow_min_samples: int = 8
    plain_when_faster: bool = True
    plain_faster_margin: float = 0.05
    moe_probe_every: int = 8
    segments: dict[str, SegmentRouting] = field(default_factory=dict)  # per-segment overrides
    grammar_speculation: bool = True
    paths_share_hardware: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.paths_share_hardware not in (True, False, "auto"):
            raise ValueError(f"router.paths_share_hardware must be true, false or \"auto\", "
                             f"got {self.paths_share_hardware!r}")
        _check_router_knobs(self.enter_threshold, self.exit_threshold, self.min_alpha, "router.")
        self.segments = {name: s if isinstance(s, SegmentRouting) else SegmentRouting(**s)
                         for name, s in self.segments.items()}
        for name in self.segments:
            _check_router_knobs(*self.knobs(name), f"router.segments.{name}.")
        if self.probe_every < 0:
            raise ValueError("router.probe_every must be >= 0")
        if self.moe_probe_every < 0:
            raise ValueError("moe.probe_every must be >= 0")
        if self.min_alpha_samples < 0:
            raise ValueError("router.min_alpha_samples must be >= 0")
        if self.overflow_min_samples < 1:
            raise ValueError("router.overflow_min_samples must be >= 1")
        if not 0.0 <= self.plain_faster_margin < 1.0:
            raise ValueError(f"router.plain_faster_margin must be in [0, 1), got {self.plain_faster_margin}")


    def knobs(self, segment: str) -> tuple[int, int, float | str]:
        """(enter_threshold, exit_threshold, min_alpha) in force for ``segment``."""
        own = self.segments.get(segment)
        if own is None:
            return self.enter_threshold, self.exit_threshold, self.min_alpha
        pick = lambda mine, default: default if mine is None else mine  # noqa: E731
        return (pick(own.enter_threshold, self.enter_threshold), pick(own.exit_threshold, self.exit_threshold),
                pick(own.min_alpha, self.min_alpha))


@dataclass(slots=True, frozen=True)
class RequestFeatures:
    mode: SpecMode = SpecMode.AUTO
    constrained: bool = False
    segment: str = DEFAULT_SEGMENT
    predicted: bool = False  # it sent a prediction (drafted from whatever the segment's α)
    scoring: bool = False  # max_tokens 0: the prompt scored, nothing generated
    acceptance_class: str = ""  # ``cluster.common.acceptance_class.acceptance_class`` of its params


@dataclass(slots=True, frozen=True)
class EngineView:
    """What the router knows about the speculative side right now."""

    spec_available: bool = True
    spec_in_flight: int = 0
    moe: bool = False
    moe_gate_open: bool = True  # for every segment (dense target, or validated as a whole)
    moe_open_segments: frozenset[str] = frozenset()  # MoE segments the SpecEngine opened live
    # segment -> (live α per position, draft tokens measured)
    alpha_by_segment: tuple[tuple[str, float, int], ...] = ()
    # (segment, acceptance class name, live α per position, draft tokens measured): each class's own
    alpha_by_class: tuple[tuple[str, str, float, int], ...] = ()
    break_even_alpha: float | None = None  # per position, from the SpecEngine's measured step costs
    plain_in_flight: int = 0
    # sequences each side runs at once (max_num_seqs x replicas); None: unknown, no balancing
    spec_capacity: int | None = None
    plain_capacity: int | None = None
    paths_shared: bool = False  # the two paths' engines compete for the same cores / GPU

    def spec_less_full(self) -> bool:
        """SpecEngine in-flight / capacity below the BatchEngine's (cross-multiplied, exact)."""
        if not self.spec_capacity or not self.plain_capacity:
            return False
        return self.spec_in_flight * self.plain_capacity < self.plain_in_flight * self.spec_capacity

    def joining(self, path: Path) -> Joining:
        """(path, its in-flight count once a new request joins it, its capacity, the other path's
        in-flight count where they share hardware, else 0): what the latency model predicts from."""
        if path is Path.SPECULATIVE:
            return path, self.spec_in_flight + 1, self.spec_capacity, self.plain_in_flight if self.paths_shared else 0
        return path, self.plain_in_flight + 1, self.plain_capacity, self.spec_in_flight if self.paths_shared else 0

    def moe_open(self, segment: str) -> bool:
        return not self.moe or self.moe_gate_open or segment in self.moe_open_segments

    def alpha(self, segment: str, acceptance_class: str | None = None,
              min_samples: int = 0) -> tuple[float, int] | None:
        """(α, draft tokens) of ``segment``: its ``acceptance_class``'s where that has at least
        ``min_samples`` draft tokens measured, else the segment's over every class."""
        if acceptance_class is not None:
            name = class_name(acceptance_class)
            for seg, cls, alpha, n in self.alpha_by_class:
                if seg == segment and cls == name and n >= min_samples:
                    return alpha, n
        for name, alpha, n in self.alpha_by_segment:
            if name == segment:
                return alpha, n
        return None

    @classmethod
    def from_spec_by_segment(cls, spec_by_segment: dict[str, dict], **kw) -> "EngineView":
        # the engine's live (decayed) α, else its lifetime one: both per position, never the
        # accepted / drafted acceptance_rate (a different unit from the break-even α)
        rows = tuple((seg, float(d.get("live_alpha", d.get("alpha", 0.0))),
                      int(d.get("live_draft_tokens", d.get("draft_tokens", 0))))
                     for seg, d in sorted(spec_by_segment.items()))
        by_class = tuple((seg, name, float(c["live_alpha"]), int(c["live_draft_tokens"]))
                         for seg, d in sorted(spec_by_segment.items())
                         for name, c in sorted((d.get("live_alpha_by_class") or {}).items()))
        opened = frozenset(seg for seg, d in spec_by_segment.items() if d.get("moe_gate_open"))
        return cls(alpha_by_segment=rows, alpha_by_class=by_class, moe_open_segments=opened, **kw)


class RouterPolicy:
    """State: the hysteresis bit (are we currently sending AUTO traffic to spec?), the probe
    counters, and the measured latency under load per path and segment (fed by ``observe``)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.latency = LoadLatencyModel()
        self._spec_open = True
        self._spec_open_by_segment: dict[str, bool] = {}  # segments with thresholds of their own
        self._lock = threading.Lock()
        self._gated: dict[str, int] = {}  # segment+class -> requests gated since its last probe
        self._moved: dict[str, int] = {}  # segment -> requests moved plain (rule 9) since its last probe
        self._moe_gated: dict[str, int] = {}  # segment -> requests kept plain by its MoE gate since its last probe

    @property
    def spec_open(self) -> bool:
        return self._spec_open

    def observe(self, path: Path, segment: str, running: float, service_s: float, tokens: int,
                beside: float = 0.0) -> None:
        """A request completed on ``path``: ``running`` requests ran beside it on average (itself
        included, ``cluster.routing.load_latency.InFlightMeter``), ``beside`` on the other path
        (0 unless the paths share hardware), ``service_s`` its time less the time it queued in
        the engine."""
        self.latency.observe(path, segment, running, service_s, tokens, beside)

    def decide(self, req: RequestFeatures, view: EngineView) -> RouteDecision:
        if req.mode is SpecMode.PLAIN:
            return RouteDecision(Path.PLAIN, RouteReason.MODE_PLAIN)
        if req.scoring and req.mode is SpecMode.AUTO:
            return RouteDecision(Path.PLAIN, RouteReason.SCORING)
        if req.constrained and not self.config.grammar_speculation:
            return RouteDecision(Path.PLAIN, RouteReason.CONSTRAINED)
        if not view.spec_available:
            return RouteDecision(Path.PLAIN, RouteReason.SPEC_UNAVAILABLE)
        if not view.moe_open(req.segment):
            if self._probe_due(self._moe_gated, req.segment, self.config.moe_probe_every):
                probe = self._probe(req.segment, view, RouteReason.PROBE_MOE_UNVALIDATED)
                if probe.path is Path.SPECULATIVE:
                    return probe
            return RouteDecision(Path.PLAIN, RouteReason.MOE_UNVALIDATED)
        if req.mode is SpecMode.SPECULATIVE:
            return RouteDecision(Path.SPECULATIVE, RouteReason.MODE_SPECULATIVE)
        measured = None if req.predicted else view.alpha(req.segment, req.acceptance_class,
                                                         self.config.min_alpha_samples)
        if measured is not None:
            alpha, samples = measured
            if samples >= self.config.min_alpha_samples and alpha < self.min_alpha(view, req.segment):
                if not self._probe_due(self._gated, classed_context(req.segment, req.acceptance_class)):
                    return RouteDecision(Path.PLAIN, RouteReason.BELOW_BREAK_EVEN)
                return self._probe(req.segment, view, RouteReason.PROBE_BELOW_BREAK_EVEN)
        return self._hysteresis(req.segment, view)

    def segment_settings(self, view: EngineView) -> list[tuple[str, int, int, float, bool]]:
        """(segment, enter, exit, min_alpha in force, min_alpha is auto) of every segment with
        settings of its own, sorted: what ModelInfo shows."""
        out = []
        for name in sorted(self.config.segments):
            enter, exit_, setting = self.config.knobs(name)
            out.append((name, enter, exit_, self.min_alpha(view, name), setting == "auto"))
        return out

    def min_alpha(self, view: EngineView, segment: str | None = None) -> float:
        """The α under which ``segment`` (None: any segment without its own setting) goes plain."""
        setting = self.config.min_alpha if segment is None else self.config.knobs(segment)[2]
        if setting != "auto":
            return float(setting)
        return FALLBACK_MIN_ALPHA if view.break_even_alpha is None else view.break_even_alpha

    def _probe(self, segment: str, view: EngineView, reason: RouteReason) -> RouteDecision:
        """A gated segment's due probe: speculative (with ``reason``) unless the hysteresis rule
        keeps the SpecEngine off now."""
        decision = self._hysteresis(segment, view, probing=True)
        return RouteDecision(Path.SPECULATIVE, reason) if decision.path is Path.SPECULATIVE else decision

    def _probe_due(self, counts: dict[str, int], segment: str, every: int | None = None) -> bool:
        """Count one gated request of ``segment``; True for every ``every``-th (default
        ``probe_every``; 0: never)."""
        every = self.config.probe_every if every is None else every
        if every == 0:
            return False
        with self._lock:
            n = counts.get(segment, 0) + 1
            due = n >= every
            counts[segment] = 0 if due else n
            return due

    def _hysteresis(self, segment: str, view: EngineView, probing: bool = False) -> RouteDecision:
        """Rules 7-9; ``probing``: an α probe, which rule 9 must not move plain."""
        decision = self._hysteresis_bit(view.spec_in_flight, segment)
        if decision.path is Path.PLAIN and self.config.balance_overflow and self._spec_sooner(segment, view):
            return RouteDecision(Path.SPECULATIVE, RouteReason.OVERFLOW_BALANCED)
        if (decision.path is Path.SPECULATIVE and self.config.plain_when_faster and not probing
                and self._plain_faster(segment, view) and not self._probe_due(self._moved, segment)):
            return RouteDecision(Path.PLAIN, RouteReason.MEASURED_PLAIN_FASTER)
        return decision

    def _plain_faster(self, segment: str, view: EngineView) -> bool:
        return bool(self.latency.faster(segment, view.joining(Path.PLAIN), view.joining(Path.SPECULATIVE),
                                        self.config.overflow_min_samples, margin=self.config.plain_faster_margin))

    def _spec_sooner(self, segment: str, view: EngineView) -> bool:
        measured = self.latency.faster(segment, view.joining(Path.SPECULATIVE), view.joining(Path.PLAIN),
                                       self.config.overflow_min_samples)
        return view.spec_less_full() if measured is None else measured

    def _hysteresis_bit(self, in_flight: int, segment: str = "") -> RouteDecision:
        enter, exit_, _ = self.config.knobs(segment)
        mine = self.config.segments.get(segment)
        own = mine is not None and (mine.enter_threshold is not None or mine.exit_threshold is not None)
        with self._lock:
            is_open = self._spec_open_by_segment.get(segment, True) if own else self._spec_open
            if is_open:
                if in_flight >= exit_:
                    self._set_open(segment, own, False)
                    return RouteDecision(Path.PLAIN, RouteReason.ABOVE_EXIT_THRESHOLD)
                reason = (RouteReason.BELOW_ENTER_THRESHOLD if in_flight < enter
                          else RouteReason.HYSTERESIS_SPECULATIVE)
                return RouteDecision(Path.SPECULATIVE, reason)
            if in_flight < enter:
                self._set_open(segment, own, True)
                return RouteDecision(Path.SPECULATIVE, RouteReason.BELOW_ENTER_THRESHOLD)
            return RouteDecision(Path.PLAIN, RouteReason.HYSTERESIS_PLAIN)

    def _set_open(self, segment: str, own: bool, value: bool) -> None:
        if own:
            self._spec_open_by_segment[segment] = value
        else:
            self._spec_open = value

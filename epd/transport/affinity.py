"""Which replica of a stage gets a call: media affinity by rendezvous hashing, the least loaded
replica without media. Pure bookkeeping (no gRPC); `epd.transport.replica_pool.ReplicaPool` holds
one per stage.

Affinity. A request about media with sha256 S goes to the replica with the highest score
hash(S, replica) among the replicas currently believed healthy (rendezvous, or highest-random-weight,
hashing). Every request about the same video therefore reaches the same encoder replica (its token
cache holds the video's visual tokens) and the same prefill replica (its prefix cache holds the
conversation's KV), from any gateway and across gateway restarts: the score depends on nothing
but the key and the replica's address. Each replica's score for a key is independent of the
others, so adding a replica moves only the keys it now wins, and losing one moves only the keys it
held: each to the replica that was second in its order, which is also where a failed call is
retried.

Prefill is keyed by what its prefix cache can reuse (`prefill_key`; docs/architecture.md, "Prefix
cache"). A conversation that opens with its media (the video in its first user message) is keyed
by the media's sha256: its every turn carries the video, and other conversations about the same
video share its prompt through the video's tokens (the same system message, a different
question), which is a hit. Any other conversation is keyed by its opening (`conversation_key`:
every message up to and including the first user message, which each of its later turns repeats):
without media, its follow-ups find the prefix cache its first turn left; with the media in a later
turn ("hello", an answer, then "look at this video"), the turn that brings the video reuses the
KV of the text before it from the text-only turns' entry, and its follow-ups that turn's entry, all
on the opening's replica. Keyed by the video instead, those turns would leave the text turns'
replica, and no conversation with another opening could have shared their KV anyway: a hit must
match the prompt through the video, opening included.

Neither key holds the request's tools, though the chat template renders them into the prompt: one
that reads them (Qwen's) puts them ahead of the conversation, in its system message, so requests
with other tools differ from there on and share no prefix through the video or the opening
wherever they go (keyed on tools, they would only spread); one that does not read them (the shipped
model's) renders the same prompt with any tools, and those requests hit each other's entries only
on one replica. Requests sharing their tools and media share a home either way.

Load. A call without a key (decode; media the gateway could not hash) goes to the healthy replica
with the least work: the larger of what the replica last reported (`set_load`: running + waiting
requests over its engine cores, `LoadService.GetLoad`, refreshed in the background) and the calls
this gateway has in flight to it (`begin`/`end`; exact and immediate, so a burst between two load
reports spreads instead of piling onto the replica that was idle at the last report). Ties go
round robin. A keyed call leaves its home replica only when that replica is overloaded: its load
exceeds the least loaded healthy replica's by more than `max_excess_load` requests. Reasoning: a
cache hit saves a whole encode (or a prompt's prefill), a miss elsewhere costs that work once and
copies the video into a second cache, while waiting behind `max_excess_load` more requests than
elsewhere costs about that many service times; a few requests of slack keeps the hit rate, a
bounded queue keeps a hot video from starving the others behind one replica. The overloaded home
is tried after the others, in rendezvous order (so the spill is itself stable: the second choice).

Health has two sources: the gateway's grpc.health checks (`set_serving`: down until a later check
says serving) and calls that failed (`mark_failed`: held back for `failure_hold_s`; a call that
found the replica unreachable is let back as soon as a check says SERVING, one that hung is not,
since answering health checks says nothing about answering calls). Replicas believed down are not
dropped from `order`, only put last, so that a stale belief costs one failed try, never a refused
request.

`routing="round-robin"` turns affinity and load off (every call in turn over the healthy
replicas): the baseline of bench/bench_routing.py.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

from epd.stages.messages import Message, media_in_opening
from epd.stages.raw_prompt import RawPrompt

FAILURE_HOLD_S = 5.0
"""How long a replica whose call failed gets no calls first (it is still tried last, and the
health checks may keep it down longer)."""

MAX_EXCESS_LOAD = 4
"""Requests a keyed call's home replica may have beyond the least loaded healthy replica before
the call goes to its next choice (see the module doc for why a few)."""

ROUTINGS = ("affinity", "round-robin")


def conversation_key(messages: Sequence[Message], salt: str = "") -> str:
    """The prefill affinity key of a conversation without media: a hash of its opening, every
    message up to and including the first user message (the same in each of its later turns, so
    a follow-up goes where the first turn's prefix cache is), and of `salt` (the tenant's: the
    prefix cache is per tenant anyway). A common opening ("hello") puts many conversations on one
    home replica; the load bound (`max_excess_load`) spills them as any hot key."""
    digest = hashlib.sha256(b"conversation\0" + salt.encode() + b"\0")
    for message in messages:
        digest.update(message.role.encode() + b"\0")
        for part in message.parts:
            digest.update(part.type.encode() + b"\0" + part.text.encode() + b"\0")
        digest.update(b"\1")  # the message's end: ["ab"] and ["a", "b"] differ
        if message.role == "user":
            break
    return digest.hexdigest()


def prefill_key(messages: Sequence[Message], media_sha256: str = "", salt: str = "") -> str:
    """The prefill affinity key of a conversation (see the module doc): its media's sha256 when
    the media is in its opening, else its opening (`conversation_key`)."""
    if media_sha256 and media_in_opening(messages):
        return media_sha256
    return conversation_key(messages, salt)


RAW_PROMPT_KEY_CHARS = 512
"""How much of a raw prompt's text (or, of token ids, 1/4 as many ids) its affinity key hashes:
prompts that begin alike (a shared instruction or few-shot preamble) go to the replica whose
prefix cache holds that beginning; a short prompt is hashed whole."""


def raw_prompt_key(prompt: RawPrompt, salt: str = "") -> str:
    """The prefill affinity key of a raw prompt (`epd.stages.raw_prompt`): a hash of its beginning
    and of `salt`, in a domain of its own, so that it never names a conversation's home (prefill's
    prefix cache keeps raw prompts under keys of their own too)."""
    digest = hashlib.sha256(b"raw prompt\0" + salt.encode() + b"\0")
    if prompt.token_ids:
        ids = prompt.token_ids[: RAW_PROMPT_KEY_CHARS // 4]
        digest.update(b"ids\0" + b",".join(str(t).encode() for t in ids))
    else:
        digest.update(b"text\0" + prompt.text[:RAW_PROMPT_KEY_CHARS].encode())
    return digest.hexdigest()


def rendezvous_score(key: str, replica: str) -> int:
    """A stable 64-bit score of `replica` for `key` (the same in every process and run)."""
    digest = hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replicas: Sequence[str]) -> list[str]:
    """`replicas` by descending score for `key` (ties, i.e. duplicates, by name): the first is the
    key's home, the second where it goes when the first is gone, and so on."""
    return sorted(replicas, key=lambda r: (-rendezvous_score(key, r), r))


class ReplicaChooser:
    """The order in which one call tries the replicas of a stage.

    `order(key)`: the replicas believed healthy, best first, then those believed down. With a key
    (a media sha256, a conversation's `prefill_key`): rendezvous order, an overloaded home moved after the others. Without one:
    least loaded first, ties in turn (each call starting one further).
    """

    def __init__(
        self,
        replicas: Sequence[str],
        failure_hold_s: float = FAILURE_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
        routing: str = "affinity",
        max_excess_load: int = MAX_EXCESS_LOAD,
    ) -> None:
        if not replicas:
            raise ValueError("a stage needs at least one address")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
        self.replicas: list[str] = list(dict.fromkeys(replicas))
        self.failure_hold_s = failure_hold_s
        self.routing = routing
        self.max_excess_load = max_excess_load
        self._clock = clock
        self._down: set[str] = set()  # by the health checks
        self._failed_until: dict[str, tuple[float, bool]] = {}  # by failed calls: (until, hung)
        self._reported: dict[str, int] = {}  # running + waiting, from the replica's GetLoad
        self._in_flight: dict[str, int] = {}  # calls this gateway has open to the replica
        self._turn = 0
        self._ever_served = False  # a replica has said SERVING or answered a call (`ready_once`)
        self._returns: dict[str, int] = {}  # by replica: times it came back (`returns`)

    def set_replicas(self, replicas: Sequence[str]) -> tuple[list[str], list[str]]:
        """Replace the replica list (a reloaded replica file); returns (added, removed). What is
        known about a replica that stays is kept; a new one starts healthy with no load."""
        if not replicas:
            raise ValueError("a stage needs at least one address")
        new = list(dict.fromkeys(replicas))
        added = [r for r in new if r not in self.replicas]
        removed = [r for r in self.replicas if r not in new]
        self.replicas = new
        for r in removed:
            self._down.discard(r)
            self._failed_until.pop(r, None)
            self._reported.pop(r, None)
            self._returns.pop(r, None)
        return added, removed

    def set_serving(self, replica: str, serving: bool) -> None:
        """A health check's answer for `replica` (unknown replicas are ignored). SERVING also ends
        the hold of a call that found the replica unreachable: it is back."""
        if replica not in self.replicas:
            return
        if serving:
            self._ever_served = True
            held = self._failed_until.get(replica)
            if replica in self._down or (held is not None and not held[1]):
                self._returns[replica] = self._returns.get(replica, 0) + 1
            self._down.discard(replica)
            if held is not None and not held[1]:
                del self._failed_until[replica]
        else:
            self._down.add(replica)

    def returns(self, replica: str) -> int:
        """How many times a health check found `replica` SERVING after it was found not serving or
        a call found it unreachable: it came back, perhaps as another process (a restart), so
        what was read from it before may be stale (the gateway reads prefill's model info again
        then, `epd.gateway.model_info`, rather than every second)."""
        return self._returns.get(replica, 0)

    def mark_answered(self, replica: str) -> None:
        """A call to `replica` was answered: the stage has served (`ready_once`)."""
        if replica in self.replicas:
            self._ever_served = True

    @property
    def ready_once(self) -> bool:
        """Whether a replica of the stage has ever served (a health check's SERVING, an answered
        call): until then a failed call means the stage is not ready yet, not that it was lost."""
        return self._ever_served

    def mark_failed(self, replica: str, hung: bool = False) -> None:
        """A call to `replica` failed with UNAVAILABLE (or, `hung`, did not answer in its attempt
        timeout): it gets calls only after the others for `failure_hold_s`."""
        if replica in self.replicas:
            self._failed_until[replica] = (self._clock() + self.failure_hold_s, hung)

    def set_load(self, replica: str, load: int | None) -> None:
        """The replica's reported running + waiting requests (None: it did not answer; its load is
        then this gateway's own calls to it only)."""
        if load is None:
            self._reported.pop(replica, None)
        elif replica in self.replicas:
            self._reported[replica] = load

    def begin(self, replica: str) -> None:
        """A call to `replica` starts (counted in its load until `end`)."""
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1

    def end(self, replica: str) -> None:
        n = self._in_flight.get(replica, 0) - 1
        if n > 0:
            self._in_flight[replica] = n
        else:
            self._in_flight.pop(replica, None)

    def in_flight(self, replica: str) -> int:
        return self._in_flight.get(replica, 0)

    def calls_open(self) -> int:
        """Calls this gateway has open to the stage, to any replica (removed ones' too)."""
        return sum(self._in_flight.values())

    def load(self, replica: str) -> int:
        """Work at `replica` as this gateway sees it: the larger of its report and our calls."""
        return max(self._reported.get(replica, 0), self._in_flight.get(replica, 0))

    def is_healthy(self, replica: str) -> bool:
        if replica in self._down:
            return False
        held = self._failed_until.get(replica)
        if held is not None and self._clock() >= held[0]:
            del self._failed_until[replica]
            held = None
        return held is None

    def healthy(self) -> list[str]:
        return [r for r in self.replicas if self.is_healthy(r)]

    def order(self, key: str = "") -> list[str]:
        healthy = self.healthy()
        up = set(healthy)
        if self.routing == "round-robin":
            turn = self._in_turn(healthy or self.replicas)
            return turn + [r for r in self.replicas if r not in turn]
        if key:
            ranked = rendezvous_order(key, self.replicas)
            first = [r for r in ranked if r in up]
            if len(first) > 1:
                bound = min(self.load(r) for r in first) + self.max_excess_load
                first = [r for r in first if self.load(r) <= bound] + [
                    r for r in first if self.load(r) > bound
                ]
            return first + [r for r in ranked if r not in up]
        if not healthy:  # all believed down: in turn over all of them, a stale belief costs a try
            return self._in_turn(self.replicas)
        by_load = sorted(self._in_turn(healthy), key=self.load)  # stable: ties stay in turn
        return by_load + [r for r in self.replicas if r not in up]

    def _in_turn(self, replicas: list[str]) -> list[str]:
        if not replicas:
            return []
        start = self._turn % len(replicas)
        self._turn += 1
        return replicas[start:] + replicas[:start]

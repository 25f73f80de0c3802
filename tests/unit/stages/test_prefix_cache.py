"""The prefix cache's bookkeeping alone (`prefill_svc/prefix_cache.py`), with fake entries: the
longest common prefix, the visual-boundary rule, the byte budget (LRU), the TTL and key isolation.
The exactness of a hit is tests/integration/test_prefix_cache.py."""

from __future__ import annotations

import torch

from epd.prefill_svc.prefix_cache import MIN_REUSE_TOKENS, PrefixCache, PrefixView, common_prefix_length

V = 7  # a visual placeholder id: every visual token has it
PREAMBLE = [1, *range(100, 115)]  # 16 tokens: the chat template's, and a system message
TURN1 = [*PREAMBLE, 2, V, V, V, V, 3, 4, 5]  # ..., video (4 tokens), question
VISUAL_END = len(PREAMBLE) + 5  # prompt index after the last visual token


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_common_prefix_length():
    a = torch.tensor([1, 2, 3, 4])
    assert common_prefix_length(a, torch.tensor([1, 2, 3, 4, 5])) == 4
    assert common_prefix_length(a, torch.tensor([1, 2, 9, 4])) == 2
    assert common_prefix_length(a, torch.tensor([9])) == 0
    assert common_prefix_length(a, torch.tensor([], dtype=torch.long)) == 0


def test_a_follow_up_reuses_the_whole_earlier_prompt():
    cache = PrefixCache(1000, 60)
    assert cache.lookup("k", TURN1, VISUAL_END) is None  # nothing stored yet: a miss
    cache.put("k", TURN1, "kv1", 100)
    turn2 = [*TURN1, 8, 9, 10, 11]  # the answer and the next question
    hit = cache.lookup("k", turn2, VISUAL_END)
    assert hit is not None and hit.num_reused_tokens == len(TURN1) and hit.entry.cache == "kv1"
    stats = cache.stats()
    assert (stats.num_hits, stats.num_misses, stats.num_entries, stats.num_bytes) == (1, 1, 1, 100)


def test_the_longest_prefix_wins_and_a_divergent_follow_up_reuses_up_to_the_fork():
    cache = PrefixCache(1000, 60)
    cache.put("k", [*TURN1, 20, 21], "short", 10)
    cache.put("k", [*TURN1, 30, 31, 32, 33], "long", 10)
    hit = cache.lookup("k", [*TURN1, 30, 31, 32, 99], VISUAL_END)
    assert hit is not None and hit.entry.cache == "long" and hit.num_reused_tokens == len(TURN1) + 3
    hit = cache.lookup("k", [*TURN1, 40], VISUAL_END)  # shares only TURN1 with both
    assert hit is not None and hit.num_reused_tokens == len(TURN1)


def test_an_lcp_ending_inside_the_visual_tokens_is_a_miss():
    cache = PrefixCache(1000, 60)
    cache.put("k", TURN1, "kv", 10)
    # Same first two visual tokens, then the prompt differs inside the video (fewer frames).
    shorter_video = [*PREAMBLE, 2, V, V, 3, 4, 5]
    assert cache.lookup("k", shorter_video, min_reuse=VISUAL_END - 1) is None
    assert cache.stats().num_misses == 1


def test_at_least_one_token_is_left_to_compute():
    """The same prompt again reuses all but its last token: the first token needs its logits."""
    cache = PrefixCache(1000, 60)
    cache.put("k", TURN1, "kv", 10)
    hit = cache.lookup("k", TURN1, VISUAL_END)
    assert hit is not None and hit.num_reused_tokens == len(TURN1) - 1
    # ... unless the last token is itself the last visual one: then nothing can be reused.
    only_video = [1, V, V]
    cache.put("k2", only_video, "kv", 10)
    assert cache.lookup("k2", only_video, 3) is None


def test_another_keys_entry_serves_up_to_its_bound():
    """A conversation whose video came after text-only turns: its media prompt's own key has no
    entry yet, and the text-only turn's entry (another key) holds its KV up to the first visual
    token; it serves that far and no further, and the media key's own entry wins when there is one."""
    cache = PrefixCache(1000, 60)
    text_turn = [*PREAMBLE, 2, 3, 4, 5]  # system, "hello", the answer's header
    media_turn = [*text_turn, 6, V, V, 8]  # ... the answer, then the video (from index 21)
    first_visual = len(text_turn) + 1
    cache.put("text", [*text_turn, 6, 9], "text kv", 10)  # its LCP with the media turn runs to 21
    assert cache.lookup("media", media_turn, first_visual + 2) is None  # without `also`: a miss
    hit = cache.lookup("media", media_turn, first_visual + 2, also=PrefixView("text", first_visual))
    assert hit is not None and hit.entry.cache == "text kv" and hit.num_reused_tokens == first_visual
    # bounded below its LCP
    hit = cache.lookup("media", media_turn, first_visual + 2, also=PrefixView("text", first_visual - 2))
    assert hit is not None and hit.num_reused_tokens == first_visual - 2
    # no common prefix
    assert (
        cache.lookup("media", [9, *media_turn], first_visual + 3, also=PrefixView("text", first_visual + 1))
        is None
    )
    cache.put("media", media_turn, "media kv", 10)
    hit = cache.lookup("media", [*media_turn, 10], first_visual + 2, also=PrefixView("text", first_visual))
    assert hit is not None and hit.entry.cache == "media kv" and hit.num_reused_tokens == len(media_turn)
    stats = cache.stats()
    assert (stats.num_hits, stats.num_misses) == (3, 2)  # one count per lookup


def test_lookups_are_counted_in_tokens():
    """vLLM's prefix_cache_queries and prefix_cache_hits: every lookup's prompt tokens, and the
    tokens reused (not the entry's length, nor the common prefix beyond the last one computed)."""
    cache = PrefixCache(1000, 60)
    cache.lookup("k", TURN1, VISUAL_END)  # a miss: queried, nothing reused
    cache.put("k", TURN1, "kv", 10)
    cache.lookup("k", TURN1, VISUAL_END)  # the same prompt: all but its last token
    cache.lookup("k", [*TURN1, 8, 9], VISUAL_END)  # a follow-up: all of TURN1
    stats = cache.stats()
    assert (stats.num_hits, stats.num_misses) == (2, 1)
    assert stats.num_query_tokens == 3 * len(TURN1) + 2
    assert stats.num_hit_tokens == (len(TURN1) - 1) + len(TURN1)


def test_a_reuse_shorter_than_the_minimum_is_a_miss_and_renews_nothing():
    """Another conversation that shares only the template's preamble (under 16 tokens) reuses
    nothing: no hit in the counts, and the entry it shares them with is not kept alive by it."""
    clock = Clock()
    cache = PrefixCache(1000, 10, clock)
    cache.put("text", [*PREAMBLE, 2, 3], "a", 10)
    clock.now = 8
    assert MIN_REUSE_TOKENS == len(PREAMBLE) == 16
    short = [*PREAMBLE[:15], 50, 51, 52]  # shares 15 tokens
    assert cache.lookup("text", short, 0) is None
    stats = cache.stats()
    assert (stats.num_hits, stats.num_misses, stats.num_hit_tokens) == (0, 1, 0)
    clock.now = 11  # unused since 0: gone at its TTL, the lookup at 8 did not renew it
    assert cache.stats().num_entries == 0
    cache.put("text", [*PREAMBLE, 2, 3], "a", 10)
    hit = cache.lookup("text", [*PREAMBLE, 60], 0)  # exactly the minimum: a hit
    assert hit is not None and hit.num_reused_tokens == MIN_REUSE_TOKENS


def test_a_prefix_many_entries_share_renews_the_most_recent():
    """Ties go to the most recently used entry: conversations that share an opening (a long
    system message) renew the one in use, and the older ones still age out."""
    clock = Clock()
    cache = PrefixCache(1000, 10, clock)
    cache.put("text", [*PREAMBLE, 2, 3], "old", 10)
    clock.now = 5
    cache.put("text", [*PREAMBLE, 4, 5], "new", 10)
    clock.now = 9
    hit = cache.lookup("text", [*PREAMBLE, 6, 7], 0)  # shares PREAMBLE with both
    assert hit is not None and hit.entry.cache == "new" and hit.num_reused_tokens == len(PREAMBLE)
    clock.now = 12  # "old" unused since 0, "new" renewed at 9
    assert cache.stats().num_entries == 1 and [e.cache for e in cache._entries.values()] == ["new"]


def test_the_turn_that_brings_the_video_supersedes_the_text_turns_entry():
    """A conversation's text turn, then its video turn (stored with `also`: found under the
    text-only key for the text before its video). The text turn's entry leaves, for the media
    entry serves every text-only lookup it served, as far: a new conversation with the same
    opening reuses it from there, up to the first visual token and no further. Other entries of
    the text-only key (another opening) stay."""
    cache = PrefixCache(1000, 60)
    text_turn = [*PREAMBLE, 2, 3, 4]  # system, "hello", the generation prompt
    media_turn = [*text_turn, 5, 6, 7, V, V, 8]  # the answer, the user's header, the video
    first_visual = media_turn.index(V)
    cache.put("text", text_turn, "text kv", 100)
    cache.put("text", [*PREAMBLE, 20, 21], "another opening", 100)
    hit = cache.lookup("media", media_turn, first_visual + 2, also=PrefixView("text", first_visual))
    assert hit is not None and hit.entry.cache == "text kv" and hit.num_reused_tokens == len(text_turn)
    cache.put("media", media_turn, "media kv", 300, also=PrefixView("text", first_visual))
    stats = cache.stats()
    assert (stats.num_entries, stats.num_bytes, stats.num_evictions) == (2, 400, 0)
    assert sorted(e.cache for e in cache._entries.values()) == ["another opening", "media kv"]
    hit = cache.lookup("text", [*text_turn, 9], 0)  # a new conversation, the same opening
    assert hit is not None and hit.entry.cache == "media kv" and hit.num_reused_tokens == len(text_turn)
    # A text-only prompt that goes on with the placeholder's id as text: its KV differs from
    # there (text embeddings, not the video's), so the reuse stops at the first visual token.
    hit = cache.lookup("text", [*media_turn[: first_visual + 1], 9], 0)
    assert hit is not None and hit.entry.cache == "media kv" and hit.num_reused_tokens == first_visual
    # The video turn's follow-up reuses it all under its own key.
    hit = cache.lookup("media", [*media_turn, 10], first_visual + 2, also=PrefixView("text", first_visual))
    assert hit is not None and hit.num_reused_tokens == len(media_turn)


def test_an_entry_found_under_fewer_keys_is_not_superseded():
    """The text turn's entry stays when the later entry is not found under the text-only key (a
    conversation that opens with its media) or its text does not begin with the text turn's."""
    cache = PrefixCache(1000, 60)
    text_turn = [*PREAMBLE, 2, 3, 4]
    cache.put("text", text_turn, "text kv", 10)
    cache.put("media", [*text_turn, 5, V, V], "no also", 10)
    cache.put(
        "media", [*text_turn, 6, V, V], "bound too short", 10, also=PrefixView("text", len(text_turn) - 1)
    )
    cache.put(
        "media", [*PREAMBLE, 2, 9, 4, V], "another text", 10, also=PrefixView("text", len(PREAMBLE) + 3)
    )
    assert cache.stats().num_entries == 4
    hit = cache.lookup("text", [*text_turn, 9], 0)
    assert hit is not None and hit.entry.cache == "text kv" and hit.num_reused_tokens == len(text_turn)


def test_keys_isolate_models_media_and_settings():
    cache = PrefixCache(1000, 60)
    key = ("model-a", "sha-1", (2, 4, 4), "auto")
    cache.put(key, TURN1, "kv", 10)
    for other in [
        ("model-b", "sha-1", (2, 4, 4), "auto"),  # another checkpoint
        ("model-a", "sha-2", (2, 4, 4), "auto"),  # another video
        ("model-a", "sha-1", (4, 4, 4), "auto"),  # the same video sampled otherwise
        ("model-a", "sha-1", (2, 4, 4), "bfloat16"),  # another kv_dtype
    ]:
        assert cache.lookup(other, [*TURN1, 8], VISUAL_END) is None, other
    assert cache.lookup(key, [*TURN1, 8], VISUAL_END) is not None


def test_lru_eviction_under_the_byte_budget():
    clock = Clock()
    cache = PrefixCache(250, 600, clock)
    cache.put("a", TURN1, "a", 100)
    clock.now = 1
    cache.put("b", TURN1, "b", 100)
    clock.now = 2
    assert cache.lookup("a", [*TURN1, 8], VISUAL_END) is not None  # "a" is now the most recent
    cache.put("c", TURN1, "c", 100)  # over 250: the least recently used ("b") leaves
    assert cache.lookup("b", [*TURN1, 8], VISUAL_END) is None
    assert cache.lookup("a", [*TURN1, 8], VISUAL_END) is not None
    assert cache.lookup("c", [*TURN1, 8], VISUAL_END) is not None
    stats = cache.stats()
    assert (stats.num_entries, stats.num_bytes, stats.num_evictions) == (2, 200, 1)
    assert not cache.put("d", TURN1, "d", 251)  # larger than the whole budget: not kept
    assert cache.stats().num_entries == 2


def test_a_longer_entry_replaces_the_one_it_extends():
    cache = PrefixCache(1000, 60)
    cache.put("k", TURN1, "turn1", 100)
    cache.put("k", [*TURN1, 8, 9], "turn2", 120)
    cache.put("other", TURN1, "other", 100)  # another key is left alone
    stats = cache.stats()
    assert (stats.num_entries, stats.num_bytes, stats.num_evictions) == (2, 220, 0)
    hit = cache.lookup("k", TURN1, VISUAL_END)
    assert hit is not None and hit.entry.cache == "turn2"


def test_put_says_how_many_tokens_it_wrote():
    """What the Responses API reports as `cache_write_tokens`: a first prompt's every token; a
    follow-up's tokens after the turn it continues; none for a prompt held already, or one too
    large to keep; under the text-only view (`also`), the text turn's tokens were held."""
    cache = PrefixCache(1000, 60)
    assert cache.put("k", TURN1, "turn1", 100) == len(TURN1)
    assert cache.put("k", [*TURN1, 8, 9], "turn2", 120) == 2  # turn 1's KV was held
    assert cache.put("k", [*TURN1, 8, 9], "again", 120) == 0
    assert cache.put("k", [*TURN1[:-1], 6], "a sibling", 100) == 1  # all but the last held
    assert cache.put("other", TURN1, "another key", 100) == len(TURN1)  # another key's KV differs
    assert cache.put("big", TURN1, "too large", 1001) == 0
    text_turn = [*PREAMBLE, 2, 3, 4]
    assert cache.put("text", text_turn, "text kv", 10) == len(text_turn)
    media_turn = [*text_turn, 5, V, V, 6]
    first_visual = len(text_turn) + 1
    written = cache.put("media", media_turn, "media kv", 10, also=PrefixView("text", first_visual))
    assert written == len(media_turn) - len(text_turn)


def test_a_prompt_an_entry_already_holds_adds_no_entry_and_renews_it():
    """A prompt whose ids begin an entry of its key (a continued assistant message after its
    conversation's next turn was cached, or an earlier turn asked again): the entry serves every
    lookup the prompt's own entry would, as far, so the same KV is not kept twice (it would take
    budget from other conversations). The entry is renewed, as the prompt's would be fresh."""
    clock = Clock()
    cache = PrefixCache(1000, 10, clock)
    cache.put("k", [*TURN1, 8, 9], "turn2", 120)
    clock.now = 8
    assert cache.put("k", TURN1, "turn1", 100) == 0  # nothing written: its KV is held, by "turn2"
    stats = cache.stats()
    assert (stats.num_entries, stats.num_bytes, stats.num_evictions) == (1, 120, 0)
    assert cache.put("k", [*TURN1, 8, 9], "again", 120) == 0  # the same ids again
    assert [(e.cache, e.num_bytes) for e in cache._entries.values()] == [("turn2", 120)]
    clock.now = 15  # unused by a lookup since 0, renewed by the puts at 8
    hit = cache.lookup("k", [*TURN1, 3], VISUAL_END)
    assert hit is not None and hit.entry.cache == "turn2" and hit.num_reused_tokens == len(TURN1)
    # Found under fewer keys, or not as far: the shorter prompt's entry is kept.
    cache.put("media", [*TURN1, 8, 9], "media", 10)
    cache.put("media", TURN1, "media, also text", 10, also=PrefixView("text", 3))
    assert cache.stats().num_entries == 3


def test_ttl_drops_unused_entries():
    clock = Clock()
    cache = PrefixCache(1000, 10, clock)
    cache.put("a", TURN1, "a", 100)
    cache.put("b", TURN1, "b", 100)
    clock.now = 8
    assert cache.lookup("a", [*TURN1, 8], VISUAL_END) is not None  # a use renews "a"
    clock.now = 12
    assert cache.lookup("b", [*TURN1, 8], VISUAL_END) is None  # "b" unused for 12 s > 10
    assert cache.lookup("a", [*TURN1, 8], VISUAL_END) is not None
    stats = cache.stats()
    assert (stats.num_entries, stats.num_bytes, stats.num_evictions) == (1, 100, 1)


def test_off_keeps_nothing():
    cache = PrefixCache(0, 60)
    assert not cache.enabled
    assert not cache.put("k", TURN1, "kv", 1)
    assert len(cache) == 0


def test_the_prefill_cores_prefix_cache_counts_reach_metrics():
    """`EngineLoad`'s prefix-cache fields on /metrics, on the prefill stage's samples only."""
    import asyncio

    from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
    from epd.gateway.pipeline import Pipeline
    from epd.stages.engine_core import EngineLoad

    class Stage:
        def __init__(self, load: EngineLoad) -> None:
            self._load = load

        def load(self) -> EngineLoad:
            return self._load

    prefill = EngineLoad("prefill", prefix_cache_hits=3, prefix_cache_misses=2, prefix_cache_query_tokens=120,
                         prefix_cache_hit_tokens=90, prefix_cache_evictions=1, prefix_cache_entries=4,
                         prefix_cache_bytes=4096)  # fmt: skip
    metrics = GatewayMetrics()
    MeteredPipeline(
        Pipeline(Stage(EngineLoad("encoder")), Stage(prefill), Stage(EngineLoad("decode"))), metrics
    )
    text = asyncio.run(metrics.scrape()).decode()
    expected = {
        "epd_prefix_cache_hits_total": ("counter", 3),
        "epd_prefix_cache_misses_total": ("counter", 2),
        "epd_prefix_cache_query_tokens_total": ("counter", 120),
        "epd_prefix_cache_hit_tokens_total": ("counter", 90),
        "epd_prefix_cache_evictions_total": ("counter", 1),
        "epd_prefix_cache_entries": ("gauge", 4),
        "epd_prefix_cache_bytes": ("gauge", 4096),
    }
    for name, (kind, value) in expected.items():
        assert f"# TYPE {name} {kind}" in text, name
        labels = {"stage": "prefill", "core": "prefill", "replica": "local"}
        assert metrics.registry.get_sample_value(name, labels) == value, name
        assert (
            metrics.registry.get_sample_value(name, {**labels, "stage": "decode", "core": "decode"}) is None
        )

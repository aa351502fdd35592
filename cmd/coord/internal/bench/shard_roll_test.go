package bench

import (
	"testing"
	"time"
)

func TestBenchShardHandoffs(t *testing.T) {
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	rel := func(host, shard string, ended, released int) benchShardRelease {
		return benchShardRelease{host, shard, at(released), at(ended)}
	}
	acq := func(host, shard string, ms int) benchShardAcquire { return benchShardAcquire{host, shard, at(ms)} }
	// a drains s1, s2 and s3 from 0 ms on: s1 and s2 to b, s3 to c; s4,
	// released last, is acquired by no one; s1 comes back to a later.
	h := benchShardHandoffsOf(
		[]benchShardAcquire{acq("b", "s1", 205), acq("b", "s2", 230), acq("c", "s3", 260), acq("a", "s1", 900)},
		[]benchShardRelease{rel("a", "s1", 0, 200), rel("a", "s2", 10, 210), rel("a", "s3", 240, 250),
			rel("b", "s1", 600, 800), rel("a", "s4", 950, 1000)})
	t.Run("each release is paired with the next acquire of its shard", func(t *testing.T) {
		if h.moves != 4 || h.handoffs != 4 || h.perShard["s1"] != 2 || h.perShard["s3"] != 1 {
			t.Errorf("moves %d, handoffs %d, by shard %v", h.moves, h.handoffs, h.perShard)
		}
	})
	t.Run("the gap runs from the release, the handoff from the ctx end", func(t *testing.T) {
		if h.gap.rel.shard != "s1" || h.gap.acq.host != "a" || h.gap.gap() != 100*time.Millisecond {
			t.Errorf("largest gap %v: %+v", h.gap.gap(), h.gap)
		}
		if h.span.span() != 300*time.Millisecond || h.span.rel.host != "b" {
			t.Errorf("longest handoff %v: %+v", h.span.span(), h.span)
		}
		if h.drain != 200*time.Millisecond {
			t.Errorf("longest Run drain %v, want 200ms", h.drain)
		}
	})
	t.Run("in flight counts overlapping handoffs, fleet-wide and by successor", func(t *testing.T) {
		// s1 [0, 205], s2 [10, 230], s3 [240, 260]: two at once, both to b.
		if h.inFlight != 2 || h.toOne != 2 {
			t.Errorf("in flight %d, to one member %d; want 2 and 2", h.inFlight, h.toOne)
		}
	})
	t.Run("a release that no acquire follows is left unowned", func(t *testing.T) {
		if len(h.unowned) != 1 || h.unowned[0].shard != "s4" {
			t.Errorf("unowned: %+v", h.unowned)
		}
	})
	t.Run("one ending as another begins is not both in flight", func(t *testing.T) {
		hs := []benchShardHandoff{{rel("a", "x", 0, 5), acq("b", "x", 10)}, {rel("a", "y", 10, 15), acq("b", "y", 20)}}
		if n := benchMostAtOnce(hs); n != 1 {
			t.Errorf("%d at once, want 1", n)
		}
	})
}

func TestBenchShardRollOver(t *testing.T) {
	r := benchShardRollResult{allowed: map[string]int{"s1": 2, "s2": 2},
		h: benchShardHandoffs{perShard: map[string]int{"s1": 2, "s2": 3, "s3": 1}}}
	n, first, most := r.over()
	if n != 2 || first != "s2" || most != 3 {
		t.Errorf("over %d, first %q, most %d; want 2 (s2 moved 3 times, s3 once without a restarted owner), s2, 3", n, first, most)
	}
}

package bench

import (
	"slices"
	"testing"
	"time"
)

func TestBenchShardHandoffs(t *testing.T) {
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	rel := func(host, shard string, ended, released int) benchShardRelease {
		return benchShardRelease{host, shard, at(released), at(ended)}
	}
	acq := func(host, shard string, ms int) benchShardAcquire {
		return benchShardAcquire{host: host, shard: shard, at: at(ms)}
	}
	led := func(a benchShardAcquire, ms int) benchShardAcquire { a.led = at(ms); return a }
	// a drains s1, s2 and s3 from 0 ms on: s1 and s2 to b, s3 to c; s4,
	// released last, is acquired by no one; s1 comes back to a later. b's
	// leadership of s1 began at 203 ms, of s2 before the release (an
	// older one: not a split), c's of s3 is not known.
	h := benchShardHandoffsOf(
		[]benchShardAcquire{led(acq("b", "s1", 205), 203), led(acq("b", "s2", 230), 5), acq("c", "s3", 260), led(acq("a", "s1", 900), 850)},
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
	t.Run("every gap is kept, and split at the successor's leadership when it came between", func(t *testing.T) {
		ms := func(ns ...int) benchLatencies {
			var l benchLatencies
			for _, n := range ns {
				l = append(l, time.Duration(n)*time.Millisecond)
			}
			return l
		}
		if want := ms(5, 10, 20, 100); !slices.Equal(h.gaps, want) {
			t.Errorf("gaps %v, want %v", h.gaps, want)
		}
		if want := ms(3, 50); !slices.Equal(h.toLed, want) {
			t.Errorf("release → led %v, want %v", h.toLed, want)
		}
		if want := ms(2, 50); !slices.Equal(h.fromLed, want) {
			t.Errorf("led → acquire %v, want %v", h.fromLed, want)
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

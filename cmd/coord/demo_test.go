package main

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestDemo(t *testing.T) {
	t.Parallel()
	t.Run("runs end to end by itself, with the delays it measured", func(t *testing.T) {
		r := runCoord(t, "demo")
		t.Logf("coord demo (%v):\n%s", r.took, r.stdout)
		if r.code != exitOK || r.stderr != "" {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		if r.took > 20*time.Second*scale {
			t.Errorf("took %v", r.took)
		}
		stamp := regexp.MustCompile(`^\d\d:\d\d:\d\d\.\d{3}  `)
		for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
			if !stamp.MatchString(line) && !strings.HasSuffix(line, " ms") {
				t.Errorf("line without a timestamp: %q", line)
			}
		}
		for _, want := range []string{
			"up   node-1", "up   node-4",
			"node-1   leads /coord/elections/scheduler",
			"down node-4", "down node-1", "down node-3",
			"node-2   leads /coord/elections/scheduler",
			"down node-2",
			"up   node-5", "up   node-8", "node-8   starts its ShardSet",
			"settled: every shard owned by its top-ranked host",
			"leaves for a planned restart: Drain hands each to its standby",
			"closes its ShardSet (Done closed, Err <nil>): nothing more to hand over",
			"no shard ever ran on two hosts at once",
			"node-9   acquires a permit (fencing token", "node-10  acquires a permit",
			"node-11  asks for a permit; both are held: waits in line, first",
			"node-12  asks for a permit; both are held: waits in line, second",
			"node-9   permit ended", "node-11  acquires the freed permit",
			"node-12  acquires the released permit", "node-11 and node-12 release theirs: 0 permits held",
			"summary", "done in",
		} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("output lacks %q", want)
			}
		}
		// A crash is noticed once the lease expires: after at least about
		// two thirds of the 2 s TTL (the last renewal), well before 10 s.
		// A Stop is noticed at once.
		delays := map[string]int{}
		row := regexp.MustCompile(`^\s+(\S.*\S)\s+(\d+) ms$`)
		for _, line := range strings.Split(r.stdout, "\n") {
			if m := row.FindStringSubmatch(line); m != nil {
				delays[m[1]], _ = strconv.Atoi(m[2])
			}
		}
		slow := int(scale) // upper bounds stretch on slow machines
		bounds := map[string][2]int{
			"node-4 crash -> Down seen by the watcher":          {1000, 10000 * slow},
			"node-1 (leader) crash -> Down seen by the watcher": {1000, 10000 * slow},
			"node-1 (leader) crash -> node-2 leads":             {1000, 10000 * slow},
			"node-3 Stop -> Down seen by the watcher":           {0, 1000 * slow},
		}
		shards := checkDemoShards(t, r.stdout, slow)
		// A handover is Run's drain (none here) plus a few round trips;
		// a crash is noticed once the leases expire, as above.
		if shards.joinMoved > 0 {
			bounds["node-8 joins -> a moved shard owned again, longest gap"] = [2]int{0, 1000 * slow}
		}
		bounds[shards.leaver+" Drain -> returns, owning nothing"] = [2]int{0, 3000 * slow}
		if shards.drainMoved > 0 {
			bounds[shards.leaver+" Drain -> a shard without an owner, longest"] = [2]int{0, 1000 * slow}
		}
		// A holder cut off ends its permit at once when its client goes;
		// its slot is free once its session expires.
		bounds["node-9 (holder) crash -> its permit ends (Done)"] = [2]int{0, 1000 * slow}
		bounds["node-9 (holder) crash -> node-11 holds its permit"] = [2]int{1000, 10000 * slow}
		bounds["node-10 Release -> node-12 holds its permit"] = [2]int{0, 1000 * slow}
		checkDemoTokens(t, r.stdout)
		for _, which := range []string{"first", "last"} {
			bounds[shards.victim+" crash -> its shards owned again, "+which] = [2]int{1000, 10000 * slow}
		}
		for what, b := range bounds {
			ms, ok := delays[what]
			if !ok || ms < b[0] || ms > b[1] {
				t.Errorf("summary: %q = %d ms (found: %v), want within %v", what, ms, ok, b)
			}
		}
		if len(delays) != len(bounds) {
			t.Errorf("summary: %d rows, want %d: %v", len(delays), len(bounds), delays)
		}
	})

	t.Run("Ctrl-C ends it early and cleanly", func(t *testing.T) {
		d := startCoord(t, "demo")
		d.waitOutput(t, d.stdout, "node-4 crashes")
		r := d.stop(t)
		if r.code != exitError || !strings.Contains(r.stderr, "demo interrupted") {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		if r.took > 10*time.Second*scale {
			t.Errorf("took %v", r.took)
		}
	})
}

// demoShardClaims is what the ShardSet act of the demo claimed.
type demoShardClaims struct {
	joinMoved  int    // shards that moved to node-8 when it joined
	leaver     string // the agent that drained and left
	drainMoved int    // shards it handed over
	victim     string // the agent that crashed
}

// checkDemoTokens checks that the fencing tokens printed rise: the
// election's, then the semaphore's.
func checkDemoTokens(t *testing.T, out string) {
	t.Helper()
	token := regexp.MustCompile(`fencing token (\d+)`)
	var tokens []int
	for _, m := range token.FindAllStringSubmatch(out, -1) {
		tokens = append(tokens, atoi(m[1]))
	}
	if len(tokens) != 6 {
		t.Errorf("%d fencing tokens printed, want 6 (2 leaders, 4 permits): %v", len(tokens), tokens)
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Errorf("fencing tokens %v: not rising", tokens)
		}
	}
}

// checkDemoShards checks that the ShardSet act of the demo's output holds
// together: each listing of the owners places every shard once; the join
// moved only to node-8, as many shards as it says, each owned again
// quickly; the drain moved exactly the shards the leaver owned, each to
// another agent, quickly; the crash moved exactly the shards the victim owned, each to
// another agent, once its leases expired.
func checkDemoShards(t *testing.T, out string, slow int) demoShardClaims {
	t.Helper()
	var got demoShardClaims
	const stamp = `^\d\d:\d\d:\d\d\.\d{3}  `
	var (
		owns     = regexp.MustCompile(stamp + `(node-\d)   owns\s+(\d+):((?: shard-\d\d)*)$`)
		joinMove = regexp.MustCompile(stamp + `shards   (shard-\d\d): (node-\d) -> (node-\d), owned again (\d+) ms after (node-\d) let go$`)
		joined   = regexp.MustCompile(stamp + `shards   join: (?:(\d+) of 12 shards moved, all to node-8; the other (\d+) stayed put|node-8 ranks first for none of the 12 shards: none moved)$`)
		leaves   = regexp.MustCompile(stamp + `demo     --- (node-\d), owning (\d+) shards, leaves for a planned restart`)
		drainMv  = regexp.MustCompile(stamp + `shards   (shard-\d\d): (node-\d) -> (node-\d), handed over: owned again (\d+) ms after (node-\d) released it$`)
		crashes  = regexp.MustCompile(stamp + `demo     --- (node-\d), owning (\d+) shards, crashes`)
		crashMv  = regexp.MustCompile(stamp + `shards   (shard-\d\d): (node-\d) -> (node-\d), owned again (\d+) ms after the crash$`)
		crashed  = regexp.MustCompile(stamp + `shards   crash: the (\d+) shards (node-\d) owned moved to their standbys; no other shard moved$`)
	)
	// The owners, as each listing (a run of "owns" lines) shows them.
	var listings []map[string]string
	inListing := false
	joinMoved, drainMoved, crashMoved := map[string]bool{}, map[string]bool{}, map[string]bool{}
	victimOwned, leaverOwned, crashClaim := -1, -1, -1
	for _, line := range strings.Split(out, "\n") {
		m := owns.FindStringSubmatch(line)
		if m == nil {
			inListing = false
		} else {
			if !inListing {
				listings = append(listings, map[string]string{})
				inListing = true
			}
			names := strings.Fields(m[3])
			if n := atoi(m[2]); n != len(names) {
				t.Errorf("%q: says %d shards, lists %d", line, n, len(names))
			}
			for _, s := range names {
				cur := listings[len(listings)-1]
				if cur[s] != "" {
					t.Errorf("%s listed as owned by %s and %s", s, cur[s], m[1])
				}
				cur[s] = m[1]
			}
		}
		switch {
		case joinMove.MatchString(line):
			m := joinMove.FindStringSubmatch(line)
			ms := atoi(m[4])
			if m[3] != "node-8" || m[2] != m[5] || ms > 1000*slow {
				t.Errorf("join move %q: want to node-8, from the host that let go, within %d ms", line, 1000*slow)
			}
			joinMoved[m[1]] = true
		case joined.MatchString(line):
			m := joined.FindStringSubmatch(line)
			n := atoi(m[1])
			if m[1] != "" && (n == 0 || n+atoi(m[2]) != 12) {
				t.Errorf("%q does not add up", line)
			}
			if n != len(joinMoved) {
				t.Errorf("%q, but %d moves printed", line, len(joinMoved))
			}
			got.joinMoved = n
		case leaves.MatchString(line):
			m := leaves.FindStringSubmatch(line)
			got.leaver, leaverOwned = m[1], atoi(m[2])
		case drainMv.MatchString(line):
			m := drainMv.FindStringSubmatch(line)
			if m[2] != got.leaver || m[5] != got.leaver || m[3] == got.leaver || atoi(m[4]) > 1000*slow {
				t.Errorf("drain move %q: want from %s to another host, within %d ms", line, got.leaver, 1000*slow)
			}
			drainMoved[m[1]] = true
		case crashes.MatchString(line):
			m := crashes.FindStringSubmatch(line)
			got.victim, victimOwned = m[1], atoi(m[2])
		case crashMv.MatchString(line):
			m := crashMv.FindStringSubmatch(line)
			ms := atoi(m[4])
			if m[2] != got.victim || m[3] == got.victim || ms < 1000 || ms > 10000*slow {
				t.Errorf("crash move %q: want from %s to another host, within [1000, %d] ms", line, got.victim, 10000*slow)
			}
			crashMoved[m[1]] = true
		case crashed.MatchString(line):
			m := crashed.FindStringSubmatch(line)
			crashClaim = atoi(m[1])
			if m[2] != got.victim {
				t.Errorf("%q: %s crashed", line, got.victim)
			}
		}
	}
	if len(listings) != 4 {
		t.Fatalf("%d listings of the owners, want 4 (3 hosts, the join, the drain, the crash)", len(listings))
	}
	for i, l := range listings {
		if len(l) != 12 {
			t.Errorf("listing %d places %d shards, want 12", i+1, len(l))
		}
	}
	// What moved, listing to listing.
	for s, o := range listings[1] {
		if before := listings[0][s]; (before != o) != joinMoved[s] || joinMoved[s] && o != "node-8" {
			t.Errorf("join: %s went from %s to %s, moves printed: %v", s, before, o, joinMoved)
		}
	}
	drained := 0
	for s, o := range listings[2] {
		before := listings[1][s]
		if before == got.leaver {
			drained++
		}
		if (before != o) != (before == got.leaver) || o == got.leaver || drainMoved[s] != (before == got.leaver) {
			t.Errorf("drain of %s: %s went from %s to %s, moves printed: %v", got.leaver, s, before, o, drainMoved)
		}
	}
	if got.leaver == "" || drained != leaverOwned {
		t.Errorf("drain of %q: owned %d shards, said to own %d", got.leaver, drained, leaverOwned)
	}
	got.drainMoved = len(drainMoved)
	owned := 0
	for s, o := range listings[3] {
		before := listings[2][s]
		if before == got.victim {
			owned++
		}
		if (before != o) != (before == got.victim) || o == got.victim || crashMoved[s] != (before == got.victim) {
			t.Errorf("crash of %s: %s went from %s to %s, moves printed: %v", got.victim, s, before, o, crashMoved)
		}
	}
	if got.victim == "" || owned == 0 || owned != victimOwned || owned != crashClaim {
		t.Errorf("crash of %q: owned %d shards, said to own %d, said to have moved %d", got.victim, owned, victimOwned, crashClaim)
	}
	return got
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

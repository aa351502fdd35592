package main

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// demoTestTTL is the demo's TTL in the tests: its default, three times
// longer on a slow machine (an emulated CPU), where the other tests'
// load can hold a renewal back for over a second.
var demoTestTTL = demoTTL * time.Duration(min(scale, 3))

func TestDemo(t *testing.T) {
	t.Parallel()
	t.Run("runs end to end by itself, with the delays it measured", func(t *testing.T) {
		r := runCoord(t, "demo", "--ttl", demoTestTTL.String())
		t.Logf("coord demo (%v):\n%s", r.took, r.stdout)
		if r.code != exitOK || r.stderr != "" {
			t.Fatalf("status %d, stderr %q", r.code, r.stderr)
		}
		if r.took > 20*time.Second*scale {
			t.Errorf("took %v", r.took)
		}
		checkDemoLines(t, r.stdout)
		checkDemoTokens(t, r.stdout)
		slow := int(scale) // upper bounds stretch on slow machines
		bounds := demoBounds(checkDemoShards(t, r.stdout, slow), slow)
		delays := demoDelays(r.stdout)
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

	t.Run("with --endpoints, the acts run against that etcd", func(t *testing.T) {
		_, ep, cli := newEtcd(t)
		r := runCoord(t, "demo", "--ttl", demoTestTTL.String(), "--endpoints", ep)
		if r.code != exitOK || r.stderr != "" {
			t.Fatalf("status %d, stderr %q\n%s", r.code, r.stderr, r.stdout)
		}
		if !strings.Contains(r.stdout, "on the etcd at "+ep+": ") {
			t.Fatalf("the demo does not say it runs on %s:\n%s", ep, r.stdout)
		}
		checkDemoLines(t, r.stdout)
		checkDemoTokens(t, r.stdout)
		// Its fleet was that etcd's: it wrote there.
		resp, err := cli.Get(tctx(t), "/")
		if err != nil {
			t.Fatal(err)
		}
		if rev := resp.Header.Revision; rev < 50 {
			t.Fatalf("the etcd the demo ran on is at revision %d: it did not run there", rev)
		}
	})

	t.Run("Ctrl-C ends it early and cleanly", func(t *testing.T) {
		d := startCoord(t, "demo", "--ttl", demoTestTTL.String())
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

// checkDemoLines checks that every line of the demo's output but the
// summary's rows has a timestamp, and that each act said what it should.
func checkDemoLines(t *testing.T, out string) {
	t.Helper()
	stamp := regexp.MustCompile(`^\d\d:\d\d:\d\d\.\d{3}  `)
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if !stamp.MatchString(line) && !strings.HasSuffix(line, " ms") {
			t.Errorf("line without a timestamp: %q", line)
		}
	}
	for _, want := range []string{
		"up   node-1", "up   node-4",
		"node-1   leads /coord/elections/scheduler",
		": etcd's revision of the leader key, rising with each leader",
		"a lease counts its TTL from its last renewal, which came before the crash",
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
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

// demoDelays returns the summary's rows: what was measured, in ms.
func demoDelays(out string) map[string]int {
	delays := map[string]int{}
	row := regexp.MustCompile(`^\s+(\S.*\S)\s+(\d+) ms$`)
	for _, line := range strings.Split(out, "\n") {
		if m := row.FindStringSubmatch(line); m != nil {
			delays[m[1]], _ = strconv.Atoi(m[2])
		}
	}
	return delays
}

// demoBounds returns the rows the summary should have, each with the
// bounds of its delay in ms, given what the ShardSet act claimed.
func demoBounds(shards demoShardClaims, slow int) map[string][2]int {
	// A crash is noticed once the lease expires: after at least about
	// two thirds of the TTL (the last renewal), well before 10 s.
	// A Stop is noticed at once.
	half := int(demoTestTTL.Milliseconds() / 2)
	bounds := map[string][2]int{
		"node-4 crash -> Down seen by the watcher":          {half, 10000 * slow},
		"node-1 (leader) crash -> Down seen by the watcher": {half, 10000 * slow},
		"node-1 (leader) crash -> node-2 leads":             {half, 10000 * slow},
		"node-3 Stop -> Down seen by the watcher":           {0, 1000 * slow},
	}
	// A handover is Run's drain (none here) plus a few round trips;
	// a crash is noticed once the leases expire, as above.
	if shards.joinMoved > 0 {
		bounds["node-8 joins -> a moved shard owned again, longest gap"] = [2]int{0, 1000 * slow}
	}
	bounds[shards.leaver+" Drain -> returns, owning nothing"] = [2]int{0, 3000 * slow}
	if shards.drainMoved > 0 {
		bounds[shards.leaver+" Drain -> a shard without an owner, longest"] = [2]int{0, 1000 * slow}
	}
	for _, which := range []string{"first", "last"} {
		bounds[shards.victim+" crash -> its shards owned again, "+which] = [2]int{half, 10000 * slow}
	}
	// A holder whose client goes ends its permit at once; its slot is
	// free once its session expires.
	bounds["node-9 (holder) crash -> its permit ends (Done)"] = [2]int{0, 1000 * slow}
	bounds["node-9 (holder) crash -> node-11 holds its permit"] = [2]int{half, 10000 * slow}
	bounds["node-10 Release -> node-12 holds its permit"] = [2]int{0, 1000 * slow}
	return bounds
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

const demoStamp = `^\d\d:\d\d:\d\d\.\d{3}  `

var (
	demoOwns     = regexp.MustCompile(demoStamp + `(node-\d)   owns\s+(\d+):((?: shard-\d\d)*)$`)
	demoJoinMove = regexp.MustCompile(demoStamp + `shards   (shard-\d\d): (node-\d) -> (node-\d), owned again (\d+) ms after (node-\d) let go$`)
	demoJoined   = regexp.MustCompile(demoStamp + `shards   join: (?:(\d+) of 12 shards moved, all to node-8; the other (\d+) stayed put|node-8 ranks first for none of the 12 shards: none moved)$`)
	demoLeaves   = regexp.MustCompile(demoStamp + `demo     --- (node-\d), owning (\d+) shards, leaves for a planned restart`)
	demoDrainMv  = regexp.MustCompile(demoStamp + `shards   (shard-\d\d): (node-\d) -> (node-\d), handed over: owned again (\d+) ms after (node-\d) released it$`)
	demoCrashes  = regexp.MustCompile(demoStamp + `demo     --- (node-\d), owning (\d+) shards, crashes`)
	demoCrashMv  = regexp.MustCompile(demoStamp + `shards   (shard-\d\d): (node-\d) -> (node-\d), owned again (\d+) ms after the crash$`)
	demoCrashed  = regexp.MustCompile(demoStamp + `shards   crash: the (\d+) shards (node-\d) owned moved to their standbys; no other shard moved$`)
)

// demoShardLog is the ShardSet act of the demo's output, as read so far.
type demoShardLog struct {
	got       demoShardClaims
	listings  []map[string]string // the owners, as each run of "owns" lines shows them
	inListing bool
	// The shards each step said moved.
	joinMoved, drainMoved, crashMoved map[string]bool
	// The shards the leaver and the victim were said to own, and the
	// victim to have moved.
	leaverOwned, victimOwned, crashClaim int
}

// owners reads line if it is one of a listing of the owners.
func (l *demoShardLog) owners(t *testing.T, line string) {
	t.Helper()
	m := demoOwns.FindStringSubmatch(line)
	if m == nil {
		l.inListing = false
		return
	}
	if !l.inListing {
		l.listings = append(l.listings, map[string]string{})
		l.inListing = true
	}
	names := strings.Fields(m[3])
	if n := atoi(m[2]); n != len(names) {
		t.Errorf("%q: says %d shards, lists %d", line, n, len(names))
	}
	cur := l.listings[len(l.listings)-1]
	for _, s := range names {
		if cur[s] != "" {
			t.Errorf("%s listed as owned by %s and %s", s, cur[s], m[1])
		}
		cur[s] = m[1]
	}
}

// step reads line if it tells of the join, the drain or the crash.
func (l *demoShardLog) step(t *testing.T, line string, slow int) {
	t.Helper()
	if m := demoJoinMove.FindStringSubmatch(line); m != nil {
		if m[3] != "node-8" || m[2] != m[5] || atoi(m[4]) > 1000*slow {
			t.Errorf("join move %q: want to node-8, from the host that let go, within %d ms", line, 1000*slow)
		}
		l.joinMoved[m[1]] = true
	} else if m := demoJoined.FindStringSubmatch(line); m != nil {
		n := atoi(m[1])
		if m[1] != "" && (n == 0 || n+atoi(m[2]) != 12) {
			t.Errorf("%q does not add up", line)
		}
		if n != len(l.joinMoved) {
			t.Errorf("%q, but %d moves printed", line, len(l.joinMoved))
		}
		l.got.joinMoved = n
	} else if m := demoLeaves.FindStringSubmatch(line); m != nil {
		l.got.leaver, l.leaverOwned = m[1], atoi(m[2])
	} else if m := demoDrainMv.FindStringSubmatch(line); m != nil {
		if m[2] != l.got.leaver || m[5] != l.got.leaver || m[3] == l.got.leaver || atoi(m[4]) > 1000*slow {
			t.Errorf("drain move %q: want from %s to another host, within %d ms", line, l.got.leaver, 1000*slow)
		}
		l.drainMoved[m[1]] = true
	} else if m := demoCrashes.FindStringSubmatch(line); m != nil {
		l.got.victim, l.victimOwned = m[1], atoi(m[2])
	} else if m := demoCrashMv.FindStringSubmatch(line); m != nil {
		if ms := atoi(m[4]); m[2] != l.got.victim || m[3] == l.got.victim || ms < 1000 || ms > 10000*slow {
			t.Errorf("crash move %q: want from %s to another host, within [1000, %d] ms", line, l.got.victim, 10000*slow)
		}
		l.crashMoved[m[1]] = true
	} else if m := demoCrashed.FindStringSubmatch(line); m != nil {
		l.crashClaim = atoi(m[1])
		if m[2] != l.got.victim {
			t.Errorf("%q: %s crashed", line, l.got.victim)
		}
	}
}

// checkDemoShards checks that the ShardSet act of the demo's output holds
// together: each listing of the owners places every shard once; the join
// moved only to node-8, as many shards as it says, each owned again
// quickly; the drain moved exactly the shards the leaver owned, each to
// another agent, quickly; the crash moved exactly the shards the victim
// owned, each to another agent, once its leases expired.
func checkDemoShards(t *testing.T, out string, slow int) demoShardClaims {
	t.Helper()
	l := &demoShardLog{joinMoved: map[string]bool{}, drainMoved: map[string]bool{}, crashMoved: map[string]bool{},
		leaverOwned: -1, victimOwned: -1, crashClaim: -1}
	for _, line := range strings.Split(out, "\n") {
		l.owners(t, line)
		l.step(t, line, slow)
	}
	if len(l.listings) != 4 {
		t.Fatalf("%d listings of the owners, want 4 (3 hosts, the join, the drain, the crash)", len(l.listings))
	}
	for i, owners := range l.listings {
		if len(owners) != 12 {
			t.Errorf("listing %d places %d shards, want 12", i+1, len(owners))
		}
	}
	for s, o := range l.listings[1] {
		if before := l.listings[0][s]; (before != o) != l.joinMoved[s] || l.joinMoved[s] && o != "node-8" {
			t.Errorf("join: %s went from %s to %s, moves printed: %v", s, before, o, l.joinMoved)
		}
	}
	drained := checkDemoLeft(t, "drain", l.got.leaver, l.listings[1], l.listings[2], l.drainMoved)
	if l.got.leaver == "" || drained != l.leaverOwned {
		t.Errorf("drain of %q: owned %d shards, said to own %d", l.got.leaver, drained, l.leaverOwned)
	}
	l.got.drainMoved = len(l.drainMoved)
	owned := checkDemoLeft(t, "crash", l.got.victim, l.listings[2], l.listings[3], l.crashMoved)
	if l.got.victim == "" || owned == 0 || owned != l.victimOwned || owned != l.crashClaim {
		t.Errorf("crash of %q: owned %d shards, said to own %d, said to have moved %d", l.got.victim, owned, l.victimOwned, l.crashClaim)
	}
	return l.got
}

// checkDemoLeft checks that, from the owners before to after, exactly the
// shards gone owned moved, each to another agent, as the moves printed
// say. It returns how many shards gone owned before.
func checkDemoLeft(t *testing.T, how, gone string, before, after map[string]string, moved map[string]bool) int {
	t.Helper()
	owned := 0
	for s, o := range after {
		b := before[s]
		if b == gone {
			owned++
		}
		if (b != o) != (b == gone) || o == gone || moved[s] != (b == gone) {
			t.Errorf("%s of %s: %s went from %s to %s, moves printed: %v", how, gone, s, b, o, moved)
		}
	}
	return owned
}

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

package coord

// The compatibility suite: each primitive's main promises, through the
// public API, on whatever etcd it is given: the embedded server, or the
// etcd binary named by COORD_TEST_ETCD (coordtest.NewEtcd), of any
// version. CI runs it on every etcd version it supports (.ci/compat) and
// makes a table of the results and of the figures each promise logs on a
// line of its own, prefixed by compatTag:
//
//	compat: PROMISE NAME=VALUE ...
//
//	go test -count=1 -run TestCompat .                              # embedded
//	COORD_TEST_ETCD=/usr/bin/etcd go test -count=1 -run TestCompat -v .

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/coordtest"
)

// compatTag starts the log lines that carry a figure of the suite.
const compatTag = "compat:"

// compatFigures logs the figures of a promise on one line, NAME=VALUE
// pairs given in order, for the CI's table.
func compatFigures(t *testing.T, promise string, kv ...any) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", compatTag, promise)
	for i := 0; i+1 < len(kv); i += 2 {
		v := kv[i+1]
		if d, ok := v.(time.Duration); ok {
			v = compatDur(d)
		}
		fmt.Fprintf(&b, " %v=%v", kv[i], v)
	}
	t.Log(b.String())
}

// compatDur is d as the table shows it: seconds, to the millisecond.
func compatDur(d time.Duration) string { return fmt.Sprintf("%.3fs", d.Seconds()) }

// compatEtcd starts the etcd of the suite for a test: a process of
// COORD_TEST_ETCD's binary, else the embedded server.
func compatEtcd(t *testing.T) coordtest.Etcd {
	t.Helper()
	return coordtest.NewEtcd(t, coordtest.Config{})
}

// compatTTL is the TTL of the suite's leases: 2 s, stretched on slow
// machines.
func compatTTL() time.Duration { return 2 * time.Second * scale }

// compatSlack is how late, past its bound, a measured time may come: the
// expiry checks of etcd (every 500 ms) and the scheduling of a loaded
// machine.
func compatSlack() time.Duration { return 1500 * time.Millisecond * scale }

// compatHost is a host of the suite: its own link to etcd through a proxy,
// so that it can crash (see crash), and its registration.
type compatHost struct {
	id   string
	px   *coordtest.Proxy
	cli  *clientv3.Client
	live *HostLiveness
}

// compatRegister registers id with ttl on a client of its own, through a
// proxy of its own in front of etcd.
func compatRegister(t *testing.T, e interface {
	NewProxy(testing.TB) *coordtest.Proxy
}, id string, ttl time.Duration) *compatHost {
	t.Helper()
	h := &compatHost{id: id, px: e.NewProxy(t)}
	h.cli = h.px.NewClient(t)
	h.live = register(t, h.cli, id, LivenessOptions{TTL: ttl})
	return h
}

// crash makes h crash: nothing of it reaches etcd from now on, where its
// lease runs out, and its client is closed. It returns when.
func (h *compatHost) crash() time.Time {
	h.px.Blackhole()
	at := time.Now()
	h.cli.Close()
	return at
}

// compatNext waits for the next event of r about id from position i on of
// kind, and returns when it was received.
func compatNext(t *testing.T, r *fcRecorder, i int, kind HostEventKind, id string) time.Time {
	t.Helper()
	var at time.Time
	r.until(t, fmt.Sprintf("%v of %s", kind, id), func(evs []HostEvent) bool {
		for j := i; j < len(evs); j++ {
			if evs[j].Kind == kind && evs[j].HostUUID == id {
				at = r.times[j] // r.mu is held while cond runs
				return true
			}
		}
		return false
	})
	return at
}

// compatWithin fails the test if d exceeds bound by more than the slack.
func compatWithin(t *testing.T, what string, d, bound time.Duration) {
	t.Helper()
	if d > bound+compatSlack() {
		t.Errorf("%s took %v, want at most %v (+%v slack)", what, d, bound, compatSlack())
	}
}

// TestCompat and its promises run in parallel with the other long tests
// (see "Parallel tests" in helpers_test.go): each has an etcd of its own
// and waits mostly on its leases. .ci/compat runs them one at a time
// (-parallel 1), so that the figures it tabulates are not those of a
// loaded machine.
func TestCompat(t *testing.T) {
	t.Parallel()
	for _, p := range []struct {
		name string
		test func(*testing.T)
	}{
		{"liveness", testCompatLiveness},
		{"watcher", testCompatWatcher},
		{"election", testCompatElection},
		{"pool", testCompatPool},
		{"shardset", testCompatShardSet},
		{"semaphore", testCompatSemaphore},
		{"short-cuts", testCompatShortCuts},
		{"host lease", testCompatHostLease},
	} {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel()
			p.test(t)
		})
	}
}

// testCompatHostLease: a pool's elections and a semaphore's permits ride
// a host's registration lease: etcd holds that one lease; Close deletes
// their keys (nested transactions, one conditional delete each), and the
// lease and the host key live on.
func testCompatHostLease(t *testing.T) {
	e := compatEtcd(t)
	cli := e.Client()
	a := compatRegister(t, e, "a", compatTTL())
	lease := a.live.LeaseID()
	p := ptPool(t, a.cli, PoolOptions{Host: a.live})
	for _, k := range ptKeys(3) {
		etCampaign(t, ptElection(t, p, k), "a")
	}
	sem, err := NewSemaphore(testCtx(t), a.cli, SemaphoreOptions{Key: "/compat/host-lease", Limit: 2, Host: a.live})
	if err != nil {
		t.Fatal(err)
	}
	defer sem.Close()
	if _, err := sem.Acquire(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if got := ptLeases(t, cli); !slices.Equal(got, []clientv3.LeaseID{lease}) {
		t.Fatalf("etcd holds leases %v, want only the registration's %x", got, lease)
	}
	p.Close()
	sem.Close()
	left := keyCount(t, cli, etKey) + keyCount(t, cli, "/compat/host-lease/")
	if left != 0 || a.live.LeaseID() != lease || len(truth(t, cli, HostsPrefix)) != 1 {
		t.Fatalf("after Close: %d keys left, registration on lease %x (was %x), hosts %v; want none, the same lease, a",
			left, a.live.LeaseID(), lease, truth(t, cli, HostsPrefix))
	}
	compatFigures(t, "host lease", "leases", 1, "keys-left", left)
}

// testCompatShortCuts: a leader cut off for 0.6 of the TTL, twice, keeps
// its leadership and token (see TestElectionShortCuts).
func testCompatShortCuts(t *testing.T) {
	ttl := compatTTL()
	stepDowns, p50, worst := shortCuts(t, compatEtcd(t), 2, ttl)
	compatFigures(t, "short-cuts", "ttl", ttl, "cuts", 2, "stepped-down", stepDowns,
		"led-again-p50", p50, "led-again-max", worst)
}

// testCompatLiveness: a registration is seen Up; it heals when its lease
// is revoked behind its back; Stop is seen Down at once; a crashed host is
// seen Down once its TTL has run out.
func testCompatLiveness(t *testing.T) {
	e := compatEtcd(t)
	cli, ttl, prefix := e.Client(), compatTTL(), HostsPrefix
	r := fcWatch(t, cli, WatcherOptions{})
	a := compatRegister(t, e, "a", ttl)
	compatNext(t, r, 0, HostUp, "a")
	if got := a.live.TTL(); got != ttl {
		t.Errorf("TTL() = %v, want %v", got, ttl)
	}

	// Heal: the lease revoked by another agent; a new lease, Down then Up.
	old, mark := a.live.LeaseID(), r.len()
	revoked := time.Now()
	etRevoke(t, cli, old)
	compatNext(t, r, mark, HostDown, "a")
	healTook := compatNext(t, r, mark, HostUp, "a").Sub(revoked)
	// Up is seen once etcd holds the new key, maybe just before the
	// registration records its lease.
	eventually(t, "a new lease", func() bool { return a.live.LeaseID() != old })

	// Stop: Down at once.
	mark = r.len()
	stopped := time.Now()
	if err := a.live.Stop(testCtx(t)); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	stopTook := compatNext(t, r, mark, HostDown, "a").Sub(stopped)
	compatWithin(t, "Stop → Down", stopTook, 0)

	// Crash: Down within the TTL.
	b := compatRegister(t, e, "b", ttl)
	compatNext(t, r, mark, HostUp, "b")
	mark = r.len()
	crashed := b.crash()
	crashTook := compatNext(t, r, mark, HostDown, "b").Sub(crashed)
	compatWithin(t, "crash → Down", crashTook, ttl)
	if n := keyCount(t, cli, prefix); n != 0 {
		t.Errorf("%d host keys left, want none", n)
	}
	compatFigures(t, "liveness", "ttl", ttl, "heal", healTook, "stop→down", stopTook, "crash→down", crashTook)
}

// testCompatWatcher: the snapshot is one synthetic Up per host, then
// Synced; after a compaction that removed the events the watcher missed,
// and after an etcd restart, it emits only the differences and its replica
// matches etcd.
func testCompatWatcher(t *testing.T) {
	e := compatEtcd(t)
	cli, ctx, prefix := e.Client(), testCtx(t), prefixFor(t)
	lease := wtGrant(t, cli)
	wtPutAll(t, cli, prefix, lease, "keep", "gone", "upd")
	px := e.NewProxy(t)
	w := wtWatch(t, ctx, px.NewClient(t), WatcherOptions{Prefix: prefix})
	r := newWtReplica(t)
	for range 3 {
		ev := next(t, w)
		if !ev.Synthetic || ev.Kind != HostUp {
			t.Fatalf("snapshot event %+v, want a synthetic Up", ev)
		}
		r.apply(ev)
	}
	waitClosed(t, w.Synced(), "Synced")
	r.matches(cli, prefix)

	// Missed changes, then a compaction of their history: the watch
	// cannot resume, the watcher lists again (see TestHostWatcherFaults).
	px.Blackhole()
	wtPut(t, cli, prefix, meta("new"), lease)
	if _, err := cli.Delete(ctx, prefix+"gone"); err != nil {
		t.Fatal(err)
	}
	upd := meta("upd")
	upd.Version = "2.0"
	wtPut(t, cli, prefix, upd, lease)
	rev := e.Compact(ctx)
	e.Stop()
	px.Unblackhole()
	cut := time.Now()
	e.Restart()
	for range 3 {
		ev := next(t, w)
		if !ev.Synthetic || ev.Revision != rev {
			t.Fatalf("resync event %+v, want synthetic at revision %d", ev, rev)
		}
		r.apply(ev)
	}
	resyncTook := time.Since(cut)
	quiet(t, cli, w, prefix)
	r.matches(cli, prefix)

	// A restart with nothing missed: the watch resumes, no resync.
	e.Stop()
	restarted := time.Now()
	e.Restart()
	put := wtPut(t, cli, prefix, meta("after"), lease)
	ev := next(t, w)
	r.apply(ev)
	wtCheck(t, ev, meta("after"), put, false)
	resumeTook := time.Since(restarted)
	r.matches(cli, prefix)
	wtNoErr(t, w)
	compatFigures(t, "watcher", "resync-after-compaction", resyncTook, "resume-after-restart", resumeTook)
}

// testCompatElection: a leader cut off from etcd steps down before its
// successor wins; tokens increase; the old leader's Guard no longer holds
// and the new one's does.
func testCompatElection(t *testing.T) {
	e := compatEtcd(t)
	cli, ttl := e.Client(), compatTTL()
	px := e.NewProxy(t)
	a := etElection(t, px.NewClient(t), ElectionOptions{TTL: ttl})
	b := etElection(t, e.NewClient(t), ElectionOptions{TTL: ttl})
	t.Cleanup(px.Unblackhole) // before a's Close: its resign then gets through
	etCampaign(t, a, "a")
	res := etQueue(t, testCtx(t), cli, b)
	if got, err := b.Leader(testCtx(t)); err != nil || got != "a" {
		t.Fatalf("Leader() = %q, %v; want a", got, err)
	}
	aToken, aGuard := a.Token(), a.Guard()

	px.Blackhole()
	cut := time.Now()
	waitClosed(t, a.Done(), "Done of the leader cut off")
	stepped := time.Now()
	won := etWait(t, res)
	if won.err != nil || !b.IsLeader() {
		t.Fatalf("successor's Campaign: %v, IsLeader %v", won.err, b.IsLeader())
	}
	if !stepped.Before(won.at) {
		t.Errorf("the old leader stepped down %v after the successor won", stepped.Sub(won.at))
	}
	if b.Token() <= aToken {
		t.Errorf("successor's token %d, not above %d", b.Token(), aToken)
	}
	if etGuarded(t, cli, aGuard) {
		t.Error("the old leader's Guard still holds")
	}
	if !etGuarded(t, cli, b.Guard()) {
		t.Error("the new leader's Guard does not hold")
	}
	compatWithin(t, "step-down", stepped.Sub(cut), 2*ttl/3)
	compatFigures(t, "election", "ttl", ttl, "stepdown", stepped.Sub(cut), "successor", won.at.Sub(cut),
		"margin", won.at.Sub(stepped))
}

// testCompatPool: the pool's elections share sessions, KeysPerSession per
// lease; closing the pool hands every key to the standbys of another pool.
func testCompatPool(t *testing.T) {
	e := compatEtcd(t)
	cli := e.Client()
	keys := ptKeys(5)
	p := ptPool(t, e.NewClient(t), PoolOptions{TTL: compatTTL(), KeysPerSession: 2})
	for _, k := range keys {
		etCampaign(t, ptElection(t, p, k), "p")
	}
	ptStats(t, p, PoolStats{Elections: 5, Sessions: 3, Leading: 5, TTL: compatTTL()})
	if n := len(ptLeases(t, cli)); n != 3 {
		t.Fatalf("%d leases in etcd, want the pool's 3", n)
	}
	q := ptPool(t, e.NewClient(t), PoolOptions{TTL: compatTTL(), KeysPerSession: 2})
	var waiting []<-chan etResult
	for _, k := range keys {
		waiting = append(waiting, etCampaignAsync(testCtx(t), ptElection(t, q, k), "q"))
	}
	for _, k := range keys {
		etWaitCount(t, cli, k+"/", 2, clientv3.WithPrefix())
	}
	closed := time.Now()
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	var last time.Time
	for _, w := range waiting {
		r := etWait(t, w)
		if r.err != nil {
			t.Fatalf("standby's Campaign: %v", r.err)
		}
		if r.at.After(last) {
			last = r.at
		}
	}
	ptStats(t, q, PoolStats{Elections: 5, Sessions: 3, Leading: 5, TTL: compatTTL()})
	if n := len(ptLeases(t, cli)); n != 3 {
		t.Fatalf("%d leases in etcd after Close, want the other pool's 3", n)
	}
	compatWithin(t, "handover after Close", last.Sub(closed), 0)
	compatFigures(t, "pool", "keys", len(keys), "sessions", 3, "handover", last.Sub(closed))
}

// testCompatShardSet: the shards spread over the members as ranked; when
// a member crashes its shards move to the next in rank; the fenced writes
// of the Runs never overlap.
func testCompatShardSet(t *testing.T) {
	compatShardSet(t, compatEtcd(t), "shardset", nil)
}

// compatShardSet is testCompatShardSet on e, each member's host watch on
// a client of watches' if set; it reports the figures as promise.
func compatShardSet(t *testing.T, e coordtest.Etcd, promise string, watches func(testing.TB) *clientv3.Client) {
	cli, ttl := e.Client(), compatTTL()
	l, shards := newShLedger(), shNames(8)
	var hosts []*shHost
	for _, id := range shIDs(3) {
		h := compatRegister(t, e, id, ttl)
		hosts = append(hosts, &shHost{id: id, px: h.px, cli: h.cli, live: h.live})
	}
	opts := ShardOptions{Shards: shards, TTL: ttl}
	for _, h := range hosts {
		o := opts
		o.Run = l.writer(h.cli, h.id)
		if watches != nil {
			o.WatchClient = watches(t)
		}
		h.start(t, l, o)
	}
	owners := shSettle(t, l, shards, hosts, hosts)
	for _, h := range hosts {
		if slices.Contains(slices.Collect(maps.Values(owners)), h.id) {
			l.waitWrites(t, h.id, l.writesOf(h.id), 1)
		}
	}

	// The crashed member's shards move to the next in rank, in about a TTL.
	gone := hosts[0]
	var moved []string
	for s, o := range owners {
		if o == gone.id {
			moved = append(moved, s)
		}
	}
	gone.crash()
	crashed := time.Now()
	after := shSettle(t, l, shards, hosts[1:], hosts[1:])
	settled := time.Since(crashed)
	for _, s := range moved {
		l.waitWrites(t, after[s], l.writesOf(after[s]), 1)
	}
	overlaps, handoffs := shCheck(shHistory(t, cli))
	if overlaps != 0 {
		t.Errorf("%d fenced writes overlap another owner's", overlaps)
	}
	if handoffs < len(moved) {
		t.Errorf("%d handoffs in the writes, want at least the %d shards moved", handoffs, len(moved))
	}
	compatWithin(t, "handoff after a crash", settled, 2*ttl)
	compatFigures(t, promise, "shards", len(shards), "members", len(hosts), "moved", len(moved),
		"crash→reowned", settled, "writes", len(l.acked()), "overlaps", overlaps)
}

// testCompatSemaphore: Limit 2 permits are held at once, fleet-wide; a
// holder cut off from etcd steps down before a waiter takes its place;
// tokens increase; the old holder's Guard no longer holds and the new
// one's does; a Release hands its permit to the next in line at once.
func testCompatSemaphore(t *testing.T) {
	e := compatEtcd(t)
	cli, ttl := e.Client(), compatTTL()
	px := e.NewProxy(t)
	t.Cleanup(px.Unblackhole) // before a's Close: its release then gets through
	opts := func(id string) SemaphoreOptions { return SemaphoreOptions{Limit: 2, TTL: ttl, Identity: id} }
	a := smSemaphore(t, px.NewClient(t), opts("a"))
	b := smSemaphore(t, e.NewClient(t), opts("b"))
	c := smSemaphore(t, e.NewClient(t), opts("c"))
	d := smSemaphore(t, e.NewClient(t), opts("d"))
	pa, pb := smAcquire(t, a), smAcquire(t, b)
	res := smQueue(t, testCtx(t), cli, c, 3)
	smWaiting(t, res)
	if hs, err := d.Holders(testCtx(t)); err != nil || len(hs) != 2 {
		t.Fatalf("Holders() = %v, %v; want a's and b's", hs, err)
	}
	aGuard := pa.Guard()

	px.Blackhole()
	cut := time.Now()
	waitClosed(t, pa.Done(), "Done of the holder cut off")
	stepped := time.Now()
	got := smGot(t, res)
	if !stepped.Before(got.at) {
		t.Errorf("the old holder stepped down %v after the waiter acquired", stepped.Sub(got.at))
	}
	if got.p.Token() <= max(pa.Token(), pb.Token()) {
		t.Errorf("the waiter's token %d, not above %d and %d", got.p.Token(), pa.Token(), pb.Token())
	}
	if etGuarded(t, cli, aGuard) {
		t.Error("the old holder's Guard still holds")
	}
	if !etGuarded(t, cli, got.p.Guard()) || !etGuarded(t, cli, pb.Guard()) {
		t.Error("a holder's Guard does not hold")
	}

	// A Release: the next in line holds at once.
	next := smQueue(t, testCtx(t), cli, d, 3)
	smWaiting(t, next)
	released := time.Now()
	smRelease(t, cli, pb)
	handover := smGot(t, next).at.Sub(released)
	compatWithin(t, "handover after a Release", handover, 0)
	if hs, err := d.Holders(testCtx(t)); err != nil || len(hs) != 2 {
		t.Fatalf("Holders() = %v, %v; want c's and d's", hs, err)
	}
	compatWithin(t, "step-down", stepped.Sub(cut), 2*ttl/3)
	compatFigures(t, "semaphore", "limit", 2, "ttl", ttl, "stepdown", stepped.Sub(cut), "successor", got.at.Sub(cut),
		"handover", handover)
}

// compatBinary is the etcd binary of the suite, "" for the embedded server.
func compatBinary() string { return os.Getenv(coordtest.EtcdEnv) }

// compatCluster is a three-member etcd of the suite: processes of
// COORD_TEST_ETCD's binary, else an embedded Cluster.
type compatCluster struct {
	cli     *clientv3.Client
	cfg     clientv3.Config // with every member's endpoint
	members []interface {
		NewProxy(testing.TB) *coordtest.Proxy
		NewClient(testing.TB) *clientv3.Client
		Endpoint() string
		Stop()
	}
}

// newClient returns a client of every member, closed at the end of the
// test: it fails over when the one it talks to stops.
func (c *compatCluster) newClient(t *testing.T) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(c.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

func newCompatCluster(t *testing.T, cfg coordtest.Config) *compatCluster {
	t.Helper()
	c := &compatCluster{}
	if bin := compatBinary(); bin != "" {
		pc := coordtest.NewProcessCluster(t, bin, 3, cfg)
		c.cli, c.cfg = pc.Client(), pc.ClientConfig()
		for _, m := range pc.Members() {
			c.members = append(c.members, m)
		}
		return c
	}
	ec := coordtest.NewClusterWith(t, 3, cfg)
	c.cli, c.cfg = ec.Client(), ec.ClientConfig()
	for _, m := range ec.Members() {
		c.members = append(c.members, m)
	}
	return c
}

// leader returns the index of the member that leads and its ID, as the
// members' status says.
func (c *compatCluster) leader(t *testing.T) (int, uint64) {
	t.Helper()
	var (
		i    int
		lead uint64
	)
	eventually(t, "a leader", func() bool {
		i, lead = c.leaderNow(testCtx(t), -1)
		return lead != 0
	})
	return i, lead
}

// leaderNow returns the index and the ID of the member a majority of the
// members report as their leader, 0 and 0 if there is none; the member
// of index down (-1: none) is not asked.
func (c *compatCluster) leaderNow(ctx context.Context, down int) (int, uint64) {
	ids := make([]uint64, len(c.members))
	votes := map[uint64]int{}
	for i, m := range c.members {
		if i == down {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		st, err := c.cli.Status(sctx, m.Endpoint())
		cancel()
		if err == nil {
			ids[i] = st.Header.MemberId
			votes[st.Leader]++
		}
	}
	for id, n := range votes {
		if id != 0 && n > len(c.members)/2 {
			return slices.Index(ids, id), id
		}
	}
	return 0, 0
}

// moveLeader hands etcd's leadership from the leader to another member
// (through the maintenance API) and waits until it leads.
func (c *compatCluster) moveLeader(t *testing.T) {
	t.Helper()
	from, _ := c.leader(t)
	to := (from + 1) % len(c.members)
	ctx := testCtx(t)
	st, err := c.cli.Status(ctx, c.members[to].Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.members[from].NewClient(t).MoveLeader(ctx, st.Header.MemberId); err != nil {
		t.Fatalf("MoveLeader: %v", err)
	}
	eventually(t, "the new leader", func() bool {
		i, _ := c.leader(t)
		return i == to
	})
}

// TestCompatLeaderChange: on a three-member etcd, a host crashes and etcd's
// leadership moves just before its lease would expire. The new leader
// grants every lease its full TTL again (unless lease checkpointing is on
// and the lease is long enough to be checkpointed, over 5 minutes): the
// crashed host is seen Down up to two TTLs after the crash. Step-down
// safety holds either way: the leader cut off steps down within two thirds
// of the TTL, long before its successor can win.
func TestCompatLeaderChange(t *testing.T) {
	if scale > 1 {
		// Declared in .ci/skips: natively, the race stage and .ci/compat
		// run it on every etcd version.
		t.Skip("COORD_TEST_SCALE > 1 (an emulated CPU): three etcd processes under the emulator, with leases ten times longer, outlast the package's time budget")
	}
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	for _, cp := range []bool{false, true} {
		t.Run(fmt.Sprintf("checkpoint=%v", cp), func(t *testing.T) {
			t.Parallel()
			testCompatLeaderChange(t, cp)
		})
	}
}

func testCompatLeaderChange(t *testing.T, checkpoint bool) {
	ttl := 3 * time.Second * scale
	c := newCompatCluster(t, coordtest.Config{LeaseCheckpoint: checkpoint})
	r := fcWatch(t, c.cli, WatcherOptions{})
	h := compatRegister(t, c.members[0], "crashed", ttl)
	compatNext(t, r, 0, HostUp, "crashed")
	// The host's leader runs on a link of its own, which the crash cuts
	// too: closing its client would end the leadership at once.
	apx := c.members[0].NewProxy(t)
	a := etElection(t, apx.NewClient(t), ElectionOptions{TTL: ttl})
	b := etElection(t, c.members[1].NewClient(t), ElectionOptions{TTL: ttl})
	t.Cleanup(apx.Unblackhole) // before a's Close: its resign then gets through
	etCampaign(t, a, "a")
	res := etQueue(t, testCtx(t), c.cli, b)
	lease := h.live.LeaseID()

	// When the leader cut off steps down, whatever the test waits on then.
	steppedAt := make(chan time.Time, 1)
	go func() {
		<-a.Done() // at the latest at a's Close, when the test ends
		steppedAt <- time.Now()
	}()
	mark := r.len()
	apx.Blackhole()
	cut := h.crash()
	// The leadership moves once the crashed host's lease has a second or
	// less to live: polling etcd's view of the lease.
	for etTTL(t, c.cli, lease) > 1 {
		if time.Since(cut) > 2*ttl {
			t.Fatalf("the lease still has %d s to live %v after the crash", etTTL(t, c.cli, lease), time.Since(cut))
		}
		time.Sleep(20 * time.Millisecond)
	}
	remaining := etTTL(t, c.cli, lease)
	c.moveLeader(t)
	moved := time.Since(cut)
	after := etTTL(t, c.cli, lease)

	stepped := receive(t, steppedAt, "Done of the leader cut off").Sub(cut)
	down := compatNext(t, r, mark, HostDown, "crashed").Sub(cut)
	won := etWait(t, res)
	if won.err != nil || !b.IsLeader() {
		t.Fatalf("successor's Campaign: %v, IsLeader %v", won.err, b.IsLeader())
	}
	successor := won.at.Sub(cut)
	if stepped >= successor {
		t.Errorf("the old leader stepped down %v after the crash, its successor won at %v", stepped, successor)
	}
	compatWithin(t, "step-down", stepped, 2*ttl/3)
	compatWithin(t, "crash → Down across a leader change", down, 2*ttl)
	compatFigures(t, "leader-change", "ttl", ttl, "moved-at", moved,
		"ttl-before", fmt.Sprintf("%ds", remaining), "ttl-after", fmt.Sprintf("%ds", after),
		"crash→down", down, "stepdown", stepped, "successor", successor)
}

// TestCompatLeaderKill: on a three-member etcd, the etcd leader is killed
// (SIGKILL), as in every rolling upgrade. A term that steps down while raft
// elects a new leader (renewals unanswered for 2/3 of the TTL) resumes:
// etcd's new leader kept every lease, so no shard moves, no token changes,
// and an election's leader and a semaphore's holders keep theirs.
func TestCompatLeaderKill(t *testing.T) {
	if scale > 1 {
		// Declared in .ci/skips: natively, the race stage and .ci/compat
		// run it on every etcd version.
		t.Skip("COORD_TEST_SCALE > 1 (an emulated CPU): three etcd processes under the emulator, with leases ten times longer, outlast the package's time budget")
	}
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	// etcd's own timing (a 100 ms heartbeat, a 1 s election timeout):
	// raft takes over a second to elect a new leader, past the step-down
	// of every term (2/3 of the TTL after its last renewal answered).
	ttl := 2 * time.Second * scale
	c := newCompatCluster(t, coordtest.Config{TickMs: 100, ElectionMs: 1000})
	l, shards := newShLedger(), shNames(12)
	var hosts []*shHost
	for _, id := range shIDs(3) {
		h := &shHost{id: id, cli: c.newClient(t)}
		h.live = register(t, h.cli, id, LivenessOptions{TTL: ttl})
		hosts = append(hosts, h)
	}
	tap, log := newLogTap()
	tap.dumpOnFailure(t)
	for _, h := range hosts {
		h.start(t, l, ShardOptions{Shards: shards, TTL: ttl, Run: l.writer(h.cli, h.id), Logger: log.With("host", h.id)})
	}
	shSettle(t, l, shards, hosts, hosts)
	// The standbys in line too: the kill is of a fleet at rest (a candidate
	// put that etcd has not answered when its leader dies is sent again:
	// TestCandidacyPutUnanswered).
	shSettleCandidates(t, c.cli, shards, hosts, DefaultShardReplicas)
	type term struct {
		host  string
		token int64
	}
	owned := func() map[string]term {
		m := map[string]term{}
		for _, h := range hosts {
			for _, sh := range h.set.Owned() {
				m[sh.Name] = term{h.id, sh.Token}
			}
		}
		return m
	}
	before := owned()
	// A leader and two permit holders that take their term again after
	// each end, as an agent's loop does.
	e := etElection(t, hosts[0].cli, ElectionOptions{Key: "/compat/kill/leader", TTL: ttl})
	sems := []*Semaphore{
		smSemaphore(t, hosts[1].cli, SemaphoreOptions{Key: "/compat/kill/sem", Limit: 2, TTL: ttl, Identity: "b"}),
		smSemaphore(t, hosts[2].cli, SemaphoreOptions{Key: "/compat/kill/sem", Limit: 2, TTL: ttl, Identity: "c"}),
	}
	ctx, cancel := context.WithCancel(context.Background())
	var loops sync.WaitGroup
	t.Cleanup(func() { cancel(); loops.Wait() })
	var mu sync.Mutex
	tokens := map[string][]int64{} // by holder, each term's
	took := func(who string, token int64) {
		mu.Lock()
		defer mu.Unlock()
		tokens[who] = append(tokens[who], token)
	}
	loops.Go(func() {
		for ctx.Err() == nil {
			if e.Campaign(ctx, "a") == nil {
				took("leader", e.Token())
				select {
				case <-e.Done():
				case <-ctx.Done():
				}
			}
		}
	})
	for i, s := range sems {
		loops.Go(func() {
			for ctx.Err() == nil {
				if p, err := s.Acquire(ctx); err == nil {
					took(fmt.Sprintf("permit-%d", i), p.Token())
					select {
					case <-p.Done():
					case <-ctx.Done():
					}
				}
			}
		})
	}
	eventually(t, "a leader and two permits", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(tokens) == 3
	})

	lead, old := c.leader(t)
	at := must(c.cli.Get(testCtx(t), "/")).Header.Revision
	l.mu.Lock()
	mark := len(l.events)
	l.mu.Unlock()
	c.members[lead].Stop()
	killed := time.Now()
	// How long raft takes to elect a new leader, asked of the members
	// meanwhile: what coord adds is the rest.
	elected, pctx := make(chan time.Duration, 1), testCtx(t)
	go func() {
		for pctx.Err() == nil {
			if _, id := c.leaderNow(pctx, lead); id != 0 && id != old {
				elected <- time.Since(killed)
				return
			}
			time.Sleep(10 * time.Millisecond) // polling etcd's status
		}
	}()
	eventually(t, "every shard written again", func() bool {
		last := map[string]int64{}
		for _, w := range l.acked() {
			last[w.shard] = max(last[w.shard], w.rev)
		}
		for _, s := range shards {
			if last[s] <= at {
				return false
			}
		}
		return true
	})
	written := time.Since(killed)
	raft := receive(t, elected, "a new etcd leader")
	// A session whose last renewal was answered just before the kill may
	// step down after the first writes: its shards come back, same owner
	// and token, once etcd answers it.
	var after map[string]term
	eventually(t, "every shard owned again by its owner, with its token", func() bool {
		after = owned()
		return maps.Equal(after, before)
	})
	reowned := time.Since(killed)
	l.mu.Lock()
	stepped, moved := 0, 0
	for _, ev := range l.events[mark:] {
		switch {
		case ev.Kind == SignalShardReleased:
			stepped++
		case ev.Kind == SignalShardAcquired && before[ev.Shard] != term{ev.Host, ev.Token}:
			moved++
			t.Errorf("%s acquired %s with token %d after the kill; %v owned it before", ev.Host, ev.Shard, ev.Token, before[ev.Shard])
		}
	}
	l.mu.Unlock()
	mu.Lock()
	changed := 0
	for who, ts := range tokens {
		for _, tok := range ts[1:] {
			if tok != ts[0] {
				changed++
				t.Errorf("%s held with tokens %v", who, ts)
			}
		}
	}
	terms := tokens["leader"]
	mu.Unlock()
	compatFigures(t, "leader-kill", "ttl", ttl, "shards", len(shards), "stepped-down", stepped, "moved", moved,
		"raft-elected", raft, "written-again", written, "written-after-raft", written-raft, "owned-again", reowned, "leader-terms", len(terms), "tokens-changed", changed)
}

package coord

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// sigCase triggers a kind of signal through what it reports, against a
// real etcd, and returns the first signal of that kind received with
// the one the convention (see Signal) asks for.
type sigCase struct {
	kind    SignalKind
	trigger func(t *testing.T, s *signals) (got, want Signal)
}

// Which kinds the convention gives a Host, a term (Token and Identity),
// a Shard, and a cause (Err, in the faults the cases inject).
var (
	sigHostKinds = []SignalKind{SignalRegistered, SignalHealAttempt, SignalRegistrationEnded,
		SignalEventDelivered, SignalShardAcquired, SignalShardReleased}
	sigTermKinds = []SignalKind{SignalLeadershipGained, SignalLeadershipLost, SignalShardAcquired,
		SignalShardReleased, SignalPermitAcquired, SignalPermitReleased, SignalLeadershipResumed, SignalPermitResumed}
	sigShardKinds = []SignalKind{SignalShardAcquired, SignalShardReleased}
	sigEndKinds   = []SignalKind{SignalHealAttempt, SignalRegistrationEnded, SignalLeadershipLost,
		SignalShardReleased, SignalPermitReleased, SignalEtcdReplaced}
)

func TestSignalConvention(t *testing.T) {
	t.Parallel()
	cases := map[SignalKind]sigCase{}
	for _, c := range []sigCase{
		{SignalRegistered, sigRegistered}, {SignalHealAttempt, sigHealAttempt},
		{SignalRegistrationEnded, sigRegistrationEnded}, {SignalLeadershipGained, sigLeadershipGained},
		{SignalLeadershipLost, sigLeadershipLost}, {SignalWatcherResync, sigWatcherResync},
		{SignalEventDelivered, sigEventDelivered}, {SignalShardAcquired, sigShardAcquired},
		{SignalShardReleased, sigShardReleased}, {SignalWatcherListingCompacted, sigListingCompacted},
		{SignalPermitAcquired, sigPermitAcquired}, {SignalPermitReleased, sigPermitReleased},
		{SignalEtcdReplaced, sigEtcdReplaced}, {SignalLeadershipResumed, sigLeadershipResumed},
		{SignalPermitResumed, sigPermitResumed},
	} {
		cases[c.kind] = c
	}
	// Every kind there is (each has a name; the first without one ends
	// them) has a case: a new kind fails here until it is given one.
	var kinds []SignalKind
	for k := SignalKind(0); !strings.HasPrefix(k.String(), "SignalKind("); k++ {
		kinds = append(kinds, k)
	}
	if len(kinds) != len(cases) {
		t.Fatalf("%d signal kinds, %d cases", len(kinds), len(cases))
	}
	for _, k := range kinds {
		c, ok := cases[k]
		if !ok {
			t.Fatalf("signal kind %v has no case", k)
		}
		t.Run(k.String(), func(t *testing.T) {
			t.Parallel() // each case on its own etcd
			s := &signals{}
			got, want := c.trigger(t, s)
			sigCheck(t, k, got, want)
		})
	}
}

// sigCheck checks got against the convention for its kind, and against
// want field by field (Drain, a duration, aside); Err by errors.Is.
func sigCheck(t *testing.T, kind SignalKind, got, want Signal) {
	t.Helper()
	has := func(kinds []SignalKind) bool {
		for _, k := range kinds {
			if k == kind {
				return true
			}
		}
		return false
	}
	switch {
	case got.Kind != kind:
		t.Fatalf("kind %v, want %v", got.Kind, kind)
	case !strings.HasPrefix(got.Key, "/"):
		t.Fatalf("%+v: Key %q is not a full etcd key", got, got.Key)
	case has(sigHostKinds) != (got.Host != ""):
		t.Fatalf("%+v: Host %q, want one only on %v", got, got.Host, sigHostKinds)
	case has(sigTermKinds) != (got.Token > 0 && got.Identity != ""):
		t.Fatalf("%+v: a term's Token and Identity only on %v", got, sigTermKinds)
	case has(sigShardKinds) != (got.Shard != "") || got.Shard != "" && !strings.HasSuffix(got.Key, "/"+got.Shard):
		t.Fatalf("%+v: Shard %q, Key %q: want the name and its election key on %v", got, got.Shard, got.Key, sigShardKinds)
	case has(sigEndKinds) != (got.Err != nil):
		t.Fatalf("%+v: Err %v, want the cause only on %v", got, got.Err, sigEndKinds)
	}
	if want.Err == nil && got.Err != nil || want.Err != nil && !errors.Is(got.Err, want.Err) {
		t.Fatalf("Err %v, want %v", got.Err, want.Err)
	}
	got.Err, want.Err, got.Drain = nil, nil, 0
	if got != want {
		t.Fatalf("signal\n %+v, want\n %+v", got, want)
	}
}

func sigRegistered(t *testing.T, s *signals) (Signal, Signal) {
	_, cli := newEtcd(t)
	h := register(t, cli, "a", LivenessOptions{OnSignal: s.hook})
	return s.waitFor(t, SignalRegistered, 1), Signal{Kind: SignalRegistered, Key: h.Key(), Host: "a", Lease: h.LeaseID()}
}

// sigHealAttempt makes a heal's first attempt meet an etcd it cannot
// reach: the heal is held at the write slot until the host's link is
// cut, then let go.
func sigHealAttempt(t *testing.T, s *signals) (Signal, Signal) {
	srv, cli := newEtcd(t)
	px := srv.NewProxy(t)
	tap, log := newLogTap()
	tap.dumpOnFailure(t)
	h := register(t, px.NewClient(t), "a", LivenessOptions{Logger: log, OnSignal: s.hook})
	h.writes <- struct{}{}
	if _, err := cli.Delete(testCtx(t), h.Key()); err != nil {
		t.Fatal(err)
	}
	tap.wait(t, "coord: host registration lost, healing", 1)
	px.Blackhole()
	<-h.writes
	got := s.waitFor(t, SignalHealAttempt, 1)
	px.Unblackhole()
	s.waitFor(t, SignalRegistered, 2)
	return got, Signal{Kind: SignalHealAttempt, Key: h.Key(), Host: "a", Attempt: 1, Err: context.DeadlineExceeded}
}

// sigRegistrationEnded takes the registration over.
func sigRegistrationEnded(t *testing.T, s *signals) (Signal, Signal) {
	srv, cli := newEtcd(t)
	h := register(t, cli, "a", LivenessOptions{OnSignal: s.hook})
	register(t, srv.NewClient(t), "a", LivenessOptions{Takeover: true})
	got := s.waitFor(t, SignalRegistrationEnded, 1)
	if got.Err == nil || got.Err.Error() != h.Err().Error() {
		t.Fatalf("Err %v, the registration's %v", got.Err, h.Err())
	}
	return got, Signal{Kind: SignalRegistrationEnded, Key: h.Key(), Host: "a", Err: ErrHostExists}
}

// sigLeader returns an election on its own etcd that leads as node-1.
func sigLeader(t *testing.T, s *signals) (*Election, Signal) {
	_, cli := newEtcd(t)
	e, err := NewElection(testCtx(t), cli, ElectionOptions{Key: "/coord/elections/x", TTL: time.Second, OnSignal: s.hook})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	if err := e.Campaign(testCtx(t), "node-1"); err != nil {
		t.Fatal(err)
	}
	return e, Signal{Key: "/coord/elections/x", Identity: "node-1", Token: e.Token()}
}

func sigLeadershipGained(t *testing.T, s *signals) (Signal, Signal) {
	_, want := sigLeader(t, s)
	want.Kind = SignalLeadershipGained
	return s.waitFor(t, SignalLeadershipGained, 1), want
}

// sigLeadershipLost deletes the leader's key from another client.
func sigLeadershipLost(t *testing.T, s *signals) (Signal, Signal) {
	e, want := sigLeader(t, s)
	if _, err := e.cli.Delete(testCtx(t), e.prefix, clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	got := s.waitFor(t, SignalLeadershipLost, 1)
	if !errors.Is(got.Err, errKeyDeleted) || got.Err.Error() != e.Err().Error() {
		t.Fatalf("Err %v, the election's %v", got.Err, e.Err())
	}
	want.Kind, want.Err = SignalLeadershipLost, ErrLeadershipLost
	return got, want
}

// sigWatcherResync compacts away what a watcher would resume from, and
// restarts etcd.
func sigWatcherResync(t *testing.T, s *signals) (Signal, Signal) {
	srv, cli := newEtcd(t)
	register(t, cli, "a", LivenessOptions{})
	w := wtWatch(t, testCtx(t), cli, WatcherOptions{OnSignal: s.hook})
	expect(t, w, HostUp, "a")
	// Revisions past the one the watch resumes from, so that it comes
	// back compacted.
	for range 3 {
		if _, err := cli.Put(testCtx(t), "/other", "x"); err != nil {
			t.Fatal(err)
		}
	}
	srv.Compact(testCtx(t))
	srv.Restart()
	got := s.waitFor(t, SignalWatcherResync, 1)
	quiet(t, cli, w, HostsPrefix)
	return got, Signal{Kind: SignalWatcherResync, Key: HostsPrefix}
}

func sigEventDelivered(t *testing.T, s *signals) (Signal, Signal) {
	_, cli := newEtcd(t)
	register(t, cli, "a", LivenessOptions{})
	w := wtWatch(t, testCtx(t), cli, WatcherOptions{OnSignal: s.hook})
	expect(t, w, HostUp, "a")
	return s.waitFor(t, SignalEventDelivered, 1), Signal{Kind: SignalEventDelivered, Key: HostsPrefix, Host: "a", Event: HostUp}
}

// sigShardOwner returns a shard set of host a alone, owning shard s1.
func sigShardOwner(t *testing.T, s *signals) (*ShardSet, Shard) {
	_, cli := newEtcd(t)
	h := register(t, cli, "a", LivenessOptions{})
	set, err := NewShardSet(testCtx(t), cli, ShardOptions{Shards: []string{"s1"}, Host: h, TTL: time.Second,
		Run: func(ctx context.Context, _ Shard) { <-ctx.Done() }, OnSignal: s.hook})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { set.Close() })
	s.waitFor(t, SignalShardAcquired, 1)
	return set, set.Owned()[0]
}

func sigShardAcquired(t *testing.T, s *signals) (Signal, Signal) {
	_, sh := sigShardOwner(t, s)
	return s.waitFor(t, SignalShardAcquired, 1), Signal{Kind: SignalShardAcquired, Key: ShardsPrefix + "s1",
		Host: "a", Identity: "a", Shard: "s1", Token: sh.Token}
}

// sigShardReleased closes the owner's set. (Ending its registration
// would do too, but with one of two causes: whichever of the
// registration's end and its host's Down is seen first.)
func sigShardReleased(t *testing.T, s *signals) (Signal, Signal) {
	set, sh := sigShardOwner(t, s)
	if err := set.Close(); err != nil {
		t.Fatal(err)
	}
	return s.waitFor(t, SignalShardReleased, 1), Signal{Kind: SignalShardReleased, Key: ShardsPrefix + "s1",
		Host: "a", Identity: "a", Shard: "s1", Token: sh.Token, Err: ErrClosed}
}

// sigListingCompacted lists 40 hosts a page at a time over a slowed link
// while etcd compacts every 50 ms (see TestHostWatcherSnapshot).
func sigListingCompacted(t *testing.T, s *signals) (Signal, Signal) {
	srv, cli := newEtcd(t)
	prefix := prefixFor(t)
	wtPutHosts(t, cli, prefix, wtGrant(t, cli), 40)
	px := srv.NewProxy(t)
	px.Delay(2 * time.Millisecond)
	stop := wtCompactEvery(t, cli, strings.TrimSuffix(prefix, "/")+"-tick", 50*time.Millisecond)
	w := wtWatch(t, testCtx(t), px.NewClient(t), WatcherOptions{Prefix: prefix, PageSize: 1, OnSignal: s.hook})
	untilSynced(t, w)
	stop()
	return s.waitFor(t, SignalWatcherListingCompacted, 1), Signal{Kind: SignalWatcherListingCompacted, Key: prefix, Count: compactedListings}
}

// sigEtcdReplaced replaces etcd by another cluster under a watcher.
func sigEtcdReplaced(t *testing.T, s *signals) (Signal, Signal) {
	srv, cli := newEtcd(t)
	prefix := prefixFor(t)
	w := wtWatch(t, testCtx(t), cli, WatcherOptions{Prefix: prefix, UnhealthyAfter: time.Second, OnSignal: s.hook})
	untilSynced(t, w)
	srv.Replace()
	return s.waitFor(t, SignalEtcdReplaced, 1), Signal{Kind: SignalEtcdReplaced, Key: prefix, Err: errEtcdReplaced}
}

// sigLeadershipResumed cuts the leader off until it steps down, and has
// it campaign again as etcd answers again.
func sigLeadershipResumed(t *testing.T, s *signals) (Signal, Signal) {
	srv, _ := newEtcd(t)
	p := srv.NewProxy(t)
	t.Cleanup(p.Unpause)
	e := etElection(t, p.NewClient(t), ElectionOptions{Key: "/coord/elections/x", TTL: rsTTL(), OnSignal: s.hook})
	etCampaign(t, e, "node-1")
	token := e.Token()
	var again <-chan etResult
	rsCut(t, p, e.Done(), func() { again = etCampaignAsync(testCtx(t), e, "node-1") })
	etWait(t, again)
	return s.waitFor(t, SignalLeadershipResumed, 1), Signal{Kind: SignalLeadershipResumed, Key: "/coord/elections/x", Identity: "node-1", Token: token}
}

// sigPermitResumed cuts the holder off until its permit steps down, and
// has it acquire again as etcd answers again.
func sigPermitResumed(t *testing.T, s *signals) (Signal, Signal) {
	srv, _ := newEtcd(t)
	p := srv.NewProxy(t)
	t.Cleanup(p.Unpause)
	sem := smSemaphore(t, p.NewClient(t), SemaphoreOptions{Identity: "node-1", TTL: rsTTL(), OnSignal: s.hook})
	held := smAcquire(t, sem)
	var again <-chan smResult
	rsCut(t, p, held.Done(), func() { again = smAcquireAsync(testCtx(t), sem) })
	smGot(t, again)
	return s.waitFor(t, SignalPermitResumed, 1), Signal{Kind: SignalPermitResumed, Key: smKey, Identity: "node-1", Token: held.Token()}
}

func sigPermitAcquired(t *testing.T, s *signals) (Signal, Signal) {
	_, cli := newEtcd(t)
	p := smAcquire(t, smSemaphore(t, cli, SemaphoreOptions{Identity: "node-1", OnSignal: s.hook}))
	return s.waitFor(t, SignalPermitAcquired, 1), Signal{Kind: SignalPermitAcquired, Key: smKey, Identity: "node-1", Token: p.Token()}
}

// sigPermitReleased deletes the permit's key from another client.
func sigPermitReleased(t *testing.T, s *signals) (Signal, Signal) {
	_, cli := newEtcd(t)
	p := smAcquire(t, smSemaphore(t, cli, SemaphoreOptions{Identity: "node-1", OnSignal: s.hook}))
	if _, err := cli.Delete(testCtx(t), smPrefix, clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	got := s.waitFor(t, SignalPermitReleased, 1)
	if !errors.Is(got.Err, errPermitKeyDeleted) || got.Err.Error() != p.Err().Error() {
		t.Fatalf("Err %v, the permit's %v", got.Err, p.Err())
	}
	return got, Signal{Kind: SignalPermitReleased, Key: smKey, Identity: "node-1", Token: p.Token(), Err: ErrLeadershipLost}
}

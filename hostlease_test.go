package coord

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// TestHostLease: with a Host, a pool's elections, a semaphore's permits
// and a shard set's member key and candidacies ride the registration's
// lease; each deletes its own keys, the lease lives on; the terms end
// when the registration leaves the lease.
func TestHostLease(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	for _, c := range []struct {
		name string
		test func(*testing.T)
	}{
		{"one lease per agent", testHostLeaseOne},
		{"the registration leaves its lease", testHostLeaseLeft},
		{"Stop ends the terms", testHostLeaseStop},
		{"a registration taken over ends the terms", testHostLeaseTakenOver},
		{"a closed client leaves the keys to the lease, as a crash", testHostLeaseClientClosed},
		{"one owner of a key on a host", testHostLeaseClaims},
		{"beyond KeysPerSession, sessions of the pool's own", testHostLeaseKeysPerSession},
		{"keys etcd cannot delete: the registration leaves the lease", func(t *testing.T) { testHostLeaseSweepFails(t, false) }},
		{"keys etcd cannot delete: the registration leaves the lease, and heals though its revoke of that lease fails", func(t *testing.T) { testHostLeaseSweepFails(t, true) }},
		{"a cut shorter than the lease: step-down, then resume on the same lease", testHostLeaseResume},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.test(t)
		})
	}
}

func testHostLeaseResume(t *testing.T) {
	srv, cli := newEtcd(t)
	p := srv.NewProxy(t)
	t.Cleanup(p.Unpause)
	s := &signals{}
	h, a, sem := hlAgent(t, p.NewClient(t), rsTTL(), etKey, s.hook)
	permit, err := sem.Acquire(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	lease, token, ptoken := h.LeaseID(), a.Token(), permit.Token()
	b := etElection(t, srv.NewClient(t), ElectionOptions{TTL: rsTTL()})
	res := etQueue(t, testCtx(t), cli, b)
	var again <-chan etResult
	var reacquired chan *Permit
	rsCut(t, p, a.Done(), func() {
		waitClosed(t, permit.Done(), "Done of the permit cut off")
		if !errors.Is(a.Err(), ErrLeadershipLost) || !strings.Contains(a.Err().Error(), "renewals unanswered") {
			t.Errorf("stepped down with %v, want renewals unanswered", a.Err())
		}
		again = etCampaignAsync(testCtx(t), a, "a")
		reacquired = make(chan *Permit, 1)
		go func() {
			p, err := sem.Acquire(testCtx(t))
			if err != nil {
				t.Errorf("Acquire after the step-down: %v", err)
			}
			reacquired <- p
		}()
	})
	if r := etWait(t, again); r.err != nil || a.Token() != token {
		t.Fatalf("Campaign after the step-down: %v, token %d; want the token %d back", r.err, a.Token(), token)
	}
	if p := receive(t, reacquired, "the Acquire after the step-down"); p == nil || p.Token() != ptoken {
		t.Fatalf("Acquire after the step-down: %v; want the token %d back", p, ptoken)
	}
	s.waitFor(t, SignalLeadershipResumed, 1)
	s.waitFor(t, SignalPermitResumed, 1)
	if h.LeaseID() != lease || hlSession(a).id != lease {
		t.Fatalf("registration on lease %x, the election on %x; want both still on %x", h.LeaseID(), hlSession(a).id, lease)
	}
	select {
	case r := <-res:
		t.Fatalf("b's Campaign returned while a held: %v", r.err)
	default:
	}
}

// hlLeases returns what lease each key under prefix is on.
func hlLeases(t *testing.T, cli *clientv3.Client, prefix string) map[string]clientv3.LeaseID {
	t.Helper()
	resp, err := cli.Get(testCtx(t), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]clientv3.LeaseID{}
	for _, kv := range resp.Kvs {
		out[string(kv.Key)] = clientv3.LeaseID(kv.Lease)
	}
	return out
}

// hlSession returns the session of e's leadership.
func hlSession(e *Election) *session {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lead.sess
}

// hlAgent registers a on cli with ttl, and gives it, on that
// registration, a pool whose election of key leads, and a semaphore of
// /hl/sem (Limit 1); signal, if set, hears both.
func hlAgent(t *testing.T, cli *clientv3.Client, ttl time.Duration, key string, signal func(Signal)) (*HostLiveness, *Election, *Semaphore) {
	t.Helper()
	h := register(t, cli, "a", LivenessOptions{TTL: ttl})
	e := ptElection(t, ptPool(t, cli, PoolOptions{Host: h, OnSignal: signal}), key)
	etCampaign(t, e, "a")
	sem, err := NewSemaphore(testCtx(t), cli, SemaphoreOptions{Key: "/hl/sem", Limit: 1, Host: h, OnSignal: signal})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sem.Close() })
	return h, e, sem
}

func testHostLeaseOne(t *testing.T) {
	srv, _ := newEtcd(t)
	cli := srv.NewClient(t)
	h := register(t, cli, "a", LivenessOptions{TTL: 2 * time.Second})
	p := ptPool(t, cli, PoolOptions{Host: h})
	e1, e2 := ptElection(t, p, "/hl/e1"), ptElection(t, p, "/hl/e2")
	for _, e := range []*Election{e1, e2} {
		if err := e.Campaign(testCtx(t), "a"); err != nil {
			t.Fatal(err)
		}
	}
	sem, err := NewSemaphore(testCtx(t), cli, SemaphoreOptions{Key: "/hl/sem", Limit: 2, Host: h})
	if err != nil {
		t.Fatal(err)
	}
	defer sem.Close()
	permit, err := sem.Acquire(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	l := newShLedger()
	shards := shNames(4)
	set := shSet(t, cli, "a", l, ShardOptions{Shards: shards, Host: h, Prefix: "/hl/shards/"})
	l.until(t, "a owning every shard", func() bool { return len(set.Owned()) == len(shards) })

	lease := h.LeaseID()
	if got := ptLeases(t, cli); !slices.Equal(got, []clientv3.LeaseID{lease}) {
		t.Fatalf("etcd holds leases %v, want only the registration's %x", got, lease)
	}
	keys := hlLeases(t, cli, "/hl/")
	// 2 elections, a permit, a member key and 4 candidacies; and the
	// semaphore's limit, on no lease.
	if len(keys) != 2+1+1+len(shards)+1 || keys["/hl/sem"] != clientv3.NoLease {
		t.Fatalf("keys %v, want 9", keys)
	}
	delete(keys, "/hl/sem")
	for k, id := range keys {
		if id != lease {
			t.Fatalf("key %s on lease %x, want the registration's %x", k, id, lease)
		}
	}

	// Each owner deletes its keys; the lease, and the host key, live on.
	if err := permit.Release(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	p.Close()
	set.Close()
	sem.Close()
	for k := range hlLeases(t, cli, "/hl/") {
		if k != "/hl/sem" { // the limit, on no lease
			t.Fatalf("key %s left after every owner closed", k)
		}
	}
	if got := truth(t, cli, HostsPrefix); len(got) != 1 || h.LeaseID() != lease {
		t.Fatalf("hosts %v, lease %x; want a on lease %x", got, h.LeaseID(), lease)
	}
	if got := ptLeases(t, cli); !slices.Equal(got, []clientv3.LeaseID{lease}) {
		t.Fatalf("etcd holds leases %v, want only the registration's %x", got, lease)
	}
}

func testHostLeaseLeft(t *testing.T) {
	srv, _ := newEtcd(t)
	cli := srv.NewClient(t)
	h, e, sem := hlAgent(t, cli, 2*time.Second, "/hl/e", nil)
	permit, err := sem.Acquire(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	old := h.LeaseID()
	// An operator deletes the host key: the registration registers again
	// on a new lease, and revokes the old one, with our keys.
	if _, err := cli.Delete(testCtx(t), h.Key()); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, e.Done(), "Done of the election on the lease left")
	waitClosed(t, permit.Done(), "Done of the permit on the lease left")
	for what, err := range map[string]error{"election": e.Err(), "permit": permit.Err()} {
		if !errors.Is(err, ErrLeadershipLost) || !strings.Contains(err.Error(), "host registration left lease "+hexID(old)) {
			t.Fatalf("%s Err %v, want a leadership lost as the registration left lease %x", what, err, old)
		}
	}
	eventually(t, "the registration on a new lease", func() bool { return h.LeaseID() != old })
	if err := e.Campaign(testCtx(t), "a"); err != nil {
		t.Fatal(err)
	}
	if permit, err = sem.Acquire(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	keys := hlLeases(t, cli, "/hl/")
	want := map[string]clientv3.LeaseID{"/hl/sem": 0, e.c.prefix + hexID(h.LeaseID()): h.LeaseID(), permit.c.prefix + hexID(h.LeaseID()) + permit.c.suffix: h.LeaseID()}
	if len(keys) != len(want) {
		t.Fatalf("keys %v, want %v", keys, want)
	}
	for k, id := range want {
		if keys[k] != id {
			t.Fatalf("keys %v, want %v", keys, want)
		}
	}
}

func testHostLeaseStop(t *testing.T) {
	srv, _ := newEtcd(t)
	cli := srv.NewClient(t)
	h, e, sem := hlAgent(t, cli, 2*time.Second, "/hl/e", nil)
	if err := h.Stop(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, e.Done(), "Done of the election of a stopped host")
	if !errors.Is(e.Err(), ErrHostGone) {
		t.Fatalf("Err %v, want ErrHostGone", e.Err())
	}
	if err := e.Campaign(testCtx(t), "a"); !errors.Is(err, ErrHostGone) {
		t.Fatalf("Campaign on a stopped host: %v, want ErrHostGone", err)
	}
	if _, err := sem.Acquire(testCtx(t)); !errors.Is(err, ErrHostGone) {
		t.Fatalf("Acquire on a stopped host: %v, want ErrHostGone", err)
	}
	if _, err := NewSemaphore(testCtx(t), cli, SemaphoreOptions{Key: "/hl/sem2", Limit: 1, Host: h}); !errors.Is(err, ErrHostGone) {
		t.Fatalf("NewSemaphore on a stopped host: %v, want ErrHostGone", err)
	}
	if got := hlLeases(t, cli, "/hl/"); len(got) != 2 { // the limits
		t.Fatalf("keys %v, want the two limits", got)
	}
}

func testHostLeaseTakenOver(t *testing.T) {
	srv, _ := newEtcd(t)
	cli := srv.NewClient(t)
	h, e, _ := hlAgent(t, cli, 2*time.Second, "/hl/e", nil)
	register(t, srv.NewClient(t), "a", LivenessOptions{Takeover: true})
	waitClosed(t, h.Done(), "Done of the registration taken over")
	waitClosed(t, e.Done(), "Done of the election on the registration taken over")
	if !errors.Is(e.Err(), ErrHostGone) {
		t.Fatalf("Err %v, want ErrHostGone", e.Err())
	}
	if _, err := NewSemaphore(testCtx(t), cli, SemaphoreOptions{Key: "/hl/sem2", Limit: 1, Host: h}); !errors.Is(err, ErrHostGone) {
		t.Fatalf("NewSemaphore on a registration taken over: %v, want ErrHostGone", err)
	}
}

func testHostLeaseClientClosed(t *testing.T) {
	srv, cli := newEtcd(t)
	acli := srv.NewClient(t)
	h := register(t, acli, "a", LivenessOptions{TTL: 2 * time.Second})
	p := ptPool(t, acli, PoolOptions{Host: h})
	e := ptElection(t, p, "/hl/e")
	etCampaign(t, e, "a")
	lease := h.LeaseID()
	// Closed at once, as a ShardSet closes its pool when its client
	// closes: the client's connection outlives its Close by a moment, and
	// a delete sent then would still land. Close waits for the host
	// session's end: nothing was sent, whether the session or the
	// registration heard first.
	acli.Close()
	p.Close()
	if keys := hlLeases(t, cli, "/hl/"); len(keys) != 1 || keys[e.c.prefix+hexID(lease)] != lease {
		t.Fatalf("keys %v, want the election's still on lease %x", keys, lease)
	}
}

func testHostLeaseClaims(t *testing.T) {
	srv, _ := newEtcd(t)
	cli := srv.NewClient(t)
	h := register(t, cli, "a", LivenessOptions{TTL: 2 * time.Second})
	p1, p2 := ptPool(t, cli, PoolOptions{Host: h}), ptPool(t, cli, PoolOptions{Host: h})
	e := ptElection(t, p1, "/hl/k")
	if _, err := p2.Election(testCtx(t), "/hl/k"); !errors.Is(err, ErrInUse) {
		t.Fatalf("the key of another pool on the host: %v, want ErrInUse", err)
	}
	if _, err := NewSemaphore(testCtx(t), cli, SemaphoreOptions{Key: "/hl/k", Limit: 1, Host: h}); !errors.Is(err, ErrInUse) {
		t.Fatalf("a semaphore on the key of a pool on the host: %v, want ErrInUse", err)
	}
	// Without Host, or on another host, the key is free.
	other := register(t, cli, "b", LivenessOptions{TTL: 2 * time.Second})
	ptElection(t, ptPool(t, cli, PoolOptions{Host: other}), "/hl/k")
	ptElection(t, ptPool(t, cli, PoolOptions{}), "/hl/k")
	e.Close()
	ptElection(t, p2, "/hl/k")

	l := newShLedger()
	shSet(t, cli, "a", l, ShardOptions{Shards: shNames(1), Host: h, Prefix: "/hl/shards/"})
	if s, err := NewShardSet(testCtx(t), cli, ShardOptions{Shards: shNames(1), Host: h, Prefix: "/hl/shards/", Run: idle}); !errors.Is(err, ErrInUse) {
		t.Fatalf("a second shard set of the prefix on the host: %v, %v; want ErrInUse", s, err)
	}
}

func testHostLeaseKeysPerSession(t *testing.T) {
	srv, _ := newEtcd(t)
	cli := srv.NewClient(t)
	h := register(t, cli, "a", LivenessOptions{TTL: 2 * time.Second})
	p := ptPool(t, cli, PoolOptions{Host: h, KeysPerSession: 1, TTL: 3 * time.Second})
	e1, e2 := ptElection(t, p, "/hl/e1"), ptElection(t, p, "/hl/e2")
	for _, e := range []*Election{e1, e2} {
		if err := e.Campaign(testCtx(t), "a"); err != nil {
			t.Fatal(err)
		}
	}
	if l1, l2 := hlSession(e1), hlSession(e2); l1.id != h.LeaseID() || l1.ttl != h.TTL() || l2.host != nil || l2.ttl != 3*time.Second {
		t.Fatalf("e1 on lease %x (TTL %v), e2 on %x (TTL %v, host %v); want the host's lease, then one of the pool's of TTL 3s",
			l1.id, l1.ttl, l2.id, l2.ttl, l2.host != nil)
	}
	ptStats(t, p, PoolStats{Elections: 2, Sessions: 2, Leading: 2, TTL: 3 * time.Second})
	// e1 gone, the host session ends (swept), and the next election
	// rides a new one on the same lease, once that sweep is over.
	first := hlSession(e1)
	e1.Close()
	waitClosed(t, first.swept, "the sweep of the host session left empty")
	e3 := ptElection(t, p, "/hl/e3")
	if err := e3.Campaign(testCtx(t), "a"); err != nil {
		t.Fatal(err)
	}
	if s := hlSession(e3); s == first || s.id != h.LeaseID() {
		t.Fatalf("e3 on lease %x (a new session: %v), want a new session on the host's %x", s.id, s != first, h.LeaseID())
	}
	// A put on a session that ended records nothing: it is not sent.
	first.sending("/hl/late")()
	if first.names["/hl/late"] {
		t.Fatal("a put on a session that ended was recorded")
	}
}

// testHostLeaseSweepFails: etcd stops; a host session's keys cannot be
// deleted, and the registration leaves its lease. With refuseRevoke, once
// etcd is back, the heal's revoke of the lease it left is refused (etcd
// behind on its applying): the lease, renewed by etcd's restart, still
// holds the host key, which the heal must take for its own.
func testHostLeaseSweepFails(t *testing.T, refuseRevoke bool) {
	srv, _ := newEtcd(t)
	var (
		mu      sync.Mutex
		refuse  clientv3.LeaseID // the lease whose first revoke is refused
		refused bool
	)
	cli := interceptedClient(t, srv.ClientConfig(), func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		mu.Lock()
		defer mu.Unlock()
		if r, ok := req.(*pb.LeaseRevokeRequest); ok && refuseRevoke && refuse != 0 && clientv3.LeaseID(r.ID) == refuse && !refused {
			refused = true
			return rpctypes.ErrGRPCRequestTooManyRequests
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	tap, log := newLogTap()
	tap.dumpOnFailure(t)
	h := register(t, cli, "a", LivenessOptions{TTL: time.Second, Logger: log})
	mu.Lock()
	refuse = h.LeaseID()
	mu.Unlock()
	p := ptPool(t, cli, PoolOptions{Host: h, Logger: log})
	e := ptElection(t, p, "/hl/e")
	if err := e.Campaign(testCtx(t), "a"); err != nil {
		t.Fatal(err)
	}
	old := h.LeaseID()
	srv.Stop()
	// The election cannot delete its key: its session ends, and its
	// sweep cannot delete the key either. Meanwhile the next session of
	// the pool, whose keys have the same names, waits for that sweep.
	e.Close()
	e2 := ptElection(t, p, "/hl/e2")
	short, cancel := context.WithTimeout(testCtx(t), 100*time.Millisecond)
	defer cancel()
	if err := e2.Campaign(short, "a"); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "wait for the keys of an ended session to be deleted") {
		t.Fatalf("Campaign while the last session's keys are swept: %v, want it to wait for that sweep", err)
	}
	// Once the TTL is over, the registration leaves the lease, which
	// nobody renews any more, and waits for etcd to register again.
	tap.wait(t, "coord: keys of an ended session not deleted, the registration leaves its lease", 1)
	tap.wait(t, "coord: host registration lost, healing", 1)
	short, cancel = context.WithTimeout(testCtx(t), 100*time.Millisecond)
	defer cancel()
	if err := e2.Campaign(short, "a"); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "wait for the host's registration") {
		t.Fatalf("Campaign while the registration heals: %v, want it to wait for the registration", err)
	}
	srv.Restart()
	eventually(t, "the registration on a new lease, or ended", func() bool {
		select {
		case <-h.Done():
			return true
		default:
			return h.LeaseID() != old
		}
	})
	if err := h.Err(); err != nil {
		t.Fatalf("the registration ended: %v", err)
	}
	mu.Lock()
	if refuseRevoke && !refused {
		t.Error("the heal's revoke of the lease it left was not refused: the test did not set up what it tests")
	}
	mu.Unlock()
	eventually(t, "the election key gone with the old lease", func() bool { return len(hlLeases(t, cli, "/hl/")) == 0 })
	if ttl, err := cli.TimeToLive(testCtx(t), old); err != nil || ttl.TTL != -1 {
		t.Fatalf("the old lease: %v, %v; want it gone", ttl, err)
	}
	if err := e2.Campaign(testCtx(t), "a"); err != nil || hlSession(e2).id != h.LeaseID() {
		t.Fatalf("Campaign once the registration healed: %v, want to lead on the new lease %x", err, h.LeaseID())
	}
}

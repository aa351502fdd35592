package coord

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/go-coord/coord/coordtest"
)

// Fault tests: each injects a fault the way real clusters fail and checks
// what coord promises. FAULTS.md lists them with the figures measured.

func TestFaultHostCutOff(t *testing.T) {
	t.Run("a cut-off host is seen Down after its TTL and comes back Up under a new lease", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		tap, log := newLogTap()
		h := register(t, p.NewClient(t), "a", LivenessOptions{TTL: time.Second, Logger: log})
		w, err := NewHostWatcher(testCtx(t), cli, WatcherOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		expect(t, w, HostUp, "a")
		old := h.LeaseID()

		p.Blackhole()
		cut := time.Now()
		down := expect(t, w, HostDown, "a")
		downAfter := time.Since(cut)
		if downAfter < h.TTL()/2 {
			t.Fatalf("Down after %v, before the lease could expire", downAfter)
		}
		if down.Metadata.Hostname != "host-a" {
			t.Fatalf("Down without metadata: %+v", down)
		}
		// Cut off for longer than 2/3 of the TTL, the keeper keeps trying.
		tap.wait(t, "coord: lease renewals unanswered", 1)

		p.Unblackhole()
		healed := time.Now()
		up := expect(t, w, HostUp, "a")
		t.Logf("cut → Down %v (TTL %v); heal → Up %v", downAfter.Round(time.Millisecond), h.TTL(),
			time.Since(healed).Round(time.Millisecond))
		if up.Synthetic {
			t.Fatal("Up after the heal should be a live event")
		}
		eventually(t, "a new lease", func() bool { return h.LeaseID() != old })
		select {
		case <-h.Done():
			t.Fatalf("registration ended: %v", h.Err())
		default:
		}
	})
	t.Run("a delete missed while cut off is found when the watch comes back compacted", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		p := srv.NewProxy(t)
		tap, log := newLogTap()
		h := register(t, p.NewClient(t), "a", LivenessOptions{TTL: 5 * time.Second, Logger: log})
		old := h.LeaseID()
		// Cut off, the host misses the delete of its key; history is then
		// compacted, and etcd restarted so that the host's watch must be
		// re-created from its last revision, which is gone.
		p.Blackhole()
		if _, err := cli.Delete(ctx, h.Key()); err != nil {
			t.Fatal(err)
		}
		for i := range 3 {
			if _, err := cli.Put(ctx, fmt.Sprintf("/other/%d", i), "x"); err != nil {
				t.Fatal(err)
			}
		}
		srv.Compact(ctx)
		srv.Stop()
		p.Unblackhole()
		srv.Restart()
		kv := waitKey(t, cli, h.Key(), heldByOtherThan(old))
		eventually(t, "LeaseID to be the key's lease", func() bool { return clientv3.LeaseID(kv.Lease) == h.LeaseID() })
		if tap.count("coord: host registration lost, healing") != 1 {
			t.Fatal("expected exactly one heal")
		}
	})
}

func TestFaultAccessControl(t *testing.T) {
	srv, _ := newEtcd(t)
	login := enableAuth(t, srv, map[string][]keyRange{"agent": {prefixRange("/coord/")}, "nobody": nil})
	t.Run("a user whose role reaches /coord/ can do everything", func(t *testing.T) {
		cli := login("agent")
		ctx := testCtx(t)
		h := register(t, cli, "a", LivenessOptions{})
		w, err := NewHostWatcher(ctx, cli, WatcherOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		expect(t, w, HostUp, "a")
		if err := h.Update(ctx, meta("a")); err != nil {
			t.Fatal(err)
		}
		expect(t, w, HostUpdated, "a")
		e, err := NewElection(ctx, cli, ElectionOptions{Key: "/coord/elections/x", TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		if err := e.Campaign(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		if err := h.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		expect(t, w, HostDown, "a")
	})
	t.Run("a user without the permission gets a permission error at once", func(t *testing.T) {
		cli := login("nobody")
		ctx := testCtx(t)
		start := time.Now()
		if _, err := RegisterHostLiveness(ctx, cli, meta("b"), LivenessOptions{}); !errors.Is(err, rpctypes.ErrPermissionDenied) {
			t.Fatalf("register: %v", err)
		}
		w, err := NewHostWatcher(ctx, cli, WatcherOptions{})
		if err != nil {
			t.Fatal(err)
		}
		w.Wait()
		if !errors.Is(w.Err(), rpctypes.ErrPermissionDenied) {
			t.Fatalf("watcher Err %v", w.Err())
		}
		e, err := NewElection(ctx, cli, ElectionOptions{Key: "/coord/elections/y", TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		if err := e.Campaign(ctx, "b"); !errors.Is(err, rpctypes.ErrPermissionDenied) {
			t.Fatalf("campaign: %v", err)
		}
		t.Logf("three refusals in %v", time.Since(start).Round(time.Millisecond))
	})
	t.Run("a registration whose permission is withdrawn ends with the permission error", func(t *testing.T) {
		root := login("root")
		ctx := testCtx(t)
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		h := register(t, login("agent"), "c", LivenessOptions{Logger: log})
		if _, err := root.RoleRevokePermission(ctx, "agent", "/coord/", clientv3.GetPrefixRangeEnd("/coord/")); err != nil {
			t.Fatal(err)
		}
		if _, err := root.Delete(ctx, h.Key()); err != nil {
			t.Fatal(err)
		}
		if !closedWithin(h.Done()) {
			t.Fatal("registration did not end")
		}
		if !errors.Is(h.Err(), rpctypes.ErrPermissionDenied) {
			t.Fatalf("Err %v", h.Err())
		}
	})
}

func TestFaultHealRefused(t *testing.T) {
	t.Run("a heal refused for good ends the registration with the refusal", func(t *testing.T) {
		srv, _ := newEtcd(t)
		login := enableAuth(t, srv, map[string][]keyRange{"agent": {prefixRange("/coord/")}})
		root := login("root")
		ctx := testCtx(t)
		h := register(t, login("agent"), "c", LivenessOptions{})
		// The agent may still read (its watch goes on) but no longer write:
		// one grant on the same range replaces read-write with read, with
		// no moment without read (a revoke first would refuse a watch
		// created meanwhile, as happened on a slow, emulated CPU).
		if _, err := root.RoleGrantPermission(ctx, "agent", "/coord/", clientv3.GetPrefixRangeEnd("/coord/"),
			clientv3.PermissionType(clientv3.PermRead)); err != nil {
			t.Fatal(err)
		}
		if _, err := root.Delete(ctx, h.Key()); err != nil {
			t.Fatal(err)
		}
		if !closedWithin(h.Done()) {
			t.Fatal("registration did not end")
		}
		if !errors.Is(h.Err(), rpctypes.ErrPermissionDenied) || !strings.Contains(h.Err().Error(), "heal host key") {
			t.Fatalf("Err %v", h.Err())
		}
	})
}

func TestFaultHealWithoutQuorum(t *testing.T) {
	t.Run("a heal that meets a member without leader retries until it is back", func(t *testing.T) {
		c := coordtest.NewCluster(t, 3)
		m := c.Members()[0]
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		sig := &signals{}
		h := register(t, m.NewClient(t), "a", LivenessOptions{TTL: time.Second, Logger: log, OnSignal: sig.hook})
		old := h.LeaseID()
		// Hold the heal at the write slot (as an Update in flight does),
		// cut the host's member off from the others, then let the heal
		// go: it meets a member that cannot grant it a lease.
		h.writes <- struct{}{}
		if _, err := c.Client().Delete(testCtx(t), h.Key()); err != nil {
			t.Fatal(err)
		}
		tap.wait(t, "coord: host registration lost, healing", 1)
		m.Isolate()
		leaderless := m.NewClient(t)
		eventually(t, "the member to refuse without a leader", func() bool {
			ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
			defer cancel()
			_, err := leaderless.Get(ctx, "x")
			return err != nil
		})
		<-h.writes
		sig.waitFor(t, SignalHealAttempt, 1)
		m.Heal()
		kv := waitKey(t, c.Client(), h.Key(), heldByOtherThan(old))
		eventually(t, "LeaseID to be the key's lease", func() bool { return clientv3.LeaseID(kv.Lease) == h.LeaseID() })
	})
}

func TestFaultLaggingConsumer(t *testing.T) {
	t.Run("a consumer far behind, across a compaction, gets only the differences", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ctx := testCtx(t)
		put := func(id, version string) {
			t.Helper()
			m := meta(id)
			m.Version = version
			if _, err := cli.Put(ctx, HostsPrefix+id, string(must(json.Marshal(m)))); err != nil {
				t.Fatal(err)
			}
		}
		for _, id := range []string{"a", "b", "c"} {
			put(id, "0")
		}
		tap, log := newLogTap()
		w, err := NewHostWatcher(ctx, cli, WatcherOptions{MaxBacklog: 5, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		eventually(t, "the listed hosts in Hosts", func() bool { return len(w.Hosts()) == 3 })
		// Hosts shows the listing before the watch from its revision runs:
		// a watch that started only after the compaction below would fail
		// as compacted, and the watcher would take the other path (list
		// again). A probe host seen in Hosts came through the watch, which
		// is then live. It comes and goes before the consumer reads
		// anything: it is never sent either.
		put("probe", "0")
		eventually(t, "the probe in Hosts (the watch is live)", func() bool {
			return slices.ContainsFunc(w.Hosts(), func(m HostMetadata) bool { return m.HostUUID == "probe" })
		})
		if _, err := cli.Delete(ctx, HostsPrefix+"probe"); err != nil {
			t.Fatal(err)
		}
		// The consumer reads nothing while, in two transactions, a is
		// updated twice, twenty hosts come and go, b goes and d comes; then
		// history is compacted. Each transaction is one watch response:
		// the backlog is over the bound after each.
		val := func(id, version string) string {
			m := meta(id)
			m.Version = version
			return string(must(json.Marshal(m)))
		}
		var ops1, ops2 []clientv3.Op
		ops1 = append(ops1, clientv3.OpPut(HostsPrefix+"a", val("a", "1")))
		ops2 = append(ops2, clientv3.OpPut(HostsPrefix+"a", val("a", "2")),
			clientv3.OpDelete(HostsPrefix+"b"), clientv3.OpPut(HostsPrefix+"d", val("d", "0")))
		for i := range 20 {
			x := fmt.Sprintf("x%02d", i)
			ops1 = append(ops1, clientv3.OpPut(HostsPrefix+x, val(x, "0")))
			ops2 = append(ops2, clientv3.OpDelete(HostsPrefix+x))
		}
		for _, ops := range [][]clientv3.Op{ops1, ops2} {
			if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
		}
		srv.Compact(ctx)
		tap.wait(t, "coord: consumer behind, sending differences", 1)
		if n := tap.count("coord: host watch broke, resyncing"); n != 0 {
			t.Fatalf("the watch broke %d times: the catch-up is not what was tested", n)
		}
		eventually(t, "the update in Hosts", func() bool { return len(w.Hosts()) == 3 && w.Hosts()[0].Version == "2" })

		r := newWtReplica(t)
		var got []string
		for len(r.hosts) != 3 || r.hosts["a"].Version != "2" {
			ev := next(t, w)
			got = append(got, fmt.Sprintf("%s %s %s", ev.Kind, ev.HostUUID, ev.Metadata.Version))
			r.apply(ev)
		}
		if !closedWithin(w.Synced()) {
			t.Fatal("Synced not closed after the catch-up")
		}
		quiet(t, cli, w, HostsPrefix)
		r.matches(cli, HostsPrefix)
		t.Logf("events: %v", got)
		// At most one event per host that differs from what the consumer
		// was sent (nothing: a, c and d up, a at version 2); b, the x
		// hosts and the probe, never sent, are never mentioned.
		if len(got) > 3 {
			t.Fatalf("%d events, want only the differences: %v", len(got), got)
		}
		for _, e := range got {
			if strings.Contains(e, " b ") || strings.Contains(e, " x") || strings.Contains(e, " probe ") {
				t.Fatalf("a host never sent was mentioned: %v", got)
			}
		}
	})
	t.Run("a negative MaxBacklog is refused", func(t *testing.T) {
		_, cli := newEtcd(t)
		if _, err := NewHostWatcher(testCtx(t), cli, WatcherOptions{MaxBacklog: -1}); !errors.Is(err, ErrInvalidBuffer) {
			t.Fatalf("got %v", err)
		}
	})
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// fcCountingClient returns a client made from cfg that counts the
// LeaseKeepAlive streams it opens, closed at the end of the test.
func fcCountingClient(t *testing.T, cfg clientv3.Config) (*clientv3.Client, *atomic.Int64) {
	t.Helper()
	var opened atomic.Int64
	cfg.DialOptions = append(slices.Clone(cfg.DialOptions),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn,
			method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			if method == "/etcdserverpb.Lease/LeaseKeepAlive" {
				opened.Add(1)
			}
			return streamer(ctx, desc, cc, method, opts...)
		}))
	c, err := clientv3.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, &opened
}

// fcRenewed waits until every keeper has had a renewal answered after since.
func fcRenewed(t *testing.T, since time.Time, ks ...*keeper) {
	t.Helper()
	eventually(t, "renewals answered", func() bool {
		for _, k := range ks {
			if !k.lastAnswer().After(since) {
				return false
			}
		}
		return true
	})
}

func TestFaultRenewalStream(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("every lease of a client is renewed over one stream", func(t *testing.T) {
		srv, _ := newEtcd(t)
		cli, opened := fcCountingClient(t, srv.ClientConfig())
		tap, log := newLogTap()
		// Scaled: a lease lost for want of CPU (1 s under riscv64
		// emulation did) is not what this test is about.
		ttl := time.Second * scale
		h := register(t, cli, "a", LivenessOptions{TTL: ttl, Logger: log})
		a := etElection(t, cli, ElectionOptions{Key: etKey + "-a", TTL: ttl})
		b := etElection(t, cli, ElectionOptions{Key: etKey + "-b", TTL: ttl})
		p := ptPool(t, cli, PoolOptions{TTL: ttl, KeysPerSession: 2})
		var ks []*keeper
		for _, e := range []*Election{a, b, ptElection(t, p, etKey+"-c"), ptElection(t, p, etKey+"-d"), ptElection(t, p, etKey+"-e")} {
			etCampaign(t, e, "x")
			ks = append(ks, e.current().sess.k)
		}
		// Three renewal periods of every lease: the registration's, two
		// elections' and the pool's two shared sessions.
		for range 3 {
			fcRenewed(t, time.Now(), ks...)
		}
		if n := opened.Load(); n != 1 {
			t.Fatalf("%d LeaseKeepAlive streams opened, want 1", n)
		}
		if n := tap.count("coord: lease renewals unanswered"); n != 0 || h.Err() != nil {
			t.Fatalf("%d stale leases, registration %v", n, h.Err())
		}
	})
	t.Run("a stream broken mid-flight is reopened without losing a lease or a leadership", func(t *testing.T) {
		srv, _ := newEtcd(t)
		px := srv.NewProxy(t)
		cli, opened := fcCountingClient(t, px.ClientConfig())
		ttl := 3 * time.Second * scale
		e := etElection(t, cli, ElectionOptions{TTL: ttl})
		etCampaign(t, e, "a")
		l := e.current()
		// Right after an answer, with a try due a third of the TTL later:
		// the link is cut and its connections reset, in the middle of the
		// next renewal.
		last := l.sess.k.lastAnswer()
		fcRenewed(t, last, l.sess.k)
		px.Blackhole()
		eventually(t, "a renewal sent into the cut", func() bool { return time.Since(l.sess.k.lastAnswer()) > ttl/3+ttl/10 })
		px.Unblackhole()
		cut := time.Now()
		fcRenewed(t, cut, l.sess.k)
		if n := opened.Load(); n != 2 {
			t.Fatalf("%d LeaseKeepAlive streams opened, want 2 (one reopened)", n)
		}
		etOpen(t, l.ctx.Done(), "Done of the leadership across the reopened stream")
		if !e.IsLeader() || e.Token() != l.rev {
			t.Fatal("the leadership did not survive the reopened stream")
		}
	})
	t.Run("a try that finds the stream being opened waits for it within its own time", func(t *testing.T) {
		srv, _ := newEtcd(t)
		cli, hooks := etHookedClient(t, srv.ClientConfig())
		tap, log := newLogTap()
		release := make(chan struct{})
		var once sync.Once
		free := func() { once.Do(func() { close(release) }) }
		defer free()
		hooks.on("/etcdserverpb.Lease/LeaseKeepAlive", func() { <-release })
		ttl := time.Second * scale
		a := etElection(t, cli, ElectionOptions{Key: etKey + "-a", TTL: ttl, Logger: log})
		b := etElection(t, cli, ElectionOptions{Key: etKey + "-b", TTL: ttl, Logger: log})
		// The first try holds the opening; the other gives up after its
		// sixth of the TTL, and tries again.
		tap.wait(t, "coord: lease renewal failed", 1)
		free()
		ks := []*keeper{etSession(a).k, etSession(b).k}
		fcRenewed(t, time.Now(), ks...)
	})
}

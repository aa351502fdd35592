package coord

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/coordtest"
)

// ptPool returns a pool on cli, closed at the end of the test.
func ptPool(t *testing.T, cli *clientv3.Client, opts PoolOptions) *ElectionPool {
	t.Helper()
	p, err := NewElectionPool(cli, opts)
	if err != nil {
		t.Fatalf("NewElectionPool: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// ptElection returns the pool's Election for key, failing the test on error.
func ptElection(t *testing.T, p *ElectionPool, key string) *Election {
	t.Helper()
	e, err := p.Election(testCtx(t), key)
	if err != nil {
		t.Fatalf("pool Election(%q): %v", key, err)
	}
	return e
}

// ptStats checks the pool's Stats.
func ptStats(t *testing.T, p *ElectionPool, want PoolStats) {
	t.Helper()
	if got := p.Stats(); got != want {
		t.Fatalf("Stats = %+v, want %+v", got, want)
	}
}

// ptLeases returns the leases etcd holds.
func ptLeases(t *testing.T, cli *clientv3.Client) []clientv3.LeaseID {
	t.Helper()
	resp, err := cli.Leases(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	var ids []clientv3.LeaseID
	for _, l := range resp.Leases {
		ids = append(ids, l.ID)
	}
	return ids
}

// ptStuck returns a pool behind a proxy that swallows all traffic, and the
// Campaign of its election a stuck making the pool's first session.
func ptStuck(t *testing.T) (*coordtest.Proxy, *ElectionPool, *Election, <-chan etResult) {
	t.Helper()
	srv, _ := newEtcd(t)
	px := srv.NewProxy(t)
	p := ptPool(t, px.NewClient(t), PoolOptions{TTL: time.Second})
	a := ptElection(t, p, etKey)
	px.Blackhole()
	t.Cleanup(px.Unblackhole)
	res := etCampaignAsync(context.Background(), a, "a")
	// TryLock: a pool that held its lock across the etcd call would
	// otherwise hang the test instead of failing it.
	eventually(t, "a session being made, with the pool's lock free", func() bool {
		if !p.mu.TryLock() {
			return false
		}
		defer p.mu.Unlock()
		return p.growing != nil
	})
	return px, p, a, res
}

// ptKeys returns n election keys of the test.
func ptKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%d", etKey, i)
	}
	return keys
}

func TestElectionPool(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("elections share sessions, at most KeysPerSession on one lease", func(t *testing.T) {
		_, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second, KeysPerSession: 2})
		ptStats(t, p, PoolStats{TTL: 2 * time.Second})
		var es []*Election
		for _, key := range ptKeys(5) {
			e := ptElection(t, p, key)
			etCampaign(t, e, "a")
			es = append(es, e)
		}
		ptStats(t, p, PoolStats{Elections: 5, Sessions: 3, Leading: 5, TTL: 2 * time.Second})
		if n := len(ptLeases(t, cli)); n != 3 {
			t.Fatalf("etcd holds %d leases, want 3", n)
		}
		perLease := map[clientv3.LeaseID]int{}
		for _, e := range es {
			perLease[etSession(e).id]++
		}
		for id, n := range perLease {
			if n > 2 {
				t.Fatalf("%d elections on lease %x, want at most 2", n, int64(id))
			}
		}
	})
	t.Run("a session lost ends exactly the leaderships on it; their next Campaign uses a live session", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second, KeysPerSession: 2})
		var es []*Election
		for _, key := range ptKeys(3) {
			e := ptElection(t, p, key)
			etCampaign(t, e, "a")
			es = append(es, e)
		}
		lost := etSession(es[0])
		if etSession(es[1]) != lost || etSession(es[2]) == lost {
			t.Fatal("the first two elections should share a session, the third another")
		}
		etRevoke(t, srv.NewClient(t), lost.id)
		waitClosed(t, es[0].Done(), "Done of a leadership on the lost session")
		waitClosed(t, es[1].Done(), "Done of a leadership on the lost session")
		for _, e := range es[:2] {
			if !errors.Is(e.Err(), ErrLeadershipLost) {
				t.Fatalf("Err: %v, want ErrLeadershipLost", e.Err())
			}
		}
		etOpen(t, es[2].Done(), "Done of the leadership on the other session")
		if !es[2].IsLeader() {
			t.Fatal("the leadership on the other session ended")
		}
		etCampaign(t, es[0], "a")
		// The live session had room: no new lease.
		if s := etSession(es[0]); s != etSession(es[2]) {
			t.Fatal("campaigned again on another session than the live one with room")
		}
		ptStats(t, p, PoolStats{Elections: 3, Sessions: 1, Leading: 2, TTL: 2 * time.Second})
		etCampaign(t, es[1], "a")
		if s := etSession(es[1]); s == lost || s == etSession(es[2]) || s.ctx.Err() != nil {
			t.Fatal("campaigned again on the lost session, or on a full one")
		}
		ptStats(t, p, PoolStats{Elections: 3, Sessions: 2, Leading: 3, TTL: 2 * time.Second})
	})
	t.Run("a new election joins the fullest session with room; a session left with no election is revoked at once", func(t *testing.T) {
		_, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second, KeysPerSession: 3})
		keys := ptKeys(7)
		es := make([]*Election, len(keys))
		for i, key := range keys[:6] {
			es[i] = ptElection(t, p, key)
			etCampaign(t, es[i], "a")
		}
		first, second := etSession(es[0]), etSession(es[3])
		if first == second || etSession(es[2]) != first || etSession(es[5]) != second {
			t.Fatal("want elections 0-2 on one session, 3-5 on another")
		}
		// The first session made is left with one election, the second
		// with two: a new one joins the second.
		for _, i := range []int{0, 1, 3} {
			es[i].Close()
		}
		ptStats(t, p, PoolStats{Elections: 3, Sessions: 2, Leading: 3, TTL: 2 * time.Second})
		es[6] = ptElection(t, p, keys[6])
		etCampaign(t, es[6], "a")
		if etSession(es[6]) != second {
			t.Fatal("a new election joined the emptier session, not the fullest with room")
		}
		// The first session's last election leaves: its lease goes now,
		// not when its TTL runs out.
		es[2].Close()
		ptStats(t, p, PoolStats{Elections: 3, Sessions: 1, Leading: 3, TTL: 2 * time.Second})
		waitClosed(t, first.ctx.Done(), "the emptied session")
		eventually(t, "the emptied session's lease revoked", func() bool { return etTTL(t, cli, first.id) == -1 })
		if !slices.Equal(ptLeases(t, cli), []clientv3.LeaseID{second.id}) {
			t.Fatalf("etcd holds leases %v, want only %x", ptLeases(t, cli), int64(second.id))
		}
	})
	t.Run("a Resign that misses its ctx leaves the shared session and its other leaderships alone; the key goes in the background", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		p := ptPool(t, px.NewClient(t), PoolOptions{TTL: 2 * time.Second})
		a, b := ptElection(t, p, etKey+"-a"), ptElection(t, p, etKey+"-b")
		etCampaign(t, a, "a")
		etCampaign(t, b, "b")
		sess, key := etSession(a), a.current().key
		if etSession(b) != sess {
			t.Fatal("the two elections do not share a session")
		}
		// Each round trip takes 80 ms: the delete cannot be answered
		// within a ctx of 20 ms.
		px.Delay(40 * time.Millisecond)
		ctx, cancel := context.WithTimeout(testCtx(t), 20*time.Millisecond)
		defer cancel()
		if err := a.Resign(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Resign: %v, want DeadlineExceeded", err)
		}
		if a.IsLeader() || !errors.Is(a.Err(), ErrResigned) {
			t.Fatalf("after Resign: IsLeader %v, Err %v", a.IsLeader(), a.Err())
		}
		etWaitCount(t, cli, key, 0)
		if !b.IsLeader() || sess.ctx.Err() != nil {
			t.Fatalf("the other key's leadership: IsLeader %v, Err %v; session ended: %v", b.IsLeader(), b.Err(), sess.Err())
		}
		ptStats(t, p, PoolStats{Elections: 2, Sessions: 1, Leading: 1, TTL: 2 * time.Second})
	})
	t.Run("one holder per key; Close releases the key and leaves nothing behind", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second, Identity: "pooled"})
		a := ptElection(t, p, etKey)
		if _, err := p.Election(testCtx(t), etKey); !errors.Is(err, ErrInUse) {
			t.Fatalf("second Election of a held key: %v, want ErrInUse", err)
		}
		etCampaign(t, a, "")
		if got, err := a.Leader(testCtx(t)); err != nil || got != "pooled" {
			t.Fatalf("Leader = %q, %v; want pooled", got, err)
		}
		// A second key waits behind a leader of another agent.
		leader := etElection(t, srv.NewClient(t), ElectionOptions{Key: etKey + "-b"})
		etCampaign(t, leader, "other")
		b := ptElection(t, p, etKey+"-b")
		res := etCampaignAsync(testCtx(t), b, "b")
		etWaitCount(t, cli, etKey+"-b/", 2, clientv3.WithPrefix())
		done := a.Done()
		if err := a.Close(); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, done, "Done after Close")
		if !errors.Is(a.Err(), ErrClosed) {
			t.Fatalf("Err after Close: %v, want ErrClosed", a.Err())
		}
		if n := keyCount(t, cli, etPrefix); n != 0 {
			t.Fatalf("%d keys left of the closed election", n)
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		if r := etWait(t, res); !errors.Is(r.err, ErrClosed) {
			t.Fatalf("Campaign of a closed pooled election: %v, want ErrClosed", r.err)
		}
		etWaitCount(t, cli, etKey+"-b/", 1, clientv3.WithPrefix())
		// Nothing of the released keys stays: no election, no session.
		ptStats(t, p, PoolStats{TTL: 2 * time.Second})
		eventually(t, "the session released", func() bool { return len(ptLeases(t, cli)) == 1 })
		again := ptElection(t, p, etKey)
		if again == a {
			t.Fatal("the closed Election handed out again")
		}
		etCampaign(t, again, "")
	})
	t.Run("no call waits for another key's etcd traffic", func(t *testing.T) {
		px, p, a, res := ptStuck(t)
		// Election and Stats need no etcd; a Campaign of another key
		// waits for the session being made, within its own ctx.
		ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		b := ptElection(t, p, etKey+"-b")
		ptStats(t, p, PoolStats{Elections: 2, TTL: time.Second})
		if err := b.Campaign(ctx, "b"); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Campaign beside a stuck session: %v, want DeadlineExceeded", err)
		}
		if took := time.Since(start); took > 200*time.Millisecond+100*time.Millisecond*scale {
			t.Fatalf("took %v, the ctx was 200ms", took)
		}
		// A Campaign that waits for the session being made shares it once
		// it is there.
		resB := etCampaignAsync(testCtx(t), b, "b")
		px.Unblackhole()
		for _, r := range []etResult{etWait(t, res), etWait(t, resB)} {
			if r.err != nil {
				t.Fatalf("Campaign: %v", r.err)
			}
		}
		if etSession(a) != etSession(b) {
			t.Fatal("two sessions made for two keys")
		}
		ptStats(t, p, PoolStats{Elections: 2, Sessions: 1, Leading: 2, TTL: time.Second})
	})
	t.Run("Close cuts short a Campaign stuck making a session", func(t *testing.T) {
		_, p, _, res := ptStuck(t)
		start := time.Now()
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took > 2*time.Second*scale {
			t.Fatalf("Close took %v", took)
		}
		if r := etWait(t, res); !errors.Is(r.err, ErrClosed) {
			t.Fatalf("Campaign cut short by Close: %v, want ErrClosed", r.err)
		}
	})
	t.Run("Close of a pooled leader cut off ends its shared session, so that its key goes with the lease", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		ttl := time.Second * scale
		p := ptPool(t, px.NewClient(t), PoolOptions{TTL: ttl})
		e := ptElection(t, p, etKey)
		etCampaign(t, e, "a")
		s, key := etSession(e), e.current().key
		px.Blackhole()
		start := time.Now()
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took > ttl+100*time.Millisecond*scale {
			t.Fatalf("Close took %v, want about the TTL %v at most", took, ttl)
		}
		waitClosed(t, s.ctx.Done(), "the shared session")
		px.Unblackhole()
		etWaitCount(t, cli, key, 0)
	})
	t.Run("Close closes every election, revokes the sessions, and refuses what comes after", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second})
		a := ptElection(t, p, etKey)
		b := ptElection(t, p, etKey+"-b")
		etCampaign(t, a, "a")
		etCampaign(t, b, "b")
		lease := etSession(a).id
		done := a.Done()
		waiter := etElection(t, srv.NewClient(t), ElectionOptions{})
		res := etCampaignAsync(testCtx(t), waiter, "waiter")
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		for i := 0; i < 2; i++ {
			if err := p.Close(); err != nil {
				t.Fatalf("Close #%d: %v", i+1, err)
			}
		}
		if ttl := etTTL(t, cli, lease); ttl != -1 {
			t.Fatalf("lease %x TTL %d after Close, want -1", int64(lease), ttl)
		}
		if n := keyCount(t, cli, etKey+"-b/"); n != 0 {
			t.Fatalf("%d keys left under %s-b/", n, etKey)
		}
		waitClosed(t, done, "Done")
		if r := etWait(t, res); r.err != nil || !waiter.IsLeader() {
			t.Fatalf("waiter: %v", r.err)
		}
		ptStats(t, p, PoolStats{Closed: true, TTL: 2 * time.Second})
		if _, err := p.Election(testCtx(t), etKey+"-c"); !errors.Is(err, ErrClosed) {
			t.Fatalf("Election after Close: %v, want ErrClosed", err)
		}
		if err := a.Campaign(testCtx(t), "a"); !errors.Is(err, ErrClosed) {
			t.Fatalf("Campaign of a pooled Election after Close: %v, want ErrClosed", err)
		}
	})
	t.Run("a Campaign whose ctx ends while its put is on the way takes the key back once the put lands; the shared session lives on", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		hcli, hooks := etHookedClient(t, px.ClientConfig())
		p := ptPool(t, hcli, PoolOptions{TTL: 3 * time.Second * scale})
		keep := ptElection(t, p, etKey+"-keep")
		etCampaign(t, keep, "keep")
		e := ptElection(t, p, etKey)
		ctx, cancel := context.WithCancel(testCtx(t))
		defer cancel()
		wch := cli.Watch(ctx, etPrefix, clientv3.WithPrefix())
		// The put is held on the link until after Campaign gave up.
		sent := make(chan struct{})
		hooks.on("/etcdserverpb.KV/Txn", func() { px.Pause(); close(sent) })
		cctx, stop := context.WithCancel(ctx)
		res := etCampaignAsync(cctx, e, "a")
		<-sent
		stop()
		if r := etWait(t, res); !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Campaign: %v, want context.Canceled", r.err)
		}
		// A new candidacy waits until that put is settled: the delete that
		// settles it must not take the new candidacy's key.
		short, stopShort := context.WithTimeout(ctx, 100*time.Millisecond)
		defer stopShort()
		if err := e.Campaign(short, "a"); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Campaign while the earlier put is unsettled: %v, want DeadlineExceeded", err)
		}
		px.Unpause()
		var seen []string
		for len(seen) < 2 {
			select {
			case wr := <-wch:
				for _, ev := range wr.Events {
					seen = append(seen, ev.Type.String())
				}
			case <-time.After(patience()):
				t.Fatalf("saw %v of our key, want its put and its delete", seen)
			}
		}
		if !slices.Equal(seen, []string{"PUT", "DELETE"}) {
			t.Fatalf("saw %v of our key, want its put and its delete", seen)
		}
		if etSession(keep).ctx.Err() != nil || !keep.IsLeader() {
			t.Fatal("the shared session ended")
		}
	})
	t.Run("bad input is refused and nothing is written", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		for _, ttl := range []time.Duration{-time.Second, 1500 * time.Millisecond} {
			if p, err := NewElectionPool(cli, PoolOptions{TTL: ttl}); p != nil || !errors.Is(err, ErrInvalidTTL) {
				t.Fatalf("TTL %v: %v, %v; want ErrInvalidTTL", ttl, p, err)
			}
		}
		if p, err := NewElectionPool(cli, PoolOptions{KeysPerSession: -1}); p != nil || !errors.Is(err, ErrInvalidKeysPerSession) {
			t.Fatalf("KeysPerSession -1: %v, %v; want ErrInvalidKeysPerSession", p, err)
		}
		if p, err := NewElectionPool(nil, PoolOptions{}); p != nil || !errors.Is(err, ErrNilClient) {
			t.Fatalf("nil client: %v, %v; want ErrNilClient", p, err)
		}
		p := ptPool(t, cli, PoolOptions{})
		ptStats(t, p, PoolStats{TTL: DefaultPoolTTL})
		if _, err := p.Election(ctx, "a/"); !errors.Is(err, ErrInvalidKey) {
			t.Fatalf("key a/: %v, want ErrInvalidKey", err)
		}
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		if _, err := p.Election(cancelled, etKey); !errors.Is(err, context.Canceled) {
			t.Fatalf("Election with an ended ctx: %v, want context.Canceled", err)
		}
		if n := keyCount(t, cli, ""); n != 0 {
			t.Fatalf("%d keys written", n)
		}
		if ls := ptLeases(t, cli); len(ls) != 0 {
			t.Fatalf("leases %v; want none", ls)
		}
	})
}

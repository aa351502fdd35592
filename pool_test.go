package coord

import (
	"context"
	"errors"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ptPool returns a pool on cli, closed at the end of the test.
func ptPool(t *testing.T, cli *clientv3.Client, opts PoolOptions) *ElectionPool {
	t.Helper()
	p := NewElectionPool(cli, opts)
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

// ptExpire revokes e's session lease through cli, as another agent would,
// and waits until the session has noticed.
func ptExpire(t *testing.T, cli *clientv3.Client, e *Election) *session {
	t.Helper()
	s := etSession(e)
	etRevoke(t, cli, s.id)
	etClosed(t, s.ctx.Done(), "the revoked session")
	return s
}

func TestElectionPool(t *testing.T) {
	t.Run("returns the same Election for a key and another for another key", func(t *testing.T) {
		_, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second})
		a := ptElection(t, p, etKey)
		if again := ptElection(t, p, etKey); again != a {
			t.Fatal("another Election for the same key")
		}
		b := ptElection(t, p, etKey+"-other")
		if b == a || a.Key() != etKey || b.Key() != etKey+"-other" {
			t.Fatalf("keys %q and %q", a.Key(), b.Key())
		}
		if etSession(a).id == etSession(b).id {
			t.Fatal("two keys share a session")
		}
		ptStats(t, p, PoolStats{Sessions: 2, TTL: 2 * time.Second})
	})
	t.Run("an Election outlives the ctx it was made with", func(t *testing.T) {
		_, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second, Identity: "pooled"})
		ctx, cancel := context.WithCancel(testCtx(t))
		e, err := p.Election(ctx, etKey)
		if err != nil {
			t.Fatal(err)
		}
		lease := etSession(e).id
		cancel()
		etCampaign(t, e, "")
		if got, err := e.Leader(testCtx(t)); err != nil || got != "pooled" {
			t.Fatalf("Leader = %q, %v; want pooled", got, err)
		}
		// Still the session made under the ended ctx.
		if got := clientv3.LeaseID(etCands(t, cli)[0].Lease); got != lease {
			t.Fatalf("leads on lease %x, want %x", int64(got), int64(lease))
		}
		if ttl := etTTL(t, cli, lease); ttl <= 0 {
			t.Fatalf("lease TTL %d", ttl)
		}
	})
	t.Run("a pooled Election's Close does nothing", func(t *testing.T) {
		_, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second})
		e := ptElection(t, p, etKey)
		etCampaign(t, e, "a")
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		etOpen(t, e.Done(), "Done after a pooled Close")
		if !e.IsLeader() || len(etCands(t, cli)) != 1 {
			t.Fatal("a pooled Close ended leadership")
		}
		if again := ptElection(t, p, etKey); again != e {
			t.Fatal("another Election after a pooled Close")
		}
		if err := e.Proclaim(testCtx(t), "b"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("an expired session is replaced on the next Election call", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: time.Second})
		e := ptElection(t, p, etKey)
		old := ptExpire(t, srv.NewClient(t), e)
		ptStats(t, p, PoolStats{Sessions: 0, TTL: time.Second})
		if again := ptElection(t, p, etKey); again != e {
			t.Fatal("another Election after the session expired")
		}
		s := etSession(e)
		if s.id == old.id || s.ctx.Err() != nil {
			t.Fatalf("session lease %x (old %x), ended %v", int64(s.id), int64(old.id), s.ctx.Err())
		}
		ptStats(t, p, PoolStats{Sessions: 1, TTL: time.Second})
		etCampaign(t, e, "a")
		if got := clientv3.LeaseID(etCands(t, cli)[0].Lease); got != s.id {
			t.Fatalf("leads on lease %x, want %x", int64(got), int64(s.id))
		}
		ptStats(t, p, PoolStats{Sessions: 1, Leading: 1, TTL: time.Second})
	})
	t.Run("Election fails when an expired session cannot be replaced, and tries again next time", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: time.Second})
		e := ptElection(t, p, etKey)
		ptExpire(t, srv.NewClient(t), e)
		ctx, cancel := context.WithCancel(testCtx(t))
		cancel()
		if _, err := p.Election(ctx, etKey); !errors.Is(err, context.Canceled) {
			t.Fatalf("Election with an ended ctx: %v, want context.Canceled", err)
		}
		if again := ptElection(t, p, etKey); again != e || etSession(e).ctx.Err() != nil {
			t.Fatal("the session was not replaced")
		}
	})
	t.Run("Election while a Campaign on that key waits returns at once", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second})
		leader := etElection(t, srv.NewClient(t), ElectionOptions{})
		etCampaign(t, leader, "leader")
		e := ptElection(t, p, etKey)
		res := etCampaignAsync(testCtx(t), e, "pooled")
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		// An Election call that waited for the Campaign would run into
		// this deadline.
		ctx, cancel := context.WithTimeout(testCtx(t), 2*time.Second*scale)
		defer cancel()
		if again, err := p.Election(ctx, etKey); err != nil || again != e {
			t.Fatalf("Election while campaigning: %v", err)
		}
		ptStats(t, p, PoolStats{Sessions: 1, TTL: 2 * time.Second})
		if err := leader.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if r := etWait(t, res); r.err != nil {
			t.Fatal(r.err)
		}
		ptStats(t, p, PoolStats{Sessions: 1, Leading: 1, TTL: 2 * time.Second})
	})
	t.Run("Stats counts sessions and leaders", func(t *testing.T) {
		srv, cli := newEtcd(t)
		ptStats(t, ptPool(t, cli, PoolOptions{}), PoolStats{TTL: DefaultPoolTTL})
		p := ptPool(t, cli, PoolOptions{TTL: time.Second})
		ptStats(t, p, PoolStats{TTL: time.Second})
		a := ptElection(t, p, etKey)
		b := ptElection(t, p, etKey+"-b")
		ptStats(t, p, PoolStats{Sessions: 2, TTL: time.Second})
		etCampaign(t, a, "a")
		ptStats(t, p, PoolStats{Sessions: 2, Leading: 1, TTL: time.Second})
		ptExpire(t, srv.NewClient(t), b)
		ptStats(t, p, PoolStats{Sessions: 1, Leading: 1, TTL: time.Second})
		p.Close()
		ptStats(t, p, PoolStats{Closed: true, TTL: time.Second})
	})
	t.Run("Close resigns and releases every pooled election", func(t *testing.T) {
		srv, cli := newEtcd(t)
		p := ptPool(t, cli, PoolOptions{TTL: 2 * time.Second})
		a := ptElection(t, p, etKey)
		b := ptElection(t, p, etKey+"-b")
		etCampaign(t, a, "a")
		etCampaign(t, b, "b")
		leases := []clientv3.LeaseID{etSession(a).id, etSession(b).id}
		done := a.Done()
		waiter := etElection(t, srv.NewClient(t), ElectionOptions{})
		res := etCampaignAsync(testCtx(t), waiter, "waiter")
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		for i := 0; i < 2; i++ {
			if err := p.Close(); err != nil {
				t.Fatalf("Close #%d: %v", i+1, err)
			}
		}
		// Released by the time Close returns.
		for _, id := range leases {
			if ttl := etTTL(t, cli, id); ttl != -1 {
				t.Fatalf("lease %x TTL %d after Close, want -1", int64(id), ttl)
			}
		}
		if n := keyCount(t, cli, etKey+"-b/"); n != 0 {
			t.Fatalf("%d keys left under %s-b/", n, etKey)
		}
		etClosed(t, done, "Done")
		if r := etWait(t, res); r.err != nil || !waiter.IsLeader() {
			t.Fatalf("waiter: %v", r.err)
		}
		ptStats(t, p, PoolStats{Closed: true, TTL: 2 * time.Second})
		if _, err := p.Election(testCtx(t), etKey); !errors.Is(err, ErrClosed) {
			t.Fatalf("Election after Close: %v, want ErrClosed", err)
		}
		if err := a.Campaign(testCtx(t), "a"); !errors.Is(err, ErrClosed) {
			t.Fatalf("Campaign of a pooled Election after Close: %v, want ErrClosed", err)
		}
	})
	t.Run("Close cuts short an Election call stuck on an unreachable etcd", func(t *testing.T) {
		srv, _ := newEtcd(t)
		px := srv.NewProxy(t)
		p := ptPool(t, px.NewClient(t), PoolOptions{TTL: time.Second})
		px.Blackhole()
		defer px.Unblackhole()
		errc := make(chan error, 1)
		go func() {
			_, err := p.Election(context.Background(), etKey)
			errc <- err
		}()
		etUntil(t, "creating", func() bool {
			if p.mu.TryLock() {
				p.mu.Unlock()
				return false
			}
			return true
		})
		start := time.Now()
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took > 2*time.Second*scale {
			t.Fatalf("Close took %v", took)
		}
		select {
		case err := <-errc:
			if !errors.Is(err, ErrClosed) {
				t.Fatalf("Election: %v, want ErrClosed", err)
			}
		case <-time.After(patience()):
			t.Fatal("Election did not return")
		}
	})
	t.Run("bad options are reported by Election and nothing is written", func(t *testing.T) {
		_, cli := newEtcd(t)
		ctx := testCtx(t)
		for _, ttl := range []time.Duration{-time.Second, 1500 * time.Millisecond} {
			p := ptPool(t, cli, PoolOptions{TTL: ttl})
			if _, err := p.Election(ctx, etKey); !errors.Is(err, ErrInvalidTTL) {
				t.Fatalf("TTL %v: %v, want ErrInvalidTTL", ttl, err)
			}
			ptStats(t, p, PoolStats{TTL: ttl})
		}
		if _, err := ptPool(t, nil, PoolOptions{}).Election(ctx, etKey); !errors.Is(err, ErrNilClient) {
			t.Fatalf("nil client: %v, want ErrNilClient", err)
		}
		if _, err := ptPool(t, cli, PoolOptions{}).Election(ctx, "a/"); !errors.Is(err, ErrInvalidKey) {
			t.Fatalf("key a/: %v, want ErrInvalidKey", err)
		}
		if n := keyCount(t, cli, ""); n != 0 {
			t.Fatalf("%d keys written", n)
		}
		if ls, err := cli.Leases(ctx); err != nil || len(ls.Leases) != 0 {
			t.Fatalf("leases %v, %v; want none", ls, err)
		}
	})
}

package coord

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/coordtest"
	"github.com/go-coord/coord/internal/testenv"
)

// smKey is the semaphore key of the tests: each test has an etcd of its own.
const smKey = "/coord/test/semaphore"

// smPrefix is where the permits of smKey live.
const smPrefix = smKey + "/"

// smSemaphore joins the semaphore opts.Key (default smKey, Limit 2, TTL
// 2 s × scale) on cli and closes it at the end of the test.
func smSemaphore(t *testing.T, cli *clientv3.Client, opts SemaphoreOptions) *Semaphore {
	t.Helper()
	if opts.Key == "" {
		opts.Key = smKey
	}
	if opts.Limit == 0 {
		opts.Limit = 2
	}
	if opts.TTL == 0 {
		// Stretched on a slow CPU: on riscv64 under emulation a holder's
		// 2 s lease expired under the other tests' load.
		opts.TTL = 2 * time.Second * scale
	}
	s, err := NewSemaphore(testCtx(t), cli, opts)
	if err != nil {
		t.Fatalf("NewSemaphore: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// smAcquire takes a permit of s, failing the test otherwise.
func smAcquire(t *testing.T, s *Semaphore) *Permit {
	t.Helper()
	p, err := s.Acquire(testCtx(t))
	if err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	if !isClosed(p.Done()) && p.Err() != nil {
		t.Fatalf("Acquire returned a permit with Err %v", p.Err())
	}
	return p
}

// smResult is the outcome of an Acquire run in the background.
type smResult struct {
	p   *Permit
	err error
	at  time.Time // when Acquire returned
}

// smAcquireAsync runs s.Acquire(ctx) in the background.
func smAcquireAsync(ctx context.Context, s *Semaphore) <-chan smResult {
	ch := make(chan smResult, 1)
	go func() {
		p, err := s.Acquire(ctx)
		ch <- smResult{p, err, time.Now()}
	}()
	return ch
}

// smQueue starts an Acquire of s in ctx and waits until n permit keys
// are there, its own last.
func smQueue(t *testing.T, ctx context.Context, cli *clientv3.Client, s *Semaphore, n int64) <-chan smResult {
	t.Helper()
	res := smAcquireAsync(ctx, s)
	etWaitCount(t, cli, smPrefix, n, clientv3.WithPrefix())
	return res
}

// smGot returns the permit of a background Acquire, failing the test
// unless it returns one within patience.
func smGot(t *testing.T, res <-chan smResult) smResult {
	t.Helper()
	r := receive(t, res, "Acquire")
	if r.err != nil {
		t.Fatalf("Acquire: %v", r.err)
	}
	return r
}

// smWaiting fails the test if a background Acquire has returned.
func smWaiting(t *testing.T, res <-chan smResult) {
	t.Helper()
	select {
	case r := <-res:
		t.Fatalf("Acquire returned while every permit is held: %v", r.err)
	default:
	}
}

// smRelease releases p, and checks that its key is gone when it returns.
func smRelease(t *testing.T, cli *clientv3.Client, p *Permit) {
	t.Helper()
	if err := p.Release(testCtx(t)); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if resp, err := cli.Get(testCtx(t), p.l.key); err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("after Release, the permit key: %v, %v", resp, err)
	}
}

// smRev returns etcd's revision.
func smRev(t *testing.T, cli *clientv3.Client) int64 {
	t.Helper()
	resp, err := cli.Get(testCtx(t), "/")
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

func TestSemaphore(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("permits are granted first come, first served, each with a token of its own", func(t *testing.T) {
		srv, cli := newEtcd(t)
		sig := &signals{}
		a := smSemaphore(t, cli, SemaphoreOptions{Identity: "a", OnSignal: sig.hook})
		b := smSemaphore(t, srv.NewClient(t), SemaphoreOptions{Identity: "b"})
		c := smSemaphore(t, srv.NewClient(t), SemaphoreOptions{Identity: "c"})
		// One process may hold several.
		p1, p2 := smAcquire(t, a), smAcquire(t, a)
		if p1.l.key == p2.l.key || p2.Token() <= p1.Token() {
			t.Fatalf("two permits of one semaphore: keys %q %q, tokens %d %d", p1.l.key, p2.l.key, p1.Token(), p2.Token())
		}
		ctx := testCtx(t)
		rb := smQueue(t, ctx, cli, b, 3)
		rc := smQueue(t, ctx, cli, c, 4)
		hs, err := c.Holders(testCtx(t))
		if want := []Holder{{"a", p1.Token()}, {"a", p2.Token()}}; err != nil || !slices.Equal(hs, want) {
			t.Fatalf("Holders: %v, %v; want %v", hs, err, want)
		}
		smRelease(t, cli, p1)
		pb := smGot(t, rb).p
		smWaiting(t, rc)
		smRelease(t, cli, p2)
		pc := smGot(t, rc).p
		if pb.Token() <= p2.Token() || pc.Token() <= pb.Token() {
			t.Fatalf("tokens %d then %d, %d: want them increasing", p2.Token(), pb.Token(), pc.Token())
		}
		hs, err = a.Holders(testCtx(t))
		if want := []Holder{{"b", pb.Token()}, {"c", pc.Token()}}; err != nil || !slices.Equal(hs, want) {
			t.Fatalf("Holders: %v, %v; want %v", hs, err, want)
		}
		if got := sig.of(SignalPermitAcquired); len(got) != 2 || got[0].Token != p1.Token() || got[0].Key != smKey {
			t.Fatalf("permit-acquired signals %+v", got)
		}
		if got := sig.waitFor(t, SignalPermitReleased, 2); got.Token != p2.Token() {
			t.Fatalf("permit-released signal %+v", got)
		}
	})

	t.Run("the Limit is stored by the first; another Limit fails and writes nothing", func(t *testing.T) {
		_, cli := newEtcd(t)
		smSemaphore(t, cli, SemaphoreOptions{Limit: 3})
		if resp, err := cli.Get(testCtx(t), smKey); err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "3" || resp.Kvs[0].Lease != 0 {
			t.Fatalf("the limit key: %v, %v", resp, err)
		}
		smSemaphore(t, cli, SemaphoreOptions{Limit: 3})
		rev := smRev(t, cli)
		_, err := NewSemaphore(testCtx(t), cli, SemaphoreOptions{Key: smKey, Limit: 2})
		if !errors.Is(err, ErrLimitMismatch) {
			t.Fatalf("NewSemaphore with another Limit: %v, want ErrLimitMismatch", err)
		}
		if got := smRev(t, cli); got != rev {
			t.Fatalf("NewSemaphore with another Limit wrote: revision %d, was %d", got, rev)
		}
		if leases, err := cli.Leases(testCtx(t)); err != nil || len(leases.Leases) != 2 {
			t.Fatalf("leases %v, %v: want the two semaphores'", leases, err)
		}
	})

	t.Run("TryAcquire when every permit is held fails at once and leaves nothing", func(t *testing.T) {
		srv, cli := newEtcd(t)
		a := smSemaphore(t, cli, SemaphoreOptions{Limit: 1})
		b := smSemaphore(t, srv.NewClient(t), SemaphoreOptions{Limit: 1})
		p, err := a.TryAcquire(testCtx(t))
		if err != nil {
			t.Fatalf("TryAcquire of a free permit: %v", err)
		}
		if _, err := b.TryAcquire(testCtx(t)); !errors.Is(err, ErrNoPermit) {
			t.Fatalf("TryAcquire when full: %v, want ErrNoPermit", err)
		}
		if kvs := candidates(t, cli, smPrefix); len(kvs) != 1 || kvs[0].CreateRevision != p.Token() {
			t.Fatalf("after a TryAcquire that failed, keys %v", kvs)
		}
	})

	t.Run("Release ends the permit once its key is gone", func(t *testing.T) {
		_, cli := newEtcd(t)
		s := smSemaphore(t, cli, SemaphoreOptions{})
		p := smAcquire(t, s)
		guard, done := p.Guard(), p.Done()
		if !etGuarded(t, cli, guard) || p.Err() != nil {
			t.Fatalf("while held: Guard fails, or Err %v", p.Err())
		}
		smRelease(t, cli, p)
		if !isClosed(done) || !isClosed(p.Done()) || !errors.Is(p.Err(), ErrReleased) {
			t.Fatalf("after Release: Done closed %v, Err %v", isClosed(done), p.Err())
		}
		if etGuarded(t, cli, guard) || etGuarded(t, cli, p.Guard()) {
			t.Fatal("a write under the Guard succeeded after Release")
		}
		if err := p.Release(testCtx(t)); err != nil {
			t.Fatalf("Release again: %v", err)
		}
	})

	t.Run("Release that cannot reach etcd within ctx returns, and the key goes in the background", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		ttl := 3 * time.Second * scale
		s := smSemaphore(t, px.NewClient(t), SemaphoreOptions{TTL: ttl})
		p := smAcquire(t, s)
		px.Blackhole()
		defer px.Unblackhole()
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		t0 := time.Now()
		if err := p.Release(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Release cut off: %v, want the deadline", err)
		}
		if d := time.Since(t0); d > 100*time.Millisecond+sdSlack() {
			t.Fatalf("Release cut off returned after %v", d)
		}
		px.Unblackhole()
		etWaitCount(t, cli, smPrefix, 0, clientv3.WithPrefix())
	})

	t.Run("Release whose delete etcd refuses fails, and the session ends to take the key", func(t *testing.T) {
		srv, cli := newEtcd(t)
		hcli, hooks := etHookedClient(t, srv.ClientConfig())
		s := smSemaphore(t, hcli, SemaphoreOptions{})
		p := smAcquire(t, s)
		hooks.onErr("/etcdserverpb.KV/Txn", func() error { return rpctypes.ErrPermissionDenied })
		if err := p.Release(testCtx(t)); !errors.Is(err, rpctypes.ErrPermissionDenied) {
			t.Fatalf("Release refused: %v", err)
		}
		etWaitCount(t, cli, smPrefix, 0, clientv3.WithPrefix())
		// The next Acquire runs on a new session.
		if q := smAcquire(t, s); q.l.sess == p.l.sess {
			t.Fatal("Acquire after the session ended used it")
		}
	})

	t.Run("a crashed holder's slot frees when its lease expires", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		ttl := 2 * time.Second * scale
		a := smSemaphore(t, px.NewClient(t), SemaphoreOptions{Limit: 1, TTL: ttl})
		b := smSemaphore(t, cli, SemaphoreOptions{Limit: 1, TTL: ttl})
		p := smAcquire(t, a)
		res := smQueue(t, testCtx(t), cli, b, 2)
		// Nothing more reaches etcd from the holder, as after a crash.
		px.Blackhole()
		defer px.Unblackhole()
		smGot(t, res)
		if got := etTTL(t, cli, p.l.sess.id); got != -1 {
			t.Fatalf("the crashed holder's lease has TTL %d after its slot was granted, want -1", got)
		}
	})

	t.Run("a waiting Acquire whose lease is revoked queues again on a new session", func(t *testing.T) {
		srv, cli := newEtcd(t)
		a := smSemaphore(t, cli, SemaphoreOptions{Limit: 1})
		b := smSemaphore(t, srv.NewClient(t), SemaphoreOptions{Limit: 1})
		p := smAcquire(t, a)
		res := smQueue(t, testCtx(t), cli, b, 2)
		first := candidates(t, cli, smPrefix)[1]
		etRevoke(t, cli, clientv3.LeaseID(first.Lease))
		eventually(t, "b queued again", func() bool {
			kvs := candidates(t, cli, smPrefix)
			return len(kvs) == 2 && kvs[1].Lease != first.Lease
		})
		smWaiting(t, res)
		smRelease(t, cli, p)
		if q := smGot(t, res).p; q.l.sess.id == clientv3.LeaseID(first.Lease) {
			t.Fatal("permit held on the revoked lease")
		}
	})

	t.Run("an Acquire waiting on the session of a permit revoked from outside gets no permit on the dead lease", func(t *testing.T) {
		// One session holds the permit and the waiting candidacy; the
		// revoke deletes both keys in one revision, the permit's first.
		_, cli := newEtcd(t)
		s := smSemaphore(t, cli, SemaphoreOptions{Limit: 1})
		p := smAcquire(t, s)
		res := smQueue(t, testCtx(t), cli, s, 2)
		dead := p.l.sess.id
		etRevoke(t, cli, dead)
		waitClosed(t, p.Done(), "the revoked permit's Done")
		q := smGot(t, res).p
		if q.l.sess.id == dead {
			t.Fatalf("Acquire returned permit %d on the revoked lease %s", q.Token(), hexID(dead))
		}
		resp, err := cli.Txn(testCtx(t)).If(q.Guard()).Commit()
		if err != nil || !resp.Succeeded {
			t.Fatalf("the new permit's Guard: %v, %v", resp, err)
		}
	})

	t.Run("a waiting Acquire cut off from etcd waits through the outage and queues again", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		a := smSemaphore(t, cli, SemaphoreOptions{Limit: 1})
		tap, log := newLogTap()
		b := smSemaphore(t, px.NewClient(t), SemaphoreOptions{Limit: 1, TTL: time.Second, Logger: log})
		p := smAcquire(t, a)
		res := smAcquireAsync(testCtx(t), b)
		// Cut off once b waits, not while its put is on the way.
		tap.wait(t, "coord: acquire waits for its turn", 1)
		old := etSemSession(b)
		bKey := string(candidates(t, cli, smPrefix)[1].Key)
		px.Blackhole()
		// etcd expires the lease, and the key with it.
		etWaitCount(t, cli, bKey, 0)
		smWaiting(t, res)
		px.Unblackhole()
		// etcd says the lease is gone: b queues again on a new one.
		waitClosed(t, old.ctx.Done(), "the cut-off session")
		eventually(t, "queued again", func() bool { return len(candidates(t, cli, smPrefix)) == 2 })
		smRelease(t, cli, p)
		if q := smGot(t, res).p; q.l.sess == old {
			t.Fatal("permit held on the cut-off session")
		}
	})

	t.Run("an Acquire that fails returns within its ctx and leaves no key", func(t *testing.T) {
		srv, cli := newEtcd(t)
		a := smSemaphore(t, cli, SemaphoreOptions{Limit: 1})
		px := srv.NewProxy(t)
		b := smSemaphore(t, px.NewClient(t), SemaphoreOptions{Limit: 1})
		smAcquire(t, a)
		// Waiting in line.
		d := 300 * time.Millisecond * scale
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		res := smQueue(t, ctx, cli, b, 2)
		r := receive(t, res, "Acquire")
		if !errors.Is(r.err, context.DeadlineExceeded) || r.p != nil {
			t.Fatalf("Acquire past its deadline: %v, %v", r.p, r.err)
		}
		if dl, _ := ctx.Deadline(); r.at.Sub(dl) > sdSlack() {
			t.Fatalf("Acquire returned %v after its deadline", r.at.Sub(dl))
		}
		etWaitCount(t, cli, smPrefix, 1, clientv3.WithPrefix())
		// Cut off: the put may land after the Acquire gave up.
		px.Blackhole()
		ctx, cancel = context.WithTimeout(context.Background(), d)
		defer cancel()
		t0 := time.Now()
		if _, err := b.Acquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Acquire cut off: %v", err)
		}
		if took := time.Since(t0); took > d+sdSlack() {
			t.Fatalf("Acquire cut off returned after %v, its ctx lasted %v", took, d)
		}
		px.Unblackhole()
		etWaitCount(t, cli, smPrefix, 1, clientv3.WithPrefix())
		// TryAcquire given up while its put is on its way.
		px.Delay(d)
		defer px.Delay(0)
		ctx, cancel = context.WithTimeout(context.Background(), d/3)
		defer cancel()
		if _, err := b.TryAcquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("TryAcquire delayed: %v", err)
		}
		px.Delay(0)
		etWaitCount(t, cli, smPrefix, 1, clientv3.WithPrefix())
	})

	t.Run("calls given a ctx that ended fail at once and write nothing", func(t *testing.T) {
		_, cli := newEtcd(t)
		s := smSemaphore(t, cli, SemaphoreOptions{})
		rev := smRev(t, cli)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := s.Acquire(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("Acquire: %v", err)
		}
		if _, err := s.TryAcquire(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("TryAcquire: %v", err)
		}
		if _, err := s.Holders(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("Holders: %v", err)
		}
		if got := smRev(t, cli); got != rev {
			t.Fatalf("revision %d, was %d", got, rev)
		}
		p := smAcquire(t, s)
		rev = smRev(t, cli)
		if err := p.Release(ctx); !errors.Is(err, context.Canceled) || isClosed(p.Done()) {
			t.Fatalf("Release: %v, Done closed %v", err, isClosed(p.Done()))
		}
		if got := smRev(t, cli); got != rev {
			t.Fatalf("revision %d, was %d", got, rev)
		}
	})

	t.Run("Close ends every permit and waiting Acquire, and leaves no key", func(t *testing.T) {
		srv, cli := newEtcd(t)
		s := smSemaphore(t, cli, SemaphoreOptions{Limit: 2})
		other := smSemaphore(t, srv.NewClient(t), SemaphoreOptions{Limit: 2})
		p1, p2 := smAcquire(t, s), smAcquire(t, s)
		res := smQueue(t, testCtx(t), cli, s, 3)
		wait := smQueue(t, testCtx(t), cli, other, 4)
		s.Close()
		if r := receive(t, res, "Acquire"); !errors.Is(r.err, ErrClosed) {
			t.Fatalf("Acquire waiting at Close: %v", r.err)
		}
		for _, p := range []*Permit{p1, p2} {
			if !isClosed(p.Done()) || !errors.Is(p.Err(), ErrClosed) {
				t.Fatalf("after Close: Done closed %v, Err %v", isClosed(p.Done()), p.Err())
			}
		}
		smGot(t, wait)
		if kvs := candidates(t, cli, smPrefix); len(kvs) != 1 || kvs[0].Lease == int64(p1.l.sess.id) {
			t.Fatalf("after Close, keys %v", kvs)
		}
		if _, err := s.Acquire(testCtx(t)); !errors.Is(err, ErrClosed) {
			t.Fatalf("Acquire after Close: %v", err)
		}
		if _, err := s.Holders(testCtx(t)); !errors.Is(err, ErrClosed) {
			t.Fatalf("Holders after Close: %v", err)
		}
		if err := p1.Release(testCtx(t)); !errors.Is(err, ErrClosed) {
			t.Fatalf("Release after Close: %v", err)
		}
		s.Close()
	})

	t.Run("a closed client ends the permits", func(t *testing.T) {
		srv, _ := newEtcd(t)
		c := srv.NewClient(t)
		s := smSemaphore(t, c, SemaphoreOptions{})
		p := smAcquire(t, s)
		c.Close()
		waitClosed(t, p.Done(), "Done")
		if !errors.Is(p.Err(), ErrClientClosed) {
			t.Fatalf("Err %v, want ErrClientClosed", p.Err())
		}
		if _, err := s.Acquire(testCtx(t)); !errors.Is(err, ErrClientClosed) {
			t.Fatalf("Acquire on a closed client: %v", err)
		}
		if err := p.Release(testCtx(t)); !errors.Is(err, ErrClientClosed) {
			t.Fatalf("Release on a closed client: %v", err)
		}
	})

	t.Run("a permit key deleted ends the permit", func(t *testing.T) {
		_, cli := newEtcd(t)
		s := smSemaphore(t, cli, SemaphoreOptions{})
		p := smAcquire(t, s)
		if _, err := cli.Delete(testCtx(t), p.l.key); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, p.Done(), "Done")
		if err := p.Err(); !errors.Is(err, ErrPermitLost) || !errors.Is(err, ErrLeadershipLost) || !errors.Is(err, errPermitKeyDeleted) ||
			!strings.HasPrefix(err.Error(), "coord: permit lost: ") {
			t.Fatalf("Err %v, want ErrPermitLost (and ErrLeadershipLost): permit key deleted", err)
		}
		if err := p.Release(testCtx(t)); err != nil {
			t.Fatalf("Release of a lost permit: %v", err)
		}
	})

	t.Run("Acquires waiting for a new session wait within their ctx", func(t *testing.T) {
		srv, cli := newEtcd(t)
		px := srv.NewProxy(t)
		s := smSemaphore(t, px.NewClient(t), SemaphoreOptions{})
		etRevoke(t, cli, etSemSession(s).id)
		waitClosed(t, etSemSession(s).ctx.Done(), "the revoked session")
		// The new session's grant hangs: one Acquire starts it, the other
		// waits for it.
		px.Blackhole()
		defer px.Unblackhole()
		starter := smAcquireAsync(testCtx(t), s)
		eventually(t, "a session being started", func() bool {
			s.mu.Lock()
			defer s.mu.Unlock()
			return s.starting != nil
		})
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		if _, err := s.Acquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Acquire waiting for the session: %v", err)
		}
		px.Unblackhole()
		smGot(t, starter)
	})
}

// etSemSession returns s's current session.
func etSemSession(s *Semaphore) *session {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sess
}

func TestNewSemaphore(t *testing.T) {
	srv, cli := newEtcd(t)
	rev := smRev(t, cli)
	for _, tc := range []struct {
		name string
		cli  *clientv3.Client
		opts SemaphoreOptions
		want error
	}{
		{"a nil client", nil, SemaphoreOptions{Key: smKey, Limit: 1}, ErrNilClient},
		{"an empty key", cli, SemaphoreOptions{Limit: 1}, ErrInvalidKey},
		{"a key with a trailing /", cli, SemaphoreOptions{Key: smPrefix, Limit: 1}, ErrInvalidKey},
		{"no limit", cli, SemaphoreOptions{Key: smKey}, ErrInvalidLimit},
		{"a negative limit", cli, SemaphoreOptions{Key: smKey, Limit: -1}, ErrInvalidLimit},
		{"a TTL of a fraction of a second", cli, SemaphoreOptions{Key: smKey, Limit: 1, TTL: 1500 * time.Millisecond}, ErrInvalidTTL},
	} {
		t.Run(tc.name+" is refused and nothing is written", func(t *testing.T) {
			if s, err := NewSemaphore(testCtx(t), tc.cli, tc.opts); !errors.Is(err, tc.want) || s != nil {
				t.Fatalf("NewSemaphore: %v, %v; want %v", s, err, tc.want)
			}
		})
	}
	if got := smRev(t, cli); got != rev {
		t.Fatalf("bad input wrote: revision %d, was %d", got, rev)
	}

	t.Run("a ctx that ended writes nothing", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := NewSemaphore(ctx, cli, SemaphoreOptions{Key: smKey, Limit: 1}); !errors.Is(err, context.Canceled) {
			t.Fatalf("NewSemaphore: %v", err)
		}
		if got := smRev(t, cli); got != rev {
			t.Fatalf("revision %d, was %d", got, rev)
		}
	})

	t.Run("a session that cannot be had fails it", func(t *testing.T) {
		hcli, hooks := etHookedClient(t, srv.ClientConfig())
		hooks.onErr("/etcdserverpb.Lease/LeaseGrant", func() error { return rpctypes.ErrPermissionDenied })
		if _, err := NewSemaphore(testCtx(t), hcli, SemaphoreOptions{Key: smKey, Limit: 1}); !errors.Is(err, rpctypes.ErrPermissionDenied) {
			t.Fatalf("NewSemaphore: %v", err)
		}
	})

	t.Run("the default TTL and identity", func(t *testing.T) {
		s, err := NewSemaphore(testCtx(t), cli, SemaphoreOptions{Key: "/coord/test/defaults", Limit: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		if s.ttl != DefaultSemaphoreTTL || s.identity == "" || s.Key() != "/coord/test/defaults" {
			t.Fatalf("TTL %v, identity %q, key %q", s.ttl, s.identity, s.Key())
		}
	})
}

// TestSemaphoreStepDown: a permit cut off from etcd ends two thirds of the
// TTL after its last answered renewal, before etcd can expire its lease
// and grant its slot to another, however the link fails.
func TestSemaphoreStepDown(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	for _, shape := range []struct {
		name string
		cut  func(p *coordtest.Proxy, ttl time.Duration) (undo func())
	}{
		{"silent", func(p *coordtest.Proxy, _ time.Duration) func() { p.Blackhole(); return p.Unblackhole }},
		{"paused link", func(p *coordtest.Proxy, _ time.Duration) func() { p.Pause(); return p.Unpause }},
		{"slow", func(p *coordtest.Proxy, ttl time.Duration) func() { p.Delay(ttl / 2); return func() { p.Delay(0) } }},
		// Every connection is reset as soon as it is made, so that each
		// try fails at once, for half the TTL; then the link is silent.
		{"failing fast then silent", func(p *coordtest.Proxy, ttl time.Duration) func() {
			p.Blackhole()
			stop := mdResets(p, ttl/2)
			return func() { stop(); p.Unblackhole() }
		}},
	} {
		t.Run(shape.name, func(t *testing.T) {
			t.Parallel()
			srv, cli := newEtcd(t)
			px := srv.NewProxy(t)
			ttl := 3 * time.Second * scale
			tap, log := newLogTap()
			tap.dumpOnFailure(t)
			a := smSemaphore(t, px.NewClient(t), SemaphoreOptions{Limit: 2, TTL: ttl, Logger: log})
			b := smSemaphore(t, cli, SemaphoreOptions{Limit: 2, TTL: ttl})
			p1, p2 := smAcquire(t, a), smAcquire(t, a)
			res := smQueue(t, testCtx(t), cli, b, 3)
			guard := p1.Guard()
			t.Cleanup(shape.cut(px, ttl))
			waitClosed(t, p1.Done(), "Done of the permit cut off")
			stepped := time.Now()
			waitClosed(t, p2.Done(), "Done of the other permit cut off")
			last := p1.l.sess.k.lastAnswer()
			after := stepped.Sub(last)
			if limit := 2*ttl/3 + sdSlack(); after > limit {
				t.Errorf("stepped down %v after the last answered renewal, want at most %v", after, limit)
			}
			if !errors.Is(p1.Err(), ErrLeadershipLost) || !errors.Is(p1.Err(), errUnanswered) {
				t.Errorf("Err %v, want ErrLeadershipLost: renewals unanswered", p1.Err())
			}
			r := smGot(t, res)
			margin := r.at.Sub(stepped)
			t.Logf("shape %s: stepped down %v after last answer (2/3 TTL = %v), successor acquired %v later (%.0f ms); %d renewal tries failed",
				shape.name, after.Round(time.Millisecond), 2*ttl/3, margin.Round(time.Millisecond), float64(margin)/float64(time.Millisecond),
				tap.count("coord: lease renewal failed"))
			if margin <= 0 {
				t.Errorf("the successor acquired %v before the permit cut off ended", -margin)
			}
			if etGuarded(t, cli, guard) || etGuarded(t, cli, p1.Guard()) {
				t.Error("a write under the Guard of the permit cut off succeeded")
			}
		})
	}
}

// The helper process of the paused-holder test: smChild, run by TestMain
// when childEnv is smChildRole. It holds a permit of smKey (Limit 1) on
// the etcd at sdEndpointEnv, says so on stdout ("holding token=T
// lease=L"), then answers commands read from stdin, a line each, until
// stdin ends:
//
//	state  "state done=B stepped=NS last=NS": whether Done is closed,
//	       judged at once without a call to etcd; how long the Done
//	       captured while holding then took to close, in ns (-1: not
//	       within sdSlack); the wall time of the last answered renewal.
//	guard  "guard captured=B now=B": whether a write under the Guard
//	       captured while holding, and under Guard now, succeeds.
//
// On error it prints "error ..." and exits.
const smChildRole = "stepdown-holder"

func smChild() int {
	fail := func(what string, err error) int {
		fmt.Printf("error %s: %v\n", what, err)
		return 1
	}
	ttl, err := time.ParseDuration(os.Getenv(sdTTLEnv))
	if err != nil {
		return fail("TTL", err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{os.Getenv(sdEndpointEnv)}, DialTimeout: coordtest.ClientDialTimeout})
	if err != nil {
		return fail("client", err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), patience())
	defer cancel()
	s, err := NewSemaphore(ctx, cli, SemaphoreOptions{Key: smKey, Limit: 1, TTL: ttl, Identity: "child",
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		return fail("semaphore", err)
	}
	defer s.Close()
	p, err := s.Acquire(ctx)
	if err != nil {
		return fail("acquire", err)
	}
	guard, done := p.Guard(), p.Done()
	fmt.Printf("holding token=%d lease=%x\n", p.Token(), int64(p.l.sess.id))
	guarded := func(cmp clientv3.Cmp) (bool, error) {
		resp, err := cli.Txn(ctx).If(cmp).Then(clientv3.OpPut("/coord/test/fenced", "child")).Commit()
		return err == nil && resp.Succeeded, err
	}
	for in := bufio.NewScanner(os.Stdin); in.Scan(); {
		switch in.Text() {
		case "state":
			read, closed, stepped := time.Now(), isClosed(p.Done()), time.Duration(-1)
			if closedWithinSlack(done) {
				stepped = time.Since(read)
			}
			fmt.Printf("state done=%t stepped=%d last=%d\n", closed, stepped, p.l.sess.k.lastAnswer().UnixNano())
		case "guard":
			captured, err := guarded(guard)
			if err != nil {
				return fail("write under the captured Guard", err)
			}
			now, err := guarded(p.Guard())
			if err != nil {
				return fail("write under Guard", err)
			}
			fmt.Printf("guard captured=%t now=%t\n", captured, now)
		default:
			return fail("command", fmt.Errorf("unknown %q", in.Text()))
		}
	}
	return 0
}

// closedWithinSlack reports whether c is closed within sdSlack.
func closedWithinSlack(c <-chan struct{}) bool {
	timer := time.NewTimer(sdSlack())
	defer timer.Stop()
	select {
	case <-c:
		return true
	case <-timer.C:
		return false
	}
}

// TestSemaphorePausedHolder: a holder whose process is paused past the
// 2/3 mark finds, on resuming, that its permit ended, before any call to
// etcd; its successor was granted the slot only after its lease expired,
// and its Guard no longer holds.
func TestSemaphorePausedHolder(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	srv, cli := newEtcd(t)
	px := srv.NewProxy(t)
	ttl := 2 * time.Second * scale
	b := smSemaphore(t, cli, SemaphoreOptions{Limit: 1, TTL: ttl})
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), childEnv+"="+smChildRole, sdEndpointEnv+"="+px.Endpoint(), sdTTLEnv+"="+ttl.String())
	child, err := sdStart(env, exe)
	if errors.Is(err, syscall.ENOEXEC) {
		// Under user-mode emulation, run it under the same emulator (see
		// sdStartChild).
		if emu, lerr := exec.LookPath(testenv.Emulator()); lerr == nil {
			child, err = sdStart(env, emu, exe)
		}
	}
	if err != nil {
		t.Fatalf("starting the helper process: %v", err)
	}
	t.Cleanup(func() {
		_ = child.cmd.Process.Kill()
		close(child.quit)
		<-child.read
		_ = child.cmd.Wait()
		if t.Failed() {
			t.Logf("helper process's stderr:\n%s", child.stderr.String())
		}
	})
	var token, lease int64
	child.expect(t, "holding token=%d lease=%x", &token, &lease)
	guard := clientv3.Compare(clientv3.CreateRevision(smPrefix+hexID(clientv3.LeaseID(lease))+"-1"), "=", token)
	res := smQueue(t, testCtx(t), cli, b, 2)
	child.signal(t, syscall.SIGSTOP)
	r := smGot(t, res)
	if got := etTTL(t, cli, clientv3.LeaseID(lease)); got != -1 {
		t.Fatalf("the paused holder's lease has TTL %d after the successor acquired, want -1", got)
	}
	// No renewal can be answered while it judges whether it holds.
	px.Pause()
	child.send(t, "state")
	child.signal(t, syscall.SIGCONT)
	var done bool
	var stepped, last int64
	child.expect(t, "state done=%t stepped=%d last=%d", &done, &stepped, &last)
	px.Unpause()
	child.send(t, "guard")
	var captured, now bool
	child.expect(t, "guard captured=%t now=%t", &captured, &now)
	margin := r.at.Sub(time.Unix(0, last).Add(2 * ttl / 3))
	t.Logf("paused holder: on resume Done closed %v (the captured Done within %v: %v); successor acquired %v (%.0f ms) after the 2/3 mark",
		done, sdSlack(), stepped >= 0, margin.Round(time.Millisecond), float64(margin)/float64(time.Millisecond))
	if !done || stepped < 0 {
		t.Errorf("on resume: Done closed %v, the captured Done closed within %v: %v; want both", done, sdSlack(), stepped >= 0)
	}
	if margin <= 0 {
		t.Errorf("the successor acquired %v before the 2/3 mark after the last answer", -margin)
	}
	if captured || now || etGuarded(t, srv.NewClient(t), guard) {
		t.Errorf("a write under the paused holder's Guard succeeded: captured %v, now %v", captured, now)
	}
}

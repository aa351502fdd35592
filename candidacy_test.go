package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/go-coord/coord/coordtest"
)

// The promises of the candidacy shared by Election, Semaphore and
// ShardSet: a waiter holds only on a delete that frees its place now, not
// on one of an earlier term of a key of the same name, whatever member
// its watch sits on.

// lagSplit is a 3-member cluster with a member, iso, to be cut off, and
// clients whose unary calls go to another member, healthy.
type lagSplit struct {
	c       *coordtest.Cluster
	iso     *coordtest.Member
	healthy *coordtest.Member
}

func newLagSplit(t *testing.T) *lagSplit {
	t.Helper()
	c := coordtest.NewCluster(t, 3)
	leader := c.Leader(testCtx(t))
	s := &lagSplit{c: c, healthy: leader}
	for _, m := range c.Members() {
		if m != leader {
			s.iso = m
			break
		}
	}
	return s
}

// client returns a client of the healthy member; with lagging, its
// watches go to iso instead (as clientv3 does by itself with several
// endpoints: its unary calls rotate over the members while its watch
// stream stays on the member it first reached).
func (s *lagSplit) client(t *testing.T, lagging bool) *clientv3.Client {
	t.Helper()
	cli := s.healthy.NewClient(t)
	if lagging {
		cli.Watcher = clientv3.NewWatcher(s.iso.NewClient(t))
	}
	return cli
}

// heal heals iso and waits until it has applied what the others have: a
// linearizable read through it answers at the cluster's revision.
func (s *lagSplit) heal(t *testing.T, cli *clientv3.Client) {
	t.Helper()
	rev := mustRev(t, cli)
	s.iso.Heal()
	isoCli := s.iso.NewClient(t)
	eventually(t, s.iso.Name()+" caught up", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second*scale)
		defer cancel()
		g, err := isoCli.Get(ctx, "probe")
		return err == nil && g.Header.Revision >= rev
	})
}

// mustRev returns etcd's current revision.
func mustRev(t *testing.T, cli *clientv3.Client) int64 {
	t.Helper()
	g, err := cli.Get(testCtx(t), "probe")
	if err != nil {
		t.Fatal(err)
	}
	return g.Header.Revision
}

// lagWaiter runs a waiting call (a Campaign or an Acquire) and says when
// it returns.
type lagWaiter struct {
	done chan struct{}
	err  error
	both bool // whether, as it returned, its Guard and those ahead held at once
}

// startWaiter runs f; as it returns, both(), a Txn on the Guards of the
// holders and of the waiter, says whether they held at once.
func startWaiter(f func() error, both func() bool) *lagWaiter {
	w := &lagWaiter{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		if w.err = f(); w.err == nil {
			w.both = both()
		}
	}()
	return w
}

// mustStillWait deletes the waiter's candidate key (probe) and checks
// that the waiter queues again rather than returning: deletes reach its
// watch in etcd's order, so once it has seen the probe's it has seen
// every delete before, the replayed ones of a lagging member included.
func mustStillWait(t *testing.T, cli *clientv3.Client, tap *logTap, ask string, w *lagWaiter, probe string) {
	t.Helper()
	queued := tap.count("coord: " + ask + " queues again")
	if _, err := cli.Delete(testCtx(t), probe); err != nil {
		t.Fatal(err)
	}
	select {
	case <-w.done:
		t.Fatalf("the waiter returned (err %v) while those ahead of it still held (all their Guards and its own held at once: %v)", w.err, w.both)
	case <-waitLog(tap, "coord: "+ask+" queues again", queued+1):
	case <-time.After(patience()):
		t.Fatal("the waiter neither returned nor queued again after its key was deleted")
	}
}

// waitLog returns a channel closed once tap has n records of msg (or at
// patience's end).
func waitLog(tap *logTap, msg string, n int) <-chan struct{} {
	c := make(chan struct{})
	go func() {
		defer close(c)
		tap.reached(msg, n)
	}()
	return c
}

// guardsHold reports whether every comparison holds at once, asking
// again while etcd cannot tell (false if it cannot within patience).
func guardsHold(cli *clientv3.Client, cmps ...clientv3.Cmp) bool {
	deadline := time.Now().Add(patience())
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second*scale)
		resp, err := cli.Txn(ctx).If(cmps...).Commit()
		cancel()
		if err == nil || time.Now().After(deadline) {
			return err == nil && resp.Succeeded
		}
	}
}

// candidateOf returns the candidate key under prefix whose value is v.
func candidateOf(t *testing.T, cli *clientv3.Client, prefix, v string) string {
	t.Helper()
	for _, kv := range candidates(t, cli, prefix) {
		if string(kv.Value) == v {
			return string(kv.Key)
		}
	}
	t.Fatalf("no candidate %q under %s", v, prefix)
	return ""
}

func TestCandidacyLaggingWatch(t *testing.T) {
	t.Run("an election's waiter whose watch sits on a lagging member does not take the replayed delete of the leader's earlier term for its turn", func(t *testing.T) {
		s := newLagSplit(t)
		lagElection(t, s, s.client(t, true))
	})

	t.Run("a semaphore's waiter whose watch sits on a lagging member does not take the replayed delete of a holder's earlier candidacy for a free permit", func(t *testing.T) {
		s := newLagSplit(t)
		const key = "/lag/semaphore"
		opts := SemaphoreOptions{Key: key, Limit: 2, TTL: 5 * time.Second * scale}
		sem := func(cli *clientv3.Client, id string, log *slog.Logger) *Semaphore {
			o := opts
			o.Identity, o.Logger = id, log
			sm, err := NewSemaphore(testCtx(t), cli, o)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { sm.Close() })
			return sm
		}
		cli := s.healthy.NewClient(t)
		aTap, aLog := newLogTap()
		h1, h2, a := sem(s.client(t, false), "h1", nil), sem(s.client(t, false), "h2", nil), sem(s.client(t, false), "a", aLog)
		p1 := mustPermit(t, h1)
		p2 := mustPermit(t, h2)
		wa := startWaiter(func() error {
			_, err := a.Acquire(testCtx(t))
			return err
		}, func() bool { return false })
		aTap.wait(t, "coord: acquire waits for its turn", 1)
		s.iso.Isolate()
		// a's candidacy queues again under the same key name: iso sees
		// neither the delete nor the new put.
		queued := aTap.count("coord: acquire queues again")
		if _, err := cli.Delete(testCtx(t), candidateOf(t, cli, key+"/", "a")); err != nil {
			t.Fatal(err)
		}
		aTap.wait(t, "coord: acquire queues again", queued+1)
		aTap.wait(t, "coord: acquire waits for its turn", 2)
		if err := p1.Release(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		<-wa.done
		if wa.err != nil {
			t.Fatal(wa.err)
		}
		aKey := candidateOf(t, cli, key+"/", "a")

		bTap, bLog := newLogTap()
		bTap.dumpOnFailure(t)
		b := sem(s.client(t, true), "b", bLog)
		ctx, cancel := context.WithCancel(testCtx(t))
		defer cancel()
		aGuard := candidateGuard(t, cli, aKey)
		var pb *Permit
		wb := startWaiter(func() (err error) {
			pb, err = b.Acquire(ctx)
			return err
		}, func() bool { return guardsHold(cli, p2.Guard(), aGuard, pb.Guard()) })
		bTap.wait(t, "coord: acquire waits for its turn", 1)
		s.heal(t, cli)
		mustStillWait(t, cli, bTap, "acquire", wb, candidateOf(t, cli, key+"/", "b"))
		if err := p2.Release(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		<-wb.done
		if wb.err != nil {
			t.Fatal(wb.err)
		}
	})

	t.Run("a shard set's standby whose watch sits on a lagging member does not take the replayed delete of the owner's earlier term for its turn", func(t *testing.T) {
		s := newLagSplit(t)
		cli := s.healthy.NewClient(t)
		shard := shRankedAs("host-a", "host-b")
		l := newShLedger()
		opts := ShardOptions{Shards: []string{shard}, Replicas: 2, TTL: 5 * time.Second * scale}
		aCli := s.client(t, false)
		register(t, aCli, "host-a", LivenessOptions{TTL: 5 * time.Second * scale})
		a := shSet(t, aCli, "host-a", l, opts)
		l.waitEvent(t, 0, SignalShardAcquired, "host-a", shard)
		s.iso.Isolate()
		// The owner's key deleted: its term ends, and it campaigns again
		// on the same session, under the same key name. iso sees neither.
		prefix := ShardsPrefix + shard + "/"
		mark := l.mark()
		if _, err := cli.Delete(testCtx(t), candidateOf(t, cli, prefix, "host-a")); err != nil {
			t.Fatal(err)
		}
		l.waitEvent(t, mark, SignalShardAcquired, "host-a", shard)
		owned := a.Owned()

		// b joins: a standby, its watches on iso.
		bCli := s.client(t, true)
		register(t, bCli, "host-b", LivenessOptions{TTL: 5 * time.Second * scale})
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		bOpts := opts
		bOpts.Logger = log
		b := shSet(t, bCli, "host-b", l, bOpts)
		tap.wait(t, "coord: campaign waits for its turn", 1)
		s.heal(t, cli)
		queued := tap.count("coord: campaign queues again")
		if _, err := cli.Delete(testCtx(t), candidateOf(t, cli, prefix, "host-b")); err != nil {
			t.Fatal(err)
		}
		eventually(t, "b queueing again, or owning the shard", func() bool {
			return tap.count("coord: campaign queues again") > queued || len(b.Owned()) > 0
		})
		if got := b.Owned(); len(got) != 0 {
			t.Fatalf("b owns %v while a owns %v: a's Guard holds: %v, b's: %v", got, owned,
				guardsHold(cli, owned[0].Guard), guardsHold(cli, got[0].Guard))
		}
		if evs := l.since(mark, SignalShardAcquired); len(evs) != 1 {
			t.Fatalf("acquired since a's key was deleted: %v, want a's alone", evs)
		}
	})
}

// lagElection: leader a on the healthy member, waiter b on bCli, whose
// watches sit on iso; iso is cut off while a resigns and campaigns
// again (the same key name), then healed; b must wait for a's resign.
func lagElection(t *testing.T, s *lagSplit, bCli *clientv3.Client) {
	t.Helper()
	const key = "/lag/election"
	a, err := NewElection(testCtx(t), s.client(t, false), ElectionOptions{Key: key, TTL: 5 * time.Second * scale})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	tap, log := newLogTap()
	tap.dumpOnFailure(t)
	b, err := NewElection(testCtx(t), bCli, ElectionOptions{Key: key, TTL: 5 * time.Second * scale, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	cli := s.healthy.NewClient(t)

	if err := a.Campaign(testCtx(t), "a"); err != nil {
		t.Fatal(err)
	}
	s.iso.Isolate()
	// A second term on the same session: the same key name, a new
	// create revision. iso has seen neither the resign nor the put.
	first := a.Token()
	if err := a.Resign(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := a.Campaign(testCtx(t), "a"); err != nil {
		t.Fatal(err)
	}
	if a.Token() == first {
		t.Fatal("the second term has the first one's token")
	}
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	w := startWaiter(func() error { return b.Campaign(ctx, "b") }, func() bool {
		return guardsHold(cli, a.Guard(), b.Guard())
	})
	tap.wait(t, "coord: campaign waits for its turn", 1)
	s.heal(t, cli)
	mustStillWait(t, cli, tap, "campaign", w, candidateOf(t, cli, key+"/", "b"))

	// The leader resigns: the waiter leads, alone.
	guard := a.Guard()
	if err := a.Resign(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	<-w.done
	if w.err != nil {
		t.Fatal(w.err)
	}
	if guardsHold(cli, guard) || !guardsHold(cli, b.Guard()) {
		t.Fatal("after the resign, the old leader's Guard holds or the new one's does not")
	}
}

// mustPermit acquires a permit that must be free.
func mustPermit(t *testing.T, s *Semaphore) *Permit {
	t.Helper()
	p, err := s.TryAcquire(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// candidateGuard returns a comparison that holds while key stands with
// the create revision it has now.
func candidateGuard(t *testing.T, cli *clientv3.Client, key string) clientv3.Cmp {
	t.Helper()
	g, err := cli.Get(testCtx(t), key)
	if err != nil || len(g.Kvs) == 0 {
		t.Fatalf("get %s: %v (%d keys)", key, err, len(g.Kvs))
	}
	return clientv3.Compare(clientv3.CreateRevision(key), "=", g.Kvs[0].CreateRevision)
}

// rangeDeleted checks a term ended by a range delete of its key: Done
// closed, Err wrapping ErrLeadershipLost and saying the key was deleted.
func rangeDeleted(t *testing.T, what string, done <-chan struct{}, err func() error) {
	t.Helper()
	waitClosed(t, done, what+"'s Done after the range delete")
	if e := err(); !errors.Is(e, ErrLeadershipLost) || !strings.Contains(e.Error(), "key deleted") {
		t.Fatalf("%s's Err after the range delete: %v, want ErrLeadershipLost, key deleted", what, e)
	}
}

func TestCandidacyRangeDelete(t *testing.T) {
	// etcd deletes a range in one revision, in key order: the waiter
	// sees the holder's key go and its own in the same revision. Keys
	// are named after their leases, granted in order: the holder's
	// sorts first.
	t.Run("after a del --prefix of an election, the waiter does not lead on a key that is gone, the leader sees its key go, and the next leader's Guard holds", func(t *testing.T) {
		for _, pooled := range []bool{false, true} {
			srv, cli := newEtcd(t)
			const key = "/rd/election"
			elect := func() *Election {
				c := srv.NewClient(t)
				if !pooled {
					e, err := NewElection(testCtx(t), c, ElectionOptions{Key: key, TTL: 5 * time.Second * scale})
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { e.Close() })
					return e
				}
				p, err := NewElectionPool(c, PoolOptions{TTL: 5 * time.Second * scale})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { p.Close() })
				e, err := p.Election(testCtx(t), key)
				if err != nil {
					t.Fatal(err)
				}
				return e
			}
			l := elect()
			if err := l.Campaign(testCtx(t), "l"); err != nil {
				t.Fatal(err)
			}
			tap, log := newLogTap()
			tap.dumpOnFailure(t)
			w := elect()
			w.log = log
			w.c.log = log
			ctx, cancel := context.WithCancel(testCtx(t))
			defer cancel()
			wt := startWaiter(func() error { return w.Campaign(ctx, "w") }, func() bool { return guardsHold(cli, w.Guard()) })
			tap.wait(t, "coord: campaign waits for its turn", 1)
			if _, err := cli.Delete(testCtx(t), key+"/", clientv3.WithPrefix()); err != nil {
				t.Fatal(err)
			}
			rangeDeleted(t, "the leader", l.Done(), l.Err)
			<-wt.done
			if wt.err != nil || !wt.both {
				t.Fatalf("pooled %v: the waiter's Campaign returned %v, its Guard holding: %v", pooled, wt.err, wt.both)
			}
			if !w.IsLeader() || isClosed(w.Done()) || !guardsHold(cli, w.Guard()) {
				t.Fatalf("pooled %v: the new leader does not lead on a key that stands", pooled)
			}
		}
	})

	t.Run("after a del --prefix of a semaphore's key, the waiter gets no permit on a key that is gone and the holder's permit ends", func(t *testing.T) {
		srv, cli := newEtcd(t)
		const key = "/rd/semaphore"
		sem := func() *Semaphore {
			s, err := NewSemaphore(testCtx(t), srv.NewClient(t), SemaphoreOptions{Key: key, Limit: 1, TTL: 5 * time.Second * scale})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		}
		h, w := sem(), sem()
		p := mustPermit(t, h)
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		w.log = log
		var pw *Permit
		ctx, cancel := context.WithCancel(testCtx(t))
		defer cancel()
		wt := startWaiter(func() (err error) {
			pw, err = w.Acquire(ctx)
			return err
		}, func() bool { return guardsHold(cli, pw.Guard()) })
		tap.wait(t, "coord: acquire waits for its turn", 1)
		if _, err := cli.Delete(testCtx(t), key+"/", clientv3.WithPrefix()); err != nil {
			t.Fatal(err)
		}
		rangeDeleted(t, "the holder", p.Done(), p.Err)
		<-wt.done
		if wt.err != nil || !wt.both {
			t.Fatalf("the waiter's Acquire returned %v, its Guard holding: %v", wt.err, wt.both)
		}
		if isClosed(pw.Done()) || pw.Err() != nil {
			t.Fatal("the waiter's permit ended")
		}
		if _, err := h.TryAcquire(testCtx(t)); !errors.Is(err, ErrNoPermit) {
			t.Fatalf("a second permit of Limit 1: %v, want ErrNoPermit", err)
		}
	})
}

// deleteFaults makes a client's deletes (Txns that delete) fail as a
// member without a leader answers them, before they reach etcd: the next
// n of them, or all of them until a time.
type deleteFaults struct {
	mu     sync.Mutex
	n      int
	until  time.Time
	failed int
}

// client returns a client of srv whose deletes go through f.
func (f *deleteFaults) client(t *testing.T, cfg clientv3.Config) *clientv3.Client {
	t.Helper()
	return interceptedClient(t, cfg, f.intercept)
}

func (f *deleteFaults) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if txn, ok := req.(*pb.TxnRequest); ok && deletes(txn) && f.fail() {
		return rpctypes.ErrGRPCNoLeader
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// deletes reports whether a Txn deletes when it succeeds.
func deletes(txn *pb.TxnRequest) bool {
	for _, op := range txn.Success {
		if op.GetRequestDeleteRange() != nil {
			return true
		}
	}
	return false
}

func (f *deleteFaults) fail() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n > 0 || time.Now().Before(f.until) {
		f.n--
		f.failed++
		return true
	}
	return false
}

// set makes the next n deletes fail, and every one for d.
func (f *deleteFaults) set(n int, d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n, f.until = n, time.Now().Add(d)
}

// count returns how many deletes failed.
func (f *deleteFaults) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failed
}

func TestCandidacyTransientDelete(t *testing.T) {
	t.Parallel()
	// The shapes of the fault: one delete refused, and every delete
	// refused for longer than a call's ctx.
	shapes := []struct {
		name string
		n    int
		d    time.Duration
	}{{"once", 1, 0}, {"for 1.5 s", 0, 1500 * time.Millisecond * scale}}
	const ttl = 5 * time.Second
	// lead returns n elections of a pool on one shared session, each
	// leading its own key, the pool's client failing deletes as f says.
	lead := func(t *testing.T, srv *coordtest.Server, f *deleteFaults, n int) []*Election {
		t.Helper()
		p, err := NewElectionPool(f.client(t, srv.ClientConfig()), PoolOptions{TTL: ttl * scale})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		var es []*Election
		for i := range n {
			e, err := p.Election(testCtx(t), fmt.Sprintf("/td/k%d", i))
			if err != nil {
				t.Fatal(err)
			}
			if err := e.Campaign(testCtx(t), "x"); err != nil {
				t.Fatal(err)
			}
			es = append(es, e)
		}
		if st := p.Stats(); st.Sessions != 1 {
			t.Fatalf("%d sessions, want 1", st.Sessions)
		}
		return es
	}
	// survive checks that every term on the session still holds.
	survive := func(t *testing.T, cli *clientv3.Client, f *deleteFaults, what string, guards ...func() clientv3.Cmp) {
		t.Helper()
		if f.count() == 0 {
			t.Fatalf("%s: no delete failed", what)
		}
		for i, g := range guards {
			if !guardsHold(cli, g()) {
				t.Fatalf("%s: term %d of the shared session ended after %d deletes failed", what, i, f.count())
			}
		}
	}
	for _, sh := range shapes {
		t.Run("a pooled Election's Resign and Close, and the withdrawal of a waiting campaign, that meet "+sh.name+" a transient error end no other term of the shared session", func(t *testing.T) {
			t.Parallel() // each case on its own etcd
			srv, cli := newEtcd(t)
			f := &deleteFaults{}
			es := lead(t, srv, f, 4)
			others := []func() clientv3.Cmp{es[2].Guard, es[3].Guard}

			f.set(sh.n, sh.d)
			if err := es[0].Resign(testCtx(t)); err != nil {
				t.Fatalf("Resign: %v", err)
			}
			if n := keyCount(t, cli, "/td/k0/"); n != 0 {
				t.Fatalf("Resign returned with %d keys left", n)
			}
			survive(t, cli, f, "resign", append(others, es[1].Guard)...)

			// A campaign waits behind another client's leader; its
			// withdrawal meets the fault.
			other, err := NewElection(testCtx(t), cli, ElectionOptions{Key: "/td/w", TTL: ttl * scale})
			if err != nil {
				t.Fatal(err)
			}
			defer other.Close()
			if err := other.Campaign(testCtx(t), "other"); err != nil {
				t.Fatal(err)
			}
			p := es[0].pool
			w, err := p.Election(testCtx(t), "/td/w")
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(testCtx(t))
			defer cancel()
			wt := startWaiter(func() error { return w.Campaign(ctx, "w") }, func() bool { return false })
			eventually(t, "the waiter's key", func() bool { return keyCount(t, cli, "/td/w/") == 2 })
			f.set(sh.n, sh.d)
			cancel()
			<-wt.done
			waitClosed(t, w.c.settling(), "the withdrawal settled")
			if n := keyCount(t, cli, "/td/w/"); n != 1 {
				t.Fatalf("withdrawn: %d keys under /td/w/, want the other leader's alone", n)
			}
			survive(t, cli, f, "withdraw", append(others, es[1].Guard)...)

			f.set(sh.n, sh.d)
			if err := es[1].Close(); err != nil {
				t.Fatal(err)
			}
			if n := keyCount(t, cli, "/td/k1/"); n != 0 {
				t.Fatalf("Close returned with %d keys left", n)
			}
			survive(t, cli, f, "close", others...)
			w.Close()
		})

		t.Run("a permit's Release that meets "+sh.name+" a transient error ends no other permit of the session", func(t *testing.T) {
			t.Parallel()
			srv, cli := newEtcd(t)
			f := &deleteFaults{}
			s, err := NewSemaphore(testCtx(t), f.client(t, srv.ClientConfig()), SemaphoreOptions{Key: "/td/sem", Limit: 4, TTL: ttl * scale})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			var ps []*Permit
			for range 4 {
				ps = append(ps, mustPermit(t, s))
			}
			f.set(sh.n, sh.d)
			if err := ps[0].Release(testCtx(t)); err != nil {
				t.Fatalf("Release: %v", err)
			}
			if n := keyCount(t, cli, "/td/sem/"); n != 3 {
				t.Fatalf("Release returned with %d keys, want 3", n)
			}
			survive(t, cli, f, "release", ps[1].Guard, ps[2].Guard, ps[3].Guard)
		})
	}
}

// createHold holds back a client's requests to create a watch of deletes
// under prefix (a waiter's), while armed, until released.
type createHold struct {
	prefix  string
	armed   atomic.Bool
	held    chan struct{} // closed once one is held
	release chan struct{}
	once    sync.Once
}

func newCreateHold(prefix string) *createHold {
	return &createHold{prefix: prefix, held: make(chan struct{}), release: make(chan struct{})}
}

func (h *createHold) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return wrapWatch(ctx, desc, cc, method, streamer, opts, func(s grpc.ClientStream) grpc.ClientStream { return &holdStream{ClientStream: s, h: h} })
}

// wrapWatch opens a stream, as a stream interceptor does, and wraps it
// with wrap if it is a watch stream.
func wrapWatch(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts []grpc.CallOption, wrap func(grpc.ClientStream) grpc.ClientStream) (grpc.ClientStream, error) {
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil || method != "/etcdserverpb.Watch/Watch" {
		return s, err
	}
	return wrap(s), nil
}

type holdStream struct {
	grpc.ClientStream
	h *createHold
}

func (s *holdStream) SendMsg(m any) error {
	if cr := m.(*pb.WatchRequest).GetCreateRequest(); cr != nil && string(cr.Key) == s.h.prefix && s.h.armed.Load() {
		s.h.once.Do(func() { close(s.h.held) })
		select {
		case <-s.h.release:
		case <-s.Context().Done():
		}
	}
	return s.ClientStream.SendMsg(m)
}

// recvHold holds, between hold and let, what a client reads of its watch
// streams.
type recvHold struct {
	held    atomic.Bool
	release chan struct{}
	once    sync.Once
}

func (h *recvHold) hold() { h.held.Store(true) }

// let lets what is held be read, and holds no more.
func (h *recvHold) let() { h.once.Do(func() { close(h.release) }) }

func (h *recvHold) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	return wrapWatch(ctx, desc, cc, method, streamer, opts, func(s grpc.ClientStream) grpc.ClientStream { return &recvHoldStream{ClientStream: s, h: h} })
}

type recvHoldStream struct {
	grpc.ClientStream
	h *recvHold
}

func (s *recvHoldStream) RecvMsg(m any) error {
	if s.h.held.Load() {
		select {
		case <-s.h.release:
		case <-s.Context().Done():
		}
	}
	return s.ClientStream.RecvMsg(m)
}

// delayTxn delays the answer to a client's Txns that put under prefix,
// while armed, by d: the put lands, its answer comes late.
type delayTxn struct {
	prefix string
	d      time.Duration
	armed  atomic.Bool
}

func (f *delayTxn) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	if txn, ok := req.(*pb.TxnRequest); ok && f.armed.Load() && puts(txn, f.prefix) {
		select {
		case <-time.After(f.d):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return err
}

// cdHeldPut starts a pool of two elections, prefix/one and prefix/two, on
// a client of srv that holds back the answer of one's candidate put: two
// has campaigned and resigned (the pool has heard etcd), and one's
// Campaign runs in w, its answer held once h.held is closed, until
// h.released is.
func cdHeldPut(t *testing.T, srv *coordtest.Server, prefix string) (h *holdAnswer, s *signals, one, two *Election, w *lagWaiter) {
	t.Helper()
	h = &holdAnswer{prefix: prefix + "/one/", held: make(chan struct{}), released: make(chan struct{})}
	pCli := interceptedClient(t, srv.ClientConfig(), h.intercept)
	s = &signals{}
	pool, err := NewElectionPool(pCli, PoolOptions{TTL: time.Second * scale, OnSignal: s.hook})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	if one, err = pool.Election(testCtx(t), prefix+"/one"); err != nil {
		t.Fatal(err)
	}
	if two, err = pool.Election(testCtx(t), prefix+"/two"); err != nil {
		t.Fatal(err)
	}
	if err := two.Campaign(testCtx(t), "two"); err != nil {
		t.Fatal(err)
	}
	if err := two.Resign(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	h.armed.Store(true)
	w = startWaiter(func() error { return one.Campaign(testCtx(t), "one") }, func() bool { return true })
	return h, s, one, two, w
}

// holdAnswer holds, once armed, the answer of the first Txn that puts a
// key under prefix, until released: it comes after the answers to
// requests sent later.
type holdAnswer struct {
	prefix   string
	armed    atomic.Bool
	held     chan struct{} // closed once an answer is held
	released chan struct{}
}

func (h *holdAnswer) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	if txn, ok := req.(*pb.TxnRequest); ok && puts(txn, h.prefix) && h.armed.CompareAndSwap(true, false) {
		close(h.held)
		<-h.released
	}
	return err
}

// puts reports whether a Txn puts a key under prefix when it succeeds.
func puts(txn *pb.TxnRequest, prefix string) bool {
	for _, op := range txn.Success {
		if p := op.GetRequestPut(); p != nil && strings.HasPrefix(string(p.Key), prefix) {
			return true
		}
	}
	return false
}

func TestCandidacyEdges(t *testing.T) {
	t.Parallel()
	t.Run("a waiter reads who is ahead only once etcd has registered its watch of deletes: a delete in between is not missed", func(t *testing.T) {
		srv, _ := newEtcd(t)
		const key = "/edge/watch"
		h := newCreateHold(key + "/")
		cfg := srv.ClientConfig()
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainStreamInterceptor(h.stream))
		bCli, err := clientv3.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer bCli.Close()
		a, err := NewElection(testCtx(t), srv.NewClient(t), ElectionOptions{Key: key, TTL: 5 * time.Second * scale})
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		b, err := NewElection(testCtx(t), bCli, ElectionOptions{Key: key, TTL: 5 * time.Second * scale})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		if err := a.Campaign(testCtx(t), "a"); err != nil {
			t.Fatal(err)
		}
		h.armed.Store(true)
		w := startWaiter(func() error { return b.Campaign(testCtx(t), "b") }, func() bool { return true })
		waitClosed(t, h.held, "the waiter's watch held back")
		// The leader goes while the waiter's watch is not registered.
		if err := a.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		h.armed.Store(false)
		close(h.release)
		waitClosed(t, w.done, "the waiter leading after the leader resigned")
		if w.err != nil || !b.IsLeader() {
			t.Fatalf("Campaign: %v, leading %v", w.err, b.IsLeader())
		}
	})

	t.Run("a waiter with more than one ahead does not take a delete that comes without its previous version, compacted before etcd sent it, for its turn", func(t *testing.T) {
		srv, cli := newEtcd(t)
		const key = "/edge/prevkv"
		// b's client reads its watch stream only when let: etcd's sending
		// to it stalls (a fixed 64 KiB window: no dynamic window).
		h := &recvHold{release: make(chan struct{})}
		cfg := srv.ClientConfig()
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainStreamInterceptor(h.stream),
			grpc.WithInitialWindowSize(1<<16), grpc.WithInitialConnWindowSize(1<<16))
		bCli, err := clientv3.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer bCli.Close()
		defer h.let() // before bCli closes
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		var es []*Election
		for _, c := range []*clientv3.Client{cli, srv.NewClient(t), bCli} {
			e, err := NewElection(testCtx(t), c, ElectionOptions{Key: key, TTL: 5 * time.Second * scale, Logger: log})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			es = append(es, e)
		}
		a, w, b := es[0], es[1], es[2]
		if err := a.Campaign(testCtx(t), "a"); err != nil {
			t.Fatal(err)
		}
		ww := startWaiter(func() error { return w.Campaign(testCtx(t), "w") }, func() bool { return true })
		tap.wait(t, "coord: campaign waits for its turn", 1)
		bw := startWaiter(func() error { return b.Campaign(testCtx(t), "b") }, func() bool { return true })
		tap.wait(t, "coord: campaign waits for its turn", 2) // behind a and w: more than one ahead
		// On b's watch stream (the same metadata: a watch that requires a
		// leader), a watch that sees a's delete with its previous version,
		// and one of a prefix filled past what the stream's window takes.
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(testCtx(t)))
		defer cancel()
		probe := bCli.Watch(wctx, key+"/", clientv3.WithPrefix(), clientv3.WithFilterPut(), clientv3.WithPrevKV())
		fill := bCli.Watch(wctx, "/edge/fill/", clientv3.WithPrefix(), clientv3.WithCreatedNotify())
		<-fill
		h.hold()
		for i := range 20 {
			if _, err := cli.Put(testCtx(t), fmt.Sprintf("/edge/fill/%02d", i), strings.Repeat("x", 100<<10)); err != nil {
				t.Fatal(err)
			}
		}
		if err := a.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		srv.Compact(testCtx(t))
		h.let()
		waitClosed(t, ww.done, "w leading after a resigned")
		if ww.err != nil || !w.IsLeader() {
			t.Fatalf("w's Campaign: %v, leading %v", ww.err, w.IsLeader())
		}
		var ev *clientv3.Event
		for ev == nil {
			select {
			case wr := <-probe:
				if len(wr.Events) > 0 {
					ev = wr.Events[0]
				}
			case <-time.After(patience()):
				t.Fatal("no delete on the probe's watch")
			}
		}
		if ev.PrevKv != nil {
			t.Fatalf("a's delete came with its previous version (%v): the test did not set up what it tests", ev.PrevKv)
		}
		// b reads who is ahead again: it takes the delete for news only.
		select {
		case <-bw.done:
			t.Fatalf("b's Campaign returned (%v) while w leads: two leaders, both Guards holding: %v", bw.err, bw.both)
		case <-waitLog(tap, "coord: campaign waits for its turn", 3):
		case <-time.After(patience()):
			t.Fatal("b read who is ahead no more")
		}
		if b.IsLeader() {
			t.Fatal("b leads beside w")
		}
	})

	t.Run("a Campaign and an Acquire that wait on an etcd reset queue again on it, and say etcd was replaced", func(t *testing.T) {
		srv, cli := newEtcd(t)
		for range 300 {
			wtPut(t, cli, "/elsewhere/", meta("x"), 0)
		}
		s := &signals{}
		tap, log := newLogTap()
		opts := ElectionOptions{Key: "/edge/reset", TTL: time.Second * scale, OnSignal: s.hook, Logger: log}
		a, err := NewElection(testCtx(t), cli, opts)
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		b, err := NewElection(testCtx(t), srv.NewClient(t), opts)
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		if err := a.Campaign(testCtx(t), "a"); err != nil {
			t.Fatal(err)
		}
		sem := smSemaphore(t, cli, SemaphoreOptions{Key: "/edge/reset-sem", Limit: 1, TTL: time.Second * scale, OnSignal: s.hook})
		smAcquire(t, sem)
		waiter := smSemaphore(t, srv.NewClient(t), SemaphoreOptions{Key: "/edge/reset-sem", Limit: 1, TTL: time.Second * scale, OnSignal: s.hook, Logger: log})
		// Each waits after a read at etcd's revision, past 300.
		bw := startWaiter(func() error { return b.Campaign(testCtx(t), "b") }, func() bool { return true })
		ww := startWaiter(func() error {
			_, err := waiter.Acquire(testCtx(t))
			return err
		}, func() bool { return true })
		// In line, their puts answered: each has heard the old etcd (a put
		// whose answer the reset cuts off is sent again, and its first
		// answer is the new etcd's: nothing went back for it).
		tap.wait(t, "coord: campaign waits for its turn", 1)
		tap.wait(t, "coord: acquire waits for its turn", 1)
		srv.Reset()
		waitClosed(t, bw.done, "b leading on the new etcd")
		waitClosed(t, ww.done, "the waiter's permit on the new etcd")
		if bw.err != nil || ww.err != nil {
			t.Fatalf("Campaign: %v; Acquire: %v", bw.err, ww.err)
		}
		keys := map[string]bool{}
		for _, sig := range s.of(SignalEtcdReplaced) {
			if !errors.Is(sig.Err, errEtcdReplaced) {
				t.Fatalf("signal %+v", sig)
			}
			keys[sig.Key] = true
		}
		if !keys["/edge/reset"] || !keys["/edge/reset-sem"] {
			t.Fatalf("etcd said replaced for %v, want the election and the semaphore", keys)
		}
	})

	t.Run("an answer that comes after a later one, at a lower revision, is no etcd replaced: each answer is judged by what was seen when it was asked", func(t *testing.T) {
		srv, cli := newEtcd(t)
		h, s, one, two, w := cdHeldPut(t, srv, "/edge/order")
		waitClosed(t, h.held, "one's put answered, its answer held")
		for range 5 {
			wtPut(t, cli, "/elsewhere/", meta("x"), 0)
		}
		if err := two.Campaign(testCtx(t), "two"); err != nil {
			t.Fatal(err)
		}
		close(h.released)
		waitClosed(t, w.done, "one leading")
		if w.err != nil || !one.IsLeader() || one.Token() >= two.Token() {
			t.Fatalf("one: %v, leading %v with token %d; two's token %d", w.err, one.IsLeader(), one.Token(), two.Token())
		}
		if sig := s.of(SignalEtcdReplaced); len(sig) != 0 {
			t.Fatalf("etcd said replaced: %+v", sig)
		}
	})

	t.Run("an answer of an etcd since replaced, that comes once the new one was heard, neither says so again nor is followed", func(t *testing.T) {
		srv, _ := newEtcd(t)
		cli := srv.NewClient(t)
		for range 20 {
			wtPut(t, cli, "/elsewhere/", meta("x"), 0)
		}
		h, s, _, two, w := cdHeldPut(t, srv, "/edge/late")
		waitClosed(t, h.held, "one's put answered by the old etcd, its answer held")
		srv.Reset()
		// The pool's session went with the old etcd: two campaigns on a
		// new one, and hears the new etcd.
		eventually(t, "two leading on the new etcd", func() bool {
			return two.Campaign(testCtx(t), "two") == nil
		})
		s.waitFor(t, SignalEtcdReplaced, 1)
		close(h.released)
		waitClosed(t, w.done, "one's Campaign over")
		if err := two.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if err := two.Campaign(testCtx(t), "two"); err != nil {
			t.Fatal(err)
		}
		if sig := s.of(SignalEtcdReplaced); len(sig) != 1 {
			t.Fatalf("etcd said replaced %d times, want once: %+v", len(sig), sig)
		}
	})

	t.Run("a candidate put whose answer comes after its deadline is taken for landed: its key does not stay on the live session", func(t *testing.T) {
		srv, cli := newEtcd(t)
		const key = "/edge/put"
		ttl := time.Second * scale
		f := &delayTxn{prefix: key + "/", d: 2 * ttl}
		cfg := srv.ClientConfig()
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithChainUnaryInterceptor(f.intercept))
		eCli, err := clientv3.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer eCli.Close()
		e, err := NewElection(testCtx(t), eCli, ElectionOptions{Key: key, TTL: ttl})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		f.armed.Store(true)
		ctx, cancel := context.WithTimeout(testCtx(t), ttl/4)
		defer cancel()
		if err := e.Campaign(ctx, "x"); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Campaign: %v, want DeadlineExceeded", err)
		}
		f.armed.Store(false)
		if keyCount(t, cli, key+"/") != 1 {
			t.Fatal("the put did not land")
		}
		eventually(t, "the landed key removed", func() bool { return keyCount(t, cli, key+"/") == 0 })
	})

	t.Run("the Guard of a permit or leadership that ended fails while its key still stands in etcd", func(t *testing.T) {
		srv, cli := newEtcd(t)
		f := &deleteFaults{}
		fCli := f.client(t, srv.ClientConfig())
		s, err := NewSemaphore(testCtx(t), fCli, SemaphoreOptions{Key: "/edge/sem", Limit: 1, TTL: 5 * time.Second * scale})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		// Pooled: a Resign cut short leaves the shared session, and the
		// key on it, alone.
		pool, err := NewElectionPool(fCli, PoolOptions{TTL: 5 * time.Second * scale})
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		e, err := pool.Election(testCtx(t), "/edge/el")
		if err != nil {
			t.Fatal(err)
		}
		p := mustPermit(t, s)
		if err := e.Campaign(testCtx(t), "x"); err != nil {
			t.Fatal(err)
		}
		// Deletes fail for a while: Release and Resign return at their
		// ctx's end, the keys standing, the terms over.
		f.set(0, time.Second*scale)
		ctx, cancel := context.WithTimeout(testCtx(t), 100*time.Millisecond)
		defer cancel()
		if err := p.Release(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Release: %v, want DeadlineExceeded", err)
		}
		ctx, cancel = context.WithTimeout(testCtx(t), 100*time.Millisecond)
		defer cancel()
		if err := e.Resign(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Resign: %v, want DeadlineExceeded", err)
		}
		if keyCount(t, cli, "/edge/sem/") != 1 || keyCount(t, cli, "/edge/el/") != 1 {
			t.Fatal("a key went: the delete did not fail")
		}
		if pg, eg := guardsHold(cli, p.Guard()), guardsHold(cli, e.Guard()); pg || eg {
			t.Fatalf("the Guard of an ended term holds while its key stands: permit's %v, leadership's %v (%v)", pg, eg, p.Guard())
		}
		eventually(t, "the keys removed once deletes pass", func() bool {
			return keyCount(t, cli, "/edge/sem/")+keyCount(t, cli, "/edge/el/") == 0
		})
	})
}

func TestCandidacyShardSetFaults(t *testing.T) {
	t.Parallel()
	t.Run("after a del --prefix of a shard set's whole Prefix, members included, every shard is owned again by its top member alone, each Guard holding", func(t *testing.T) {
		srv, l, shards, hosts := shFleet(t, 8, 3)
		shStartAll(t, l, hosts, ShardOptions{Shards: shards, TTL: 5 * time.Second * scale})
		cli := srv.Client()
		// Each shard's election, then the whole Prefix, members
		// included.
		for _, sh := range append(slices.Clone(shards), "") {
			p := ShardsPrefix
			if sh != "" {
				p += sh + "/"
			}
			if _, err := cli.Delete(testCtx(t), p, clientv3.WithPrefix()); err != nil {
				t.Fatal(err)
			}
		}
		// The terms seen ending, and new ones begun, every shard is its
		// top member's again, on a key that stands (a phantom owner
		// would keep a gone key's shard for good).
		top := shTops(shards, shIDsOf(hosts))
		eventually(t, "every shard owned by its top member alone, its Guard holding", func() bool {
			owners := shOwners(hosts)
			for _, sh := range shards {
				if !slices.Equal(owners[sh], []string{top[sh]}) {
					return false
				}
			}
			for _, h := range hosts {
				for _, sh := range h.set.Owned() {
					if !guardsHold(cli, sh.Guard) {
						return false
					}
				}
			}
			return true
		})
	})

	t.Run("a handoff whose resign meets a transient error ends no other Run of the member", func(t *testing.T) {
		srv, l, shards, hosts := shFleet(t, 8, 2)
		f := &deleteFaults{}
		a, c := hosts[0], hosts[1]
		// a alone owns every shard, on one shared session.
		ended := map[string]error{} // why each Run of a ended, by shard
		var mu sync.Mutex
		opts := ShardOptions{Shards: shards, Replicas: 1, TTL: 5 * time.Second * scale, Run: func(ctx context.Context, s Shard) {
			<-ctx.Done()
			mu.Lock()
			ended[s.Name] = context.Cause(ctx)
			mu.Unlock()
		}}
		a.set = shSet(t, f.client(t, srv.ClientConfig()), a.id, l, opts)
		l.until(t, "a owning every shard", func() bool { return len(a.set.Owned()) == len(shards) })
		// c joins: a hands over the shards c ranks first, each resign
		// meeting "no leader" once.
		f.set(len(shards), 0)
		mark := l.mark()
		c.start(t, l, ShardOptions{Shards: shards, Replicas: 1, TTL: 5 * time.Second * scale})
		moved := shTops(shards, []string{a.id, c.id})
		for _, s := range shards {
			if moved[s] == c.id {
				l.waitEvent(t, mark, SignalShardAcquired, c.id, s)
			}
		}
		if f.count() == 0 {
			t.Fatal("no delete failed")
		}
		mu.Lock()
		defer mu.Unlock()
		for _, s := range shards {
			if err, ok := ended[s]; ok && moved[s] == a.id {
				t.Fatalf("a's Run of %s, which it keeps, ended: %v", s, err)
			}
		}
	})
}

// putLate makes a client's next candidate put under a prefix go
// unanswered until its own ctx ends (the TTL that bounds it): lost on
// the way (it never reaches etcd), or applied with its answer late, as
// while etcd elects a leader.
type putLate struct {
	applied bool          // applied, its answer late; else lost
	held    chan struct{} // closed once the put is held
	mu      sync.Mutex
	prefix  string // of the next put held; "" once it is (see arm)
}

// arm makes the next candidate put under prefix the one held.
func (p *putLate) arm(prefix string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.prefix = prefix
}

// take reports whether txn is the put to hold, and disarms p if so.
func (p *putLate) take(txn *pb.TxnRequest) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	mine := p.prefix != "" && puts(txn, p.prefix)
	if mine {
		p.prefix = ""
	}
	return mine
}

// client returns a client made from cfg whose candidate puts go through p.
func (p *putLate) client(t *testing.T, cfg clientv3.Config) *clientv3.Client {
	t.Helper()
	return interceptedClient(t, cfg, p.intercept)
}

func (p *putLate) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if txn, ok := req.(*pb.TxnRequest); !ok || !p.take(txn) {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	close(p.held)
	if p.applied {
		if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
			return err
		}
	}
	<-ctx.Done()
	return ctx.Err()
}

// watched returns the first n events of wch, failing the test if the
// watch ends or they do not come within patience.
func watched(t *testing.T, wch clientv3.WatchChan, n int) []*clientv3.Event {
	t.Helper()
	var evs []*clientv3.Event
	deadline := time.After(patience())
	for len(evs) < n {
		select {
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil {
				t.Fatalf("the watch ended (%v) after %d events, want %d", wr.Err(), len(evs), n)
			}
			evs = append(evs, wr.Events...)
		case <-deadline:
			t.Fatalf("%d events, want %d", len(evs), n)
		}
	}
	return evs[:n]
}

func TestCandidacyPutUnanswered(t *testing.T) {
	t.Parallel() // bound by waits: see "Parallel tests" in helpers_test.go
	const sent = "coord: candidate put not answered, sending it again"
	// setup returns a pool's client whose first candidate put under
	// etPrefix goes unanswered as late says, with a leader of another key
	// on the pool's shared session, its token, and the pool's log.
	setup := func(t *testing.T, late *putLate) (keep, e *Election, token int64, tap *logTap, cli *clientv3.Client) {
		t.Helper()
		srv, cli := newEtcd(t)
		tap, log := newLogTap()
		tap.dumpOnFailure(t)
		p := ptPool(t, late.client(t, srv.ClientConfig()), PoolOptions{TTL: time.Second * scale, Logger: log})
		keep = ptElection(t, p, etKey+"-keep")
		etCampaign(t, keep, "keep")
		return keep, ptElection(t, p, etKey), keep.Token(), tap, cli
	}
	// kept checks that keep's term lives on, on e's session.
	kept := func(t *testing.T, keep, e *Election, token int64, tap *logTap) {
		t.Helper()
		if !keep.IsLeader() || keep.Token() != token || etSession(keep).ctx.Err() != nil || isClosed(keep.Done()) {
			t.Fatalf("the term on the shared session: leader %v, token %d (was %d), session ended: %v", keep.IsLeader(), keep.Token(), token, etSession(keep).Err())
		}
		if etSession(e) != etSession(keep) {
			t.Fatal("the elections are not on one shared session")
		}
		if n := tap.count("coord: candidate key not taken back, ending session"); n != 0 {
			t.Fatalf("%d sessions ended", n)
		}
	}
	for _, applied := range []bool{false, true} {
		name := map[bool]string{false: "lost on its way", true: "applied, its answer later than the TTL"}[applied]
		t.Run("a candidate put "+name+" is sent again: the Campaign leads on the key that landed first, and the term sharing its session keeps its token", func(t *testing.T) {
			late := &putLate{prefix: etPrefix, applied: applied, held: make(chan struct{})}
			keep, e, token, tap, cli := setup(t, late)
			wch := cli.Watch(testCtx(t), etPrefix, clientv3.WithPrefix(), clientv3.WithRev(keep.Token()+1))
			etCampaign(t, e, "e")
			kept(t, keep, e, token, tap)
			tap.wait(t, sent, 1)
			cands := candidates(t, cli, etPrefix)
			if len(cands) != 1 || cands[0].CreateRevision != e.Token() || clientv3.LeaseID(cands[0].Lease) != etSession(e).id {
				t.Fatalf("candidates %v, token %d: want our one key, created at the token", cands, e.Token())
			}
			// The first put's landing is the key's creation.
			created := watched(t, wch, 1)[0].Kv.CreateRevision
			if created != e.Token() {
				t.Fatalf("token %d, want the revision %d that created the key", e.Token(), created)
			}
			kept(t, keep, e, token, tap)
		})
	}
	t.Run("a Campaign given up while its put is unanswered: the put is sent again in the background and its key deleted; the shared session lives on", func(t *testing.T) {
		late := &putLate{prefix: etPrefix, held: make(chan struct{})}
		keep, e, token, tap, cli := setup(t, late)
		wch := cli.Watch(testCtx(t), etPrefix, clientv3.WithPrefix(), clientv3.WithRev(keep.Token()+1))
		ctx, cancel := context.WithCancel(testCtx(t))
		res := etCampaignAsync(ctx, e, "e")
		<-late.held
		cancel()
		if r := etWait(t, res); !errors.Is(r.err, context.Canceled) {
			t.Fatalf("Campaign: %v, want context.Canceled", r.err)
		}
		var seen []string
		for _, ev := range watched(t, wch, 2) {
			seen = append(seen, ev.Type.String())
		}
		if !slices.Equal(seen, []string{"PUT", "DELETE"}) {
			t.Fatalf("saw %v of our key, want its put and its delete", seen)
		}
		tap.wait(t, sent, 1)
		kept(t, keep, e, token, tap)
		// A new Campaign leads at once on the settled session.
		etCampaign(t, e, "e")
		kept(t, keep, e, token, tap)
	})
	t.Run("a shard's candidate put applied, its answer later than the TTL: the shard is owned again on its key, and the member's other shards keep their tokens", func(t *testing.T) {
		srv, l, shards, hosts := shFleet(t, 4, 1)
		h := hosts[0]
		late := &putLate{applied: true, held: make(chan struct{})}
		h.cli = late.client(t, h.px.ClientConfig())
		h.start(t, l, ShardOptions{Shards: shards})
		shSettle(t, l, shards, hosts, hosts)
		tokens := func() map[string]int64 {
			m := map[string]int64{}
			for _, sh := range h.set.Owned() {
				m[sh.Name] = sh.Token
			}
			return m
		}
		before := tokens()
		// The shard's key deleted by hand: the member campaigns again, and
		// that put is held.
		late.arm(ShardsPrefix + shards[0] + "/")
		mark := l.mark()
		if _, err := srv.Client().Delete(testCtx(t), ShardsPrefix+shards[0]+"/", clientv3.WithPrefix()); err != nil {
			t.Fatal(err)
		}
		receive(t, late.held, "the held put")
		ev := l.waitEvent(t, mark, SignalShardAcquired, h.id, shards[0])
		cands := candidates(t, srv.Client(), ShardsPrefix+shards[0]+"/")
		if len(cands) != 1 || cands[0].CreateRevision != ev.Token {
			t.Fatalf("candidates of %s %v, token %d: want our one key, created at the token", shards[0], cands, ev.Token)
		}
		after := tokens()
		for _, sh := range shards[1:] {
			if after[sh] != before[sh] {
				t.Fatalf("%s: token %d, was %d: its term ended with the held put", sh, after[sh], before[sh])
			}
		}
		if got := len(l.since(mark, SignalShardReleased)); got != 1 {
			t.Fatalf("%d shards released, want the one whose key was deleted", got)
		}
	})
}

package coord

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/go-coord/coord/coordtest"
)

// Tests of the resume after a step-down (see stepped): a term cut off for
// less than its lease steps down at 2/3 of the TTL, and is taken back,
// same key and token, by a run pending when etcd answers again; nobody
// else holds meanwhile.

// rsTTL is the TTL of the terms cut off: the link heals a third of it
// before etcd could expire the lease.
func rsTTL() time.Duration { return 3 * time.Second * scale }

// rsCut pauses p until Done of the term cut off closes, then runs during
// (while it is stepped down, etcd not yet answering) and heals the link:
// the renewals held meanwhile reach etcd before the lease expires. It
// returns when the link healed.
func rsCut(t *testing.T, p *coordtest.Proxy, done <-chan struct{}, during func()) time.Time {
	t.Helper()
	p.Pause()
	waitClosed(t, done, "Done of the term cut off")
	during()
	p.Unpause()
	return time.Now()
}

// rsPair makes a, on a client behind a proxy, lead an election with the
// TTL of rsTTL, and queues b, on a client of its own, behind it.
func rsPair(t *testing.T, signal func(Signal)) (cli *clientv3.Client, p *coordtest.Proxy, a, b *Election, res <-chan etResult) {
	t.Helper()
	srv, cli := newEtcd(t)
	p = srv.NewProxy(t)
	t.Cleanup(p.Unpause)
	a = etElection(t, p.NewClient(t), ElectionOptions{TTL: rsTTL(), OnSignal: signal})
	b = etElection(t, srv.NewClient(t), ElectionOptions{TTL: rsTTL()})
	etCampaign(t, a, "a")
	return cli, p, a, b, etQueue(t, testCtx(t), cli, b)
}

func TestElectionResume(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("a leader cut off for less than its lease steps down, and a Campaign pending when etcd answers again takes it back: same key, same token, nobody led meanwhile", func(t *testing.T) {
		t.Parallel()
		s := &signals{}
		cli, p, a, _, res := rsPair(t, s.hook)
		token, key, guard := a.Token(), a.current().key, a.Guard()
		var again <-chan etResult
		healed := rsCut(t, p, a.Done(), func() {
			if a.IsLeader() || a.Token() != 0 {
				t.Errorf("stepped down: IsLeader %v, Token %d", a.IsLeader(), a.Token())
			}
			again = etCampaignAsync(testCtx(t), a, "a")
		})
		r := etWait(t, again)
		if r.err != nil {
			t.Fatalf("Campaign after the step-down: %v", r.err)
		}
		t.Logf("resumed %v after the link healed (TTL %v)", r.at.Sub(healed).Round(time.Millisecond), rsTTL())
		if !a.IsLeader() || a.Token() != token || a.current().key != key {
			t.Fatalf("leads %v with token %d on %s, want token %d on %s", a.IsLeader(), a.Token(), a.current().key, token, key)
		}
		sig := s.waitFor(t, SignalLeadershipResumed, 1)
		if sig.Token != token || sig.Key != etKey || sig.Identity != "a" {
			t.Fatalf("signal %+v", sig)
		}
		if !etGuarded(t, cli, guard) || !etGuarded(t, cli, a.Guard()) {
			t.Fatal("the Guard of the resumed leadership does not hold")
		}
		select {
		case r := <-res:
			t.Fatalf("b's Campaign returned while a held: %v", r.err)
		default:
		}
		if c := candidates(t, cli, etPrefix); len(c) != 2 || c[0].CreateRevision != token {
			t.Fatalf("candidates %v, want a's key created at %d, then b's", c, token)
		}
	})

	t.Run("without a pending Campaign, the key goes as soon as etcd answers again, and the session lives on", func(t *testing.T) {
		t.Parallel()
		_, p, a, b, res := rsPair(t, nil)
		sess := etSession(a)
		healed := rsCut(t, p, a.Done(), func() {})
		r := etWait(t, res)
		if r.err != nil || !b.IsLeader() {
			t.Fatalf("b's Campaign: %v, leading %v", r.err, b.IsLeader())
		}
		t.Logf("b led %v after the link healed", r.at.Sub(healed).Round(time.Millisecond))
		if etSession(a) != sess || sess.ctx.Err() != nil {
			t.Fatalf("a's session ended: %v", sess.Err())
		}
	})

	t.Run("Resign after a step-down gives the key up: a Campaign after it queues anew", func(t *testing.T) {
		t.Parallel()
		cli, p, a, b, res := rsPair(t, nil)
		token := a.Token()
		rsCut(t, p, a.Done(), func() {
			if err := a.Resign(testCtx(t)); err != nil {
				t.Errorf("Resign: %v", err)
			}
		})
		if r := etWait(t, res); r.err != nil || !b.IsLeader() {
			t.Fatalf("b's Campaign: %v, leading %v", r.err, b.IsLeader())
		}
		bToken := b.Token()
		again := etCampaignAsync(testCtx(t), a, "a")
		etWaitCount(t, cli, etPrefix, 2, clientv3.WithPrefix())
		if err := b.Resign(testCtx(t)); err != nil {
			t.Fatal(err)
		}
		if r := etWait(t, again); r.err != nil || a.Token() <= bToken || bToken <= token {
			t.Fatalf("Campaign: %v, token %d after b's %d, after a's %d", r.err, a.Token(), bToken, token)
		}
	})
}

func TestSemaphoreResume(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("a permit cut off for less than its lease steps down, and an Acquire pending when etcd answers again takes it back with its token", func(t *testing.T) {
		t.Parallel()
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		t.Cleanup(p.Unpause)
		s := &signals{}
		a := smSemaphore(t, p.NewClient(t), SemaphoreOptions{Limit: 1, TTL: rsTTL(), OnSignal: s.hook})
		b := smSemaphore(t, srv.NewClient(t), SemaphoreOptions{Limit: 1, TTL: rsTTL()})
		held := smAcquire(t, a)
		waiting := smQueue(t, testCtx(t), cli, b, 2)
		var again <-chan smResult
		rsCut(t, p, held.Done(), func() { again = smAcquireAsync(testCtx(t), a) })
		q := smGot(t, again)
		if q.err != nil || q.p.Token() != held.Token() || q.p.Err() != nil {
			t.Fatalf("Acquire after the step-down: %v, token %d, want %d", q.err, q.p.Token(), held.Token())
		}
		if sig := s.waitFor(t, SignalPermitResumed, 1); sig.Token != held.Token() || sig.Key != smKey {
			t.Fatalf("signal %+v", sig)
		}
		if held.Err() == nil {
			t.Fatal("the permit that stepped down holds again: want it ended, the new one held")
		}
		smWaiting(t, waiting)
	})

	t.Run("Release of a permit that stepped down gives its key up", func(t *testing.T) {
		t.Parallel()
		srv, cli := newEtcd(t)
		p := srv.NewProxy(t)
		t.Cleanup(p.Unpause)
		a := smSemaphore(t, p.NewClient(t), SemaphoreOptions{Limit: 1, TTL: rsTTL()})
		b := smSemaphore(t, srv.NewClient(t), SemaphoreOptions{Limit: 1, TTL: rsTTL()})
		held := smAcquire(t, a)
		waiting := smQueue(t, testCtx(t), cli, b, 2)
		var again <-chan smResult
		rsCut(t, p, held.Done(), func() {
			if err := held.Release(testCtx(t)); err != nil {
				t.Errorf("Release: %v", err)
			}
			again = smAcquireAsync(testCtx(t), a)
		})
		if r := smGot(t, waiting); r.err != nil {
			t.Fatalf("b's Acquire: %v", r.err)
		}
		smWaiting(t, again)
	})
}

func TestShardSetResume(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	t.Run("a member cut off for less than its lease steps down, and takes every shard back with its token: no shard moves", func(t *testing.T) {
		t.Parallel()
		srv, _ := newEtcd(t)
		l, shards := newShLedger(), shNames(6)
		// Registrations outlive the cut: the member is not seen down.
		var hosts []*shHost
		for _, id := range shIDs(2) {
			h := &shHost{id: id, px: srv.NewProxy(t)}
			t.Cleanup(h.px.Unpause)
			h.cli = h.px.NewClient(t)
			h.live = register(t, h.cli, id, LivenessOptions{TTL: 4 * rsTTL()})
			hosts = append(hosts, h)
		}
		top := shStartAll(t, l, hosts, ShardOptions{Shards: shards, TTL: rsTTL()})
		a, b := hosts[0], hosts[1]
		before := map[string]int64{}
		for _, sh := range a.set.Owned() {
			before[sh.Name] = sh.Token
		}
		if len(before) == 0 {
			t.Fatalf("%s owns no shard of %v", a.id, top)
		}
		a.px.Pause()
		l.until(t, a.id+" stepping down", func() bool { return len(a.set.Owned()) == 0 })
		a.px.Unpause()
		healed := time.Now()
		l.until(t, a.id+" owning its shards again", func() bool {
			now := map[string]int64{}
			for _, sh := range a.set.Owned() {
				now[sh.Name] = sh.Token
			}
			return maps.Equal(now, before)
		})
		t.Logf("%d shards owned again, same tokens, %v after the link healed", len(before), time.Since(healed).Round(time.Millisecond))
		for _, sh := range b.set.Owned() {
			if _, ok := before[sh.Name]; ok {
				t.Fatalf("%s owns %s, which %s owned before the cut", b.id, sh.Name, a.id)
			}
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, ev := range l.events {
			if _, ok := before[ev.Shard]; ok && ev.Kind == SignalShardAcquired && ev.Host == b.id {
				t.Fatalf("%s acquired %s during the cut", b.id, ev.Shard)
			}
		}
	})
}

// TestElectionShortCuts cuts a leader that keeps campaigning (the loop of
// ExampleElection_Campaign_again) off again and again, each cut 0.6 of the
// TTL, at a random point of its renewals' round: shorter than what is left
// of its lease, longer than the step-down when it comes late in the
// round. Its leadership never changes hands: the same token throughout,
// the standby never leads, and while it has stepped down it does not
// believe it leads. COORD_SOAK_CUTS sets the number of cuts (default 2),
// COORD_SOAK_TTL the TTL (default rsTTL): the soak of FAULTS.md's row 22
// is COORD_SOAK_CUTS=100 COORD_SOAK_TTL=10s.
func TestElectionShortCuts(t *testing.T) {
	t.Parallel() // long and bound by waits: see "Parallel tests" in helpers_test.go
	cuts, ttl := 2, rsTTL()
	if v := os.Getenv("COORD_SOAK_CUTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("COORD_SOAK_CUTS=%q: want a number of cuts", v)
		}
		cuts = n
	}
	if v := os.Getenv("COORD_SOAK_TTL"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < time.Second || d%time.Second != 0 {
			t.Fatalf("COORD_SOAK_TTL=%q: want whole seconds", v)
		}
		ttl = d
	}
	srv, _ := newEtcd(t)
	stepDowns, p50, worst := shortCuts(t, srv, cuts, ttl)
	t.Logf("%d cuts: %d stepped down and resumed, 0 leadership changes, the token unchanged; leading again %v (median) / %v (max) after the heal",
		cuts, stepDowns, p50.Round(time.Millisecond), worst.Round(time.Millisecond))
}

// shortCuts cuts a leader of an election on e off cuts times, each for
// 0.6 of ttl (see TestElectionShortCuts), and returns how many times it
// stepped down, and how long it took to lead again after the heal, at the
// median and at worst.
func shortCuts(t *testing.T, e coordtest.Etcd, cuts int, ttl time.Duration) (stepDowns int, p50, worst time.Duration) {
	t.Helper()
	seed := time.Now().UnixNano()
	rnd := rand.New(rand.NewPCG(uint64(seed), 0))
	t.Logf("%d cuts of %v at TTL %v, seed %d", cuts, ttl*6/10, ttl, seed)

	cli := e.Client()
	p := e.NewProxy(t)
	t.Cleanup(p.Unpause)
	s := &signals{}
	a := etElection(t, p.NewClient(t), ElectionOptions{TTL: ttl, OnSignal: s.hook})
	b := etElection(t, e.NewClient(t), ElectionOptions{TTL: ttl})
	etCampaign(t, a, "a")
	token := a.Token()
	// The campaigns last as long as the cuts: longer than testCtx's
	// patience for a soak.
	ctx, cancel := context.WithCancel(context.Background())
	standby := etQueue(t, ctx, cli, b)

	// a campaigns again each time it steps down.
	var (
		mu       sync.Mutex
		believed []string    // what was wrong once it stepped down
		again    []time.Time // when it led again after each
	)
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		for ctx.Err() == nil {
			select {
			case <-a.Done():
			case <-ctx.Done():
				return
			}
			mu.Lock()
			stepDowns++
			if a.IsLeader() || a.Token() != 0 {
				believed = append(believed, fmt.Sprintf("IsLeader %v, Token %d", a.IsLeader(), a.Token()))
			}
			mu.Unlock()
			if err := a.Campaign(ctx, "a"); err == nil {
				mu.Lock()
				again = append(again, time.Now())
				mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-ended
	})

	var back []time.Duration // from each heal that needed a resume to leading again
	for range cuts {
		// Somewhere in a renewal's round: sent every third of the TTL.
		time.Sleep(time.Duration(rnd.Int64N(int64(ttl / 3))))
		mu.Lock()
		before := stepDowns
		mu.Unlock()
		p.Pause()
		time.Sleep(ttl * 6 / 10) // the outage
		p.Unpause()
		healed := time.Now()
		eventually(t, "a leading after the heal", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(again) == stepDowns && a.IsLeader()
		})
		mu.Lock()
		if stepDowns > before {
			back = append(back, again[len(again)-1].Sub(healed))
		}
		mu.Unlock()
		if a.Token() != token {
			t.Fatalf("token %d after a cut, want %d", a.Token(), token)
		}
	}
	select {
	case r := <-standby:
		t.Fatalf("the standby's Campaign returned: %v", r.err)
	default:
	}
	mu.Lock()
	defer mu.Unlock()
	if len(believed) > 0 {
		t.Fatalf("stepped down, it still believed it led: %v", believed)
	}
	resumed := len(s.of(SignalLeadershipResumed))
	if resumed != stepDowns {
		t.Fatalf("%d step-downs, %d resumes", stepDowns, resumed)
	}
	if c := candidates(t, cli, etPrefix); len(c) != 2 || c[0].CreateRevision != token {
		t.Fatalf("candidates %v, want a's key created at %d, then b's", c, token)
	}
	slices.Sort(back)
	if len(back) > 0 {
		p50, worst = back[len(back)/2], back[len(back)-1]
	}
	return stepDowns, p50, worst
}

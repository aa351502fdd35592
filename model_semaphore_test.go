package coord

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// The semaphore of the model: every agent joins it with its election, and
// acquires (up to mdSemMax permits at once), tries to acquire and releases
// at random, through the same faults as the election. Each permit writes
// to mdSemLog under its Guard while it is held, and once more just after
// it ended (a write that must be fenced out). After the run, the fenced
// writes of each token span an interval of etcd's revisions, from its
// first to its last write: no revision may lie in more than mdSemLimit of
// those intervals. And, as for leaderships, no more than mdSemLimit
// permits may have been believed held at any instant.

const (
	mdSem       = "/model/sem"
	mdSemPrefix = mdSem + "/"
	mdSemLog    = "/model/semlog/"
	mdSemLimit  = 2
	mdSemMax    = 2 // permits an agent holds at once
)

// mdPermit is a permit held by an agent, and its writer.
type mdPermit struct {
	p    *Permit
	done chan struct{} // closed when its writer returns, after p ended
}

// mdSemTerm is one permit as seen from outside the library: from the
// return of Acquire to the close of Done, on the monotonic clock.
type mdSemTerm struct {
	ident      string
	token      int64
	done       <-chan struct{}
	start, end time.Time // end is zero while it lasts
}

// mdSemState is what the model keeps of the semaphore.
type mdSemState struct {
	mu     sync.Mutex
	terms  []*mdSemTerm
	writes int
	bg     sync.WaitGroup // term watchers
}

// semStep performs an operation of the semaphore for agent a.
func (m *model) semStep(k mdKind, a *mdAgent) {
	switch k {
	case mdAcquire, mdTryAcquire:
		d := 200*time.Millisecond + time.Duration(m.rng.Int64N(int64(1800*time.Millisecond)))
		try := k == mdTryAcquire
		m.dispatch(a, fmt.Sprintf("%v within %v", k, d.Round(time.Millisecond)),
			func(a *mdAgent) string { return a.acquire(d, try) })
	case mdRelease:
		// A holder releases, if there is one, so that permits change hands.
		start := m.rng.IntN(len(m.agents))
		for i := range m.agents {
			if ag := m.agents[(start+i)%len(m.agents)]; ag.holding.Load() > 0 {
				a = ag
				break
			}
		}
		m.dispatch(a, "release", func(a *mdAgent) string { return a.release() })
	case mdCutHolder:
		// Cut an agent that holds a permit for longer than the TTL while
		// three others acquire: its permits must end before any of
		// them can be granted its slots.
		d := mdTTL + time.Duration(m.rng.Int64N(int64(1500*time.Millisecond)))
		l := m.link()
		others := m.rng.Perm(len(m.agents))
		wait := mdTTL + time.Duration(m.rng.Int64N(int64(2*time.Second)))
		for _, ag := range m.agents {
			if ag.holding.Load() > 0 {
				m.cut(ag.px, ag.id+" (holder)", d, l)
				break
			}
		}
		for _, i := range others[:3] {
			m.dispatch(m.agents[i], fmt.Sprintf("acquire within %v", wait.Round(time.Millisecond)),
				func(a *mdAgent) string { return a.acquire(wait, false) })
		}
	}
}

// joinSemaphore joins the model's semaphore, if a has not yet.
func (a *mdAgent) joinSemaphore() string {
	if a.sem != nil {
		return ""
	}
	ctx, cancel := a.opCtx(2 * time.Second)
	defer cancel()
	s, err := NewSemaphore(ctx, a.cli, SemaphoreOptions{Key: mdSem, Limit: mdSemLimit, TTL: mdTTL,
		Identity: a.ident, Logger: a.m.logger("holder", a.ident)})
	if err != nil {
		return fmt.Sprintf("join semaphore: %v", err)
	}
	a.sem = s
	return "joined the semaphore"
}

// leaveSemaphore closes the semaphore, which ends every permit, and stops
// the writers.
func (a *mdAgent) leaveSemaphore() {
	if a.sem == nil {
		return
	}
	a.sem.Close()
	for _, mp := range a.permits {
		<-mp.done
	}
	a.permits, a.sem = nil, nil
	a.holding.Store(0)
}

// prune forgets the permits that ended, once their writers are done.
func (a *mdAgent) prune() {
	a.permits = slices.DeleteFunc(a.permits, func(mp *mdPermit) bool {
		if !isClosed(mp.p.Done()) {
			return false
		}
		<-mp.done
		return true
	})
	a.holding.Store(int32(len(a.permits)))
}

func (a *mdAgent) acquire(d time.Duration, try bool) string {
	if a.sem == nil {
		return "not in the semaphore"
	}
	if a.prune(); len(a.permits) >= mdSemMax {
		return "holds enough permits"
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var (
		p   *Permit
		err error
	)
	if try {
		p, err = a.sem.TryAcquire(ctx)
	} else {
		p, err = a.sem.Acquire(ctx)
	}
	if err != nil {
		return fmt.Sprintf("no permit: %v", err)
	}
	a.m.acquired(a, p)
	a.permits = append(a.permits, a.startPermitWriter(p))
	a.holding.Store(int32(len(a.permits)))
	return fmt.Sprintf("holds token %d", p.Token())
}

func (a *mdAgent) release() string {
	if a.prune(); len(a.permits) == 0 {
		return "holds no permit"
	}
	mp := a.permits[0]
	ctx, cancel := a.opCtx(2 * time.Second)
	err := mp.p.Release(ctx)
	cancel()
	a.prune()
	if err != nil {
		return fmt.Sprintf("release token %d: %v", mp.p.Token(), err)
	}
	return fmt.Sprintf("released token %d", mp.p.Token())
}

// mdPermitWriters numbers the permit writers.
var mdPermitWriters atomic.Int64

// startPermitWriter writes to the log under p's Guard until p ends, then
// once more: that last write must be refused.
func (a *mdAgent) startPermitWriter(p *Permit) *mdPermit {
	mp := &mdPermit{p: p, done: make(chan struct{})}
	cli, ident, token, guard := a.cli, a.ident, p.Token(), p.Guard()
	// A permit resumed has the token of the one that stepped down: each
	// writer's entries are its own.
	writer := mdPermitWriters.Add(1)
	r := rand.New(rand.NewPCG(a.m.cfg.seed, uint64(token)))
	go func() {
		defer close(mp.done)
		for n := 1; ; n++ {
			ended := false
			select {
			case <-p.Done():
				ended = true
			case <-time.After(10*time.Millisecond + time.Duration(r.Int64N(int64(40*time.Millisecond)))):
			}
			a.m.semWrite(cli, ident, token, guard, writer, n)
			if ended {
				return
			}
		}
	}()
	return mp
}

// semWrite writes entry n of a permit's log under guard, and checks that
// a write etcd took was made while the permit was among the first Limit.
func (m *model) semWrite(cli *clientv3.Client, ident string, token int64, guard clientv3.Cmp, writer int64, n int) {
	wctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	key := fmt.Sprintf("%s%d/%d/%06d", mdSemLog, token, writer, n)
	resp, err := cli.Txn(wctx).If(guard).
		Then(clientv3.OpPut(key, fmt.Sprintf("%s %d", ident, token)),
			clientv3.OpGet(mdSemPrefix, top(mdSemLimit, clientv3.SortAscend)...)).Commit()
	if err != nil || !resp.Succeeded {
		return
	}
	m.sem.mu.Lock()
	m.sem.writes++
	m.sem.mu.Unlock()
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		if kv.CreateRevision == token {
			return
		}
	}
	m.errorf("%s wrote under the Guard of permit %d at revision %d, but the holders then were %v",
		ident, token, resp.Header.Revision, resp.Responses[1].GetResponseRange().Kvs)
}

// acquired records a permit that an Acquire of a has just returned (see
// won: a term whose Done is found closed ended before this one began).
func (m *model) acquired(a *mdAgent, p *Permit) {
	done := p.Done()
	m.sem.mu.Lock()
	defer m.sem.mu.Unlock()
	var over []*mdSemTerm
	for _, t := range m.sem.terms {
		if t.end.IsZero() && isClosed(t.done) {
			over = append(over, t)
		}
	}
	start := time.Now()
	for _, t := range over {
		t.end = start
	}
	term := &mdSemTerm{ident: a.ident, token: p.Token(), done: done, start: start}
	m.sem.terms = append(m.sem.terms, term)
	m.sem.bg.Add(1)
	go func() {
		defer m.sem.bg.Done()
		<-done
		end := time.Now()
		m.sem.mu.Lock()
		if term.end.IsZero() || end.Before(term.end) {
			term.end = end
		}
		m.sem.mu.Unlock()
	}()
}

// semConverged compares the permits the agents believe they hold with
// the permit keys in etcd: once the agents are idle, the same.
func (m *model) semConverged(ctx context.Context) []string {
	var believed []string
	for _, a := range m.agents {
		for _, mp := range a.permits {
			if !isClosed(mp.p.Done()) {
				believed = append(believed, fmt.Sprintf("%s %d", a.ident, mp.p.Token()))
			}
		}
	}
	resp, err := m.cli.Get(ctx, mdSemPrefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	if err != nil {
		return []string{fmt.Sprintf("get permits: %v", err)}
	}
	var held []string
	for _, kv := range resp.Kvs {
		held = append(held, fmt.Sprintf("%s %d", kv.Value, kv.CreateRevision))
	}
	slices.Sort(believed)
	slices.Sort(held)
	if len(believed) > mdSemLimit || !slices.Equal(believed, held) {
		return []string{fmt.Sprintf("permits believed held %v; etcd's permit keys %v", believed, held)}
	}
	return nil
}

// checkSemaphore reads the permits' fenced writes and returns how many
// revisions lie in more than mdSemLimit tokens' [first, last] intervals,
// how many instants more than mdSemLimit permits were believed held at,
// and the numbers of writes and tokens.
func (m *model) checkSemaphore() (revs, instants int64, writes, tokens int) {
	m.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience())
	defer cancel()
	resp, err := m.cli.Get(ctx, mdSemLog, clientv3.WithPrefix())
	if err != nil {
		m.fatalf("read the semaphore log: %v", err)
	}
	span := map[int64][2]int64{} // by token: first and last revision
	for _, kv := range resp.Kvs {
		tok, _, _ := strings.Cut(strings.TrimPrefix(string(kv.Key), mdSemLog), "/")
		token, err := strconv.ParseInt(tok, 10, 64)
		if err != nil || token >= kv.ModRevision {
			m.fatalf("semaphore log entry %s = %q at revision %d", kv.Key, kv.Value, kv.ModRevision)
		}
		s, seen := span[token]
		if !seen {
			s = [2]int64{kv.ModRevision, kv.ModRevision}
		}
		span[token] = [2]int64{min(s[0], kv.ModRevision), max(s[1], kv.ModRevision)}
	}
	var spans [][2]int64
	for _, s := range span {
		spans = append(spans, s)
	}
	revs = mdOverLimit(spans, mdSemLimit)
	m.mu.Lock()
	deletes := m.deletes
	m.mu.Unlock()
	m.sem.mu.Lock()
	defer m.sem.mu.Unlock()
	var believed [][2]int64
	for _, t := range m.sem.terms {
		if t.end.IsZero() {
			m.t.Errorf("seed %d: permit %d of %s never ended", m.cfg.seed, t.token, t.ident)
			continue
		}
		// Half-open on the monotonic clock: [start, end - 1ns], ended at
		// an outside delete that took its key, if one came first.
		end := outsideEnd(deletes, mdSem+"/", t.token, t.end)
		if !end.After(t.start) {
			continue
		}
		believed = append(believed, [2]int64{int64(t.start.Sub(m.start)), int64(end.Sub(m.start)) - 1})
	}
	instants = mdOverLimit(believed, mdSemLimit)
	return revs, instants, len(resp.Kvs), len(span)
}

// mdOverLimit returns how many points lie in more than limit of the
// closed intervals.
func mdOverLimit(intervals [][2]int64, limit int) int64 {
	type edge struct{ at, d int64 }
	var edges []edge
	for _, iv := range intervals {
		edges = append(edges, edge{iv[0], 1}, edge{iv[1] + 1, -1})
	}
	slices.SortFunc(edges, func(a, b edge) int { return cmp.Or(cmp.Compare(a.at, b.at), cmp.Compare(a.d, b.d)) })
	var over, open, from int64
	for _, e := range edges {
		if open > int64(limit) {
			over += e.at - from
		}
		open += e.d
		from = e.at
	}
	return over
}

// shutdownSemaphore waits for the permits' term watchers, once every
// agent has closed its semaphore.
func (m *model) shutdownSemaphore() {
	ended := make(chan struct{})
	go func() {
		m.sem.bg.Wait()
		close(ended)
	}()
	select {
	case <-ended:
	case <-time.After(patience()):
		m.t.Errorf("seed %d: a permit's Done still open after its semaphore closed", m.cfg.seed)
	}
}

func TestModelOverLimit(t *testing.T) {
	for _, tc := range []struct {
		name      string
		intervals [][2]int64
		limit     int
		want      int64
	}{
		{"none", nil, 1, 0},
		{"within the limit", [][2]int64{{1, 5}, {3, 9}}, 2, 0},
		{"touching intervals overlap at the shared point", [][2]int64{{1, 5}, {5, 9}}, 1, 1},
		{"disjoint", [][2]int64{{1, 4}, {5, 9}}, 1, 0},
		{"three at once for 2 points", [][2]int64{{1, 5}, {3, 9}, {4, 20}}, 2, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := mdOverLimit(tc.intervals, tc.limit); got != tc.want {
				t.Fatalf("mdOverLimit(%v, %d) = %d, want %d", tc.intervals, tc.limit, got, tc.want)
			}
		})
	}
}

package coord

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ElectionPool serves per-key leadership at scale. Its elections share its
// sessions, at most KeysPerSession keys on one lease, so that etcd's load
// grows with the number of agents rather than with keys × agents; the
// sessions are the pool's, never bound to a caller's ctx. Each key has one
// holder at a time: the Election returned for it, until its Close. It is
// safe for concurrent use.
type ElectionPool struct {
	cli  *clientv3.Client
	opts PoolOptions // defaults applied
	log  *slog.Logger

	ctx    context.Context // ended by Close: ends the sessions
	cancel context.CancelFunc
	wg     sync.WaitGroup // the sessions' goroutines
	mark   etcdMark       // the etcd of its elections' answers

	mu        sync.Mutex
	elections map[string]*Election // by key: the one held
	sessions  []*poolSession       // in the order they were made; dead ones are dropped lazily
	growing   chan struct{}        // closed when the session being made is done
	onHost    *session             // with Host: the last session on its lease
	closed    bool
}

// poolSession is a shared session and the number of elections it serves.
type poolSession struct {
	s    *session
	keys int
}

// PoolStats is a snapshot of a pool.
type PoolStats struct {
	Elections int           // keys held
	Sessions  int           // live shared sessions
	Leading   int           // elections we lead
	Closed    bool          // Close was called
	TTL       time.Duration // the session TTL asked for
}

// NewElectionPool returns an empty pool; it talks to etcd only once an
// election campaigns. It checks its options: a nil client is ErrNilClient,
// a TTL that is not a whole number of seconds ErrInvalidTTL, a negative
// KeysPerSession ErrInvalidKeysPerSession.
func NewElectionPool(cli *clientv3.Client, opts PoolOptions) (*ElectionPool, error) {
	if cli == nil {
		return nil, ErrNilClient
	}
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &ElectionPool{cli: cli, opts: opts, log: logger(opts.Logger), ctx: ctx, cancel: cancel,
		elections: map[string]*Election{}}, nil
}

// Election returns an Election for key, held by the caller until its
// Close; while it is held, another call for key fails with ErrInUse. It
// does not talk to etcd: the Election takes a place on a shared session
// when it campaigns. ctx only says whether the caller still wants it.
func (p *ElectionPool) Election(ctx context.Context, key string) (*Election, error) {
	what := fmt.Sprintf("pool election %q", key)
	if err := checkElectionKey(key); err != nil {
		return nil, err
	}
	if ctx.Err() != nil {
		return nil, opErr(what, ctx.Err())
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, opErr(what, ErrClosed)
	}
	if _, held := p.elections[key]; held {
		return nil, opErr(what, ErrInUse)
	}
	unclaim := func() {}
	if h := p.opts.Host; h != nil {
		var err error
		if unclaim, err = h.claim(key); err != nil {
			return nil, opErr(what, err)
		}
	}
	e := newElection(p.cli, key, p.opts.TTL, p.opts.Identity, p.log, p.opts.OnSignal, &p.mark)
	e.watchCli = cmp.Or(p.opts.WatchClient, p.cli)
	e.pool, e.unclaim = p, unclaim
	p.elections[key] = e
	return e, nil
}

// share returns a live shared session with room for e, making one if
// none has room. One caller makes it; the others wait for it, within
// their ctx, and no lock is held meanwhile.
func (p *ElectionPool) share(ctx context.Context, e *Election) (*session, error) {
	for {
		// After Close, a session cannot be had: grow fails at once.
		p.mu.Lock()
		p.leaveLocked(e)
		if ps := p.roomLocked(); ps != nil {
			ps.keys++
			e.slot = ps
			p.mu.Unlock()
			return ps.s, nil
		}
		growing := p.growing
		if growing == nil {
			p.growing = make(chan struct{})
		}
		p.mu.Unlock()
		if growing == nil {
			if err := p.grow(ctx); err != nil {
				return nil, err
			}
			continue
		}
		if !within(ctx, growing) {
			return nil, ctx.Err()
		}
	}
}

// roomLocked drops the sessions that ended and returns the fullest live
// one with room (the first made, of those as full), or nil. Filling the
// fullest first keeps the sessions few after churn: a key cannot move to
// another lease without losing its place in line, so the emptiest are
// left to empty.
func (p *ElectionPool) roomLocked() *poolSession {
	live := p.sessions[:0]
	for _, ps := range p.sessions {
		if ps.s.ctx.Err() == nil {
			live = append(live, ps)
		}
	}
	clear(p.sessions[len(live):])
	p.sessions = live
	var best *poolSession
	for _, ps := range live {
		if ps.keys < p.opts.KeysPerSession && (best == nil || ps.keys > best.keys) {
			best = ps
		}
	}
	return best
}

// grow makes a new shared session (bounded by ctx, and cut short by
// Close) and publishes it: with Host, one on its lease while the pool
// has none, else one of its own.
func (p *ElectionPool) grow(ctx context.Context) error {
	ctx, cancel := withCancelOn(ctx, p.ctx)
	defer cancel()
	p.mu.Lock()
	last := p.onHost
	p.mu.Unlock()
	var (
		s   *session
		err error
	)
	if h := p.opts.Host; h != nil && (last == nil || last.ctx.Err() != nil) {
		if s, err = startHostSession(ctx, p.ctx, h, last, p.log, &p.wg); err == nil {
			last = s
		}
	} else {
		s, err = startSession(ctx, p.ctx, p.cli, p.opts.TTL, p.log, &p.wg)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	close(p.growing)
	p.growing = nil
	p.onHost = last
	if err != nil {
		return err
	}
	p.sessions = append(p.sessions, &poolSession{s: s})
	return nil
}

// leaveLocked gives back e's place on its session; a live session left
// with no election ends, and its lease is revoked.
func (p *ElectionPool) leaveLocked(e *Election) {
	if ps := e.slot; ps != nil {
		e.slot = nil
		ps.keys--
		if ps.keys == 0 {
			ps.s.end(ErrClosed)
		}
	}
}

// release forgets e, closed: its key may be held again.
func (p *ElectionPool) release(e *Election) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.leaveLocked(e)
	if p.elections[e.key] == e {
		delete(p.elections, e.key)
		e.unclaim()
	}
}

// Close closes every election of the pool (their Campaigns return
// ErrClosed) and revokes its sessions, which removes their keys; later
// calls to Election fail with ErrClosed. It bounds its own time to about
// one TTL, and is idempotent.
func (p *ElectionPool) Close() error {
	p.mu.Lock()
	p.closed = true
	es := make([]*Election, 0, len(p.elections))
	for _, e := range p.elections {
		es = append(es, e)
	}
	growing := p.growing
	p.mu.Unlock()
	// Sessions first: their revokes (a host session's deletes) take every
	// key with them, and the elections have nothing left to delete one
	// by one.
	p.cancel()
	var wg sync.WaitGroup
	for _, e := range es {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.Close()
		}()
	}
	wg.Wait()
	if growing != nil {
		<-growing
	}
	p.wg.Wait()
	return nil
}

// Stats returns the pool's counts. It never talks to etcd.
func (p *ElectionPool) Stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := PoolStats{Elections: len(p.elections), Closed: p.closed, TTL: p.opts.TTL}
	for _, ps := range p.sessions {
		if ps.s.ctx.Err() == nil {
			st.Sessions++
		}
	}
	for _, e := range p.elections {
		if e.IsLeader() {
			st.Leading++
		}
	}
	return st
}

// Healthy judges every election of the pool, as Election.Healthy does,
// and returns an error naming the first unhealthy one (by key) and how
// many are; "closed" after Close.
func (p *ElectionPool) Healthy() error {
	if err := p.health(time.Now()); err != nil {
		return opErr("election pool", err)
	}
	return nil
}

func (p *ElectionPool) health(now time.Time) error {
	p.mu.Lock()
	closed := p.closed
	es := make([]*Election, 0, len(p.elections))
	for _, e := range p.elections {
		es = append(es, e)
	}
	p.mu.Unlock()
	if closed {
		return errHClosed
	}
	slices.SortFunc(es, func(a, b *Election) int { return strings.Compare(a.key, b.key) })
	var first error
	bad := 0
	for _, e := range es {
		if err := e.health(now); err != nil {
			bad++
			if first == nil {
				first = fmt.Errorf("election %q: %w", e.key, err)
			}
		}
	}
	if first != nil {
		return fmt.Errorf("%d of %d elections unhealthy, first %w", bad, len(es), first)
	}
	return nil
}

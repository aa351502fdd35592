package coord

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ElectionPool hands out one long-lived Election per key, each with its own
// session owned by the pool: a caller's ctx bounds only the creation. An
// Election whose session ended gets a new session on its next use. It is
// safe for concurrent use.
type ElectionPool struct {
	cli  *clientv3.Client
	opts PoolOptions
	log  *slog.Logger

	ctx    context.Context // ended by Close: aborts a creation under way
	cancel context.CancelFunc

	mu        sync.Mutex
	elections map[string]*Election
	closed    bool
}

// PoolStats is a snapshot of a pool.
type PoolStats struct {
	Sessions int           // elections whose session is live
	Leading  int           // elections we lead
	Closed   bool          // Close was called
	TTL      time.Duration // the session TTL asked for
}

// NewElectionPool returns an empty pool. Invalid options are reported by
// Election.
func NewElectionPool(cli *clientv3.Client, opts PoolOptions) *ElectionPool {
	ctx, cancel := context.WithCancel(context.Background())
	return &ElectionPool{cli: cli, opts: opts, log: logger(opts.Logger), ctx: ctx, cancel: cancel, elections: map[string]*Election{}}
}

// Election returns the pool's Election for key, creating it (bounded by
// ctx) on first use and renewing its session if that ended. The same
// *Election is returned for the same key until the pool is closed. Its
// Close does nothing: the pool's Close releases it.
func (p *ElectionPool) Election(ctx context.Context, key string) (*Election, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, fmt.Errorf("coord: pool election %q: %w", key, ErrClosed)
	}
	// p.mu is held across etcd calls: Close must be able to cut them short
	// rather than wait on an unreachable etcd for as long as ctx lasts.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(p.ctx, cancel)()
	e, err := p.election(ctx, key)
	if err != nil && p.ctx.Err() != nil {
		return nil, fmt.Errorf("coord: pool election %q: %w", key, ErrClosed)
	}
	return e, err
}

// election returns the pooled Election for key, renewed or created.
// Called with p.mu held.
func (p *ElectionPool) election(ctx context.Context, key string) (*Election, error) {
	if e, ok := p.elections[key]; ok {
		if err := e.renew(ctx); err != nil {
			return nil, err
		}
		return e, nil
	}
	ttl, err := ttlOrDefault(p.opts.TTL, DefaultPoolTTL)
	if err != nil {
		return nil, err
	}
	e, err := NewElection(ctx, p.cli, ElectionOptions{Key: key, TTL: ttl, Identity: p.opts.Identity, Logger: p.log, OnSignal: p.opts.OnSignal})
	if err != nil {
		return nil, err
	}
	e.pooled = true
	p.elections[key] = e
	return e, nil
}

// Close resigns and releases every pooled election; later calls to Election
// fail with ErrClosed. It is idempotent.
func (p *ElectionPool) Close() error {
	p.cancel()
	p.mu.Lock()
	p.closed = true
	es := p.elections
	p.elections = map[string]*Election{}
	p.mu.Unlock()
	var wg sync.WaitGroup
	for _, e := range es {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.close()
		}()
	}
	wg.Wait()
	return nil
}

// Stats returns the pool's counts.
func (p *ElectionPool) Stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	st := PoolStats{Closed: p.closed, TTL: p.opts.TTL}
	if st.TTL == 0 {
		st.TTL = DefaultPoolTTL
	}
	for _, e := range p.elections {
		e.mu.Lock()
		if e.sess.ctx.Err() == nil {
			st.Sessions++
		}
		e.mu.Unlock()
		if e.IsLeader() {
			st.Leading++
		}
	}
	return st
}

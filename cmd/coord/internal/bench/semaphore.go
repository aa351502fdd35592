package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/go-coord/coord"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// benchPermitter is one side's way to take permits of a semaphore, one at
// a time: coord's Semaphore, or the recipe a user writes on etcd's
// concurrency package.
type benchPermitter interface {
	acquire(ctx context.Context) error
	release(ctx context.Context) error
	close()
}

func newBenchPermitter(ctx context.Context, side string, cli *clientv3.Client, key string, limit int) (benchPermitter, error) {
	if side == "coord" {
		s, err := coord.NewSemaphore(ctx, cli, coord.SemaphoreOptions{Key: key, Limit: limit, Identity: "bench"})
		if err != nil {
			return nil, err
		}
		return &benchCoordPermitter{s: s}, nil
	}
	s, err := concurrency.NewSession(cli, concurrency.WithTTL(int(coord.DefaultSemaphoreTTL/time.Second)),
		concurrency.WithContext(context.Background()))
	if err != nil {
		return nil, err
	}
	return &benchPlainPermitter{cli: cli, s: s, prefix: key + "/",
		key: key + "/" + strconv.FormatInt(int64(s.Lease()), 16), limit: int64(limit)}, nil
}

type benchCoordPermitter struct {
	s *coord.Semaphore
	p *coord.Permit
}

func (c *benchCoordPermitter) acquire(ctx context.Context) (err error) {
	c.p, err = c.s.Acquire(ctx)
	return err
}

func (c *benchCoordPermitter) release(ctx context.Context) error { return c.p.Release(ctx) }
func (c *benchCoordPermitter) close()                            { _ = c.s.Close() }

// benchPlainPermitter is the semaphore a user writes with a
// concurrency.Session: a key on the session's lease under the prefix; it
// holds once fewer than limit keys created before it remain, and waits for
// deletes under the prefix meanwhile; release deletes the key.
type benchPlainPermitter struct {
	cli         *clientv3.Client
	s           *concurrency.Session
	prefix, key string
	limit       int64
}

func (c *benchPlainPermitter) acquire(ctx context.Context) error {
	put, err := c.cli.Put(ctx, c.key, "bench", clientv3.WithLease(c.s.Lease()))
	if err != nil {
		return err
	}
	if err := c.waitTurn(ctx, put.Header.Revision); err != nil {
		_, _ = c.cli.Delete(context.WithoutCancel(ctx), c.key)
		return err
	}
	return nil
}

// waitTurn waits until fewer than limit keys created before rev remain.
// They are read, not counted: a count-only Range counts the whole prefix,
// whatever WithMaxCreateRev says.
func (c *benchPlainPermitter) waitTurn(ctx context.Context, rev int64) error {
	for {
		g, err := c.cli.Get(ctx, c.prefix, clientv3.WithPrefix(), clientv3.WithMaxCreateRev(rev-1),
			clientv3.WithKeysOnly(), clientv3.WithLimit(c.limit))
		if err != nil {
			return err
		}
		if int64(len(g.Kvs)) < c.limit {
			return nil
		}
		if err := c.waitDelete(ctx, g.Header.Revision+1); err != nil {
			return err
		}
	}
}

// waitDelete waits for a delete under the prefix from rev on.
func (c *benchPlainPermitter) waitDelete(ctx context.Context, rev int64) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for wr := range c.cli.Watch(wctx, c.prefix, clientv3.WithPrefix(), clientv3.WithFilterPut(), clientv3.WithRev(rev)) {
		if err := wr.Err(); err != nil {
			return err
		}
		if len(wr.Events) > 0 {
			return nil
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return errors.New("bench: watch closed")
}

func (c *benchPlainPermitter) release(ctx context.Context) error {
	_, err := c.cli.Delete(ctx, c.key)
	return err
}

func (c *benchPlainPermitter) close() { _ = c.s.Close() }

// benchSemaphore measures scenario 11: Acquire → Release throughput of a
// crowd of contenders, and the handover from a holder's Release to the
// waiter behind it.
func benchSemaphore(ctx context.Context, env *benchEnv, cfg Config) ([]benchRow, error) {
	crate, prate, err := benchSemThroughput(ctx, env, cfg)
	if err != nil {
		return nil, err
	}
	rows := []benchRow{{
		scenario: fmt.Sprintf("11. Semaphore throughput: %d contenders, Limit %d, each looping Acquire → Release on one client (a session each); coord Semaphore vs concurrency.Session + Put / Range / Watch, cycles/s",
			cfg.semContenders, cfg.semLimit),
		coord: fmt.Sprintf("%.0f/s", crate),
		plain: fmt.Sprintf("%.0f/s", prate),
		ratio: benchRatio(crate, prate, "cycles/s; higher is better"),
		limit: "aim: ratio ≥ 1.0; a cycle: a put and a read of who is ahead, a delete; a waiter adds a watch event and a read",
	}}
	c, p, err := benchSemHandoffRounds(ctx, env, cfg)
	if err != nil {
		return rows, err
	}
	return append(rows, benchLatencyRow(
		fmt.Sprintf("11b. Semaphore Release → next waiter holds: Limit %d, %d permits held throughout, %d releases, waiter queued %s; p50 / p99",
			cfg.semLimit, cfg.semLimit-1, cfg.semRounds, cfg.semSettle),
		c, p, 0, "aim: ratio ≤ 1.1; floor: the delete, its watch event, one read of who is ahead")), nil
}

// benchSemThroughput runs each side's crowd chunk by chunk, the sides
// taking turns, so that they share the machine's noise, and returns the
// cycles per second of each.
func benchSemThroughput(ctx context.Context, env *benchEnv, cfg Config) (c, p float64, err error) {
	var crowds []*benchSemCrowd
	defer func() {
		for _, cr := range crowds {
			cr.close()
		}
	}()
	for _, side := range []string{"coord", "plain"} {
		cr := &benchSemCrowd{}
		crowds = append(crowds, cr)
		if err := cr.start(ctx, env, cfg, side); err != nil {
			return 0, 0, fmt.Errorf("%s: %w", side, err)
		}
		env.progress("scenario 11 (%s): %d contenders set up", side, len(cr.members))
	}
	for chunks := 0; time.Duration(chunks)*cfg.semChunk < cfg.semFor; chunks++ {
		for j := range crowds {
			k := (chunks + j) % len(crowds)
			if err := crowds[k].run(ctx, cfg.semChunk); err != nil {
				return 0, 0, err
			}
		}
	}
	env.progress("scenario 11: %d / %d cycles", crowds[0].n, crowds[1].n)
	return crowds[0].rate(), crowds[1].rate(), nil
}

// benchSemCrowd is one side's contenders of scenario 11, on one client of
// their own, each with its session.
type benchSemCrowd struct {
	side    string
	members []benchPermitter
	n       int           // cycles done
	took    time.Duration // over the chunks run
}

func (cr *benchSemCrowd) start(ctx context.Context, env *benchEnv, cfg Config, side string) error {
	cr.side = side
	cli, err := env.client()
	if err != nil {
		return err
	}
	key := env.electionKey("semaphore", "crowd", side)
	for range cfg.semContenders {
		m, err := newBenchPermitter(ctx, side, cli, key, cfg.semLimit)
		if err != nil {
			return err
		}
		cr.members = append(cr.members, m)
	}
	return nil
}

// run has every contender loop Acquire → Release for d, and counts the
// cycles and the time until the last contender is done.
func (cr *benchSemCrowd) run(ctx context.Context, d time.Duration) error {
	var (
		mu sync.Mutex
		n  int
	)
	t0 := time.Now()
	deadline := t0.Add(d)
	err := benchParallel(ctx, len(cr.members), len(cr.members), func(i int) error {
		m := cr.members[i]
		for time.Now().Before(deadline) {
			if err := m.acquire(ctx); err != nil {
				return fmt.Errorf("%s: acquire: %w", cr.side, err)
			}
			if err := m.release(ctx); err != nil {
				return fmt.Errorf("%s: release: %w", cr.side, err)
			}
			mu.Lock()
			n++
			mu.Unlock()
		}
		return nil
	})
	cr.n += n
	cr.took += time.Since(t0)
	return err
}

func (cr *benchSemCrowd) rate() float64 { return float64(cr.n) / cr.took.Seconds() }

func (cr *benchSemCrowd) close() {
	for _, m := range cr.members {
		m.close()
	}
}

// benchSemHandoffRounds runs the releases of row 11b on each side, the
// sides alternating round by round and taking turns going first, and
// returns the samples of each: Release → the waiter's Acquire returns.
func benchSemHandoffRounds(ctx context.Context, env *benchEnv, cfg Config) (c, p benchLatencies, err error) {
	sides := []string{"coord", "plain"}
	var pairs []*benchSemHandoff
	defer func() {
		for _, pr := range pairs {
			pr.close()
		}
	}()
	for _, side := range sides {
		pr := &benchSemHandoff{key: env.electionKey("semaphore", "handoff", side), limit: cfg.semLimit}
		pairs = append(pairs, pr)
		if err := pr.start(ctx, env, side); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", side, err)
		}
	}
	samples := make([]benchLatencies, len(pairs))
	for i := range cfg.semRounds {
		for j := range pairs {
			k := (i + j) % len(pairs)
			d, err := pairs[k].round(ctx, env.cli, cfg.semSettle)
			if err != nil {
				return nil, nil, fmt.Errorf("%s: %w", sides[k], err)
			}
			samples[k] = append(samples[k], d)
		}
	}
	for _, pr := range pairs {
		_ = pr.holder.release(ctx)
	}
	return samples[0], samples[1], nil
}

// benchSemHandoff is one side's semaphore of row 11b: limit − 1 permits
// held throughout on the shared client, and a holder and a waiter, each
// on a client of its own, handing the last permit back and forth.
type benchSemHandoff struct {
	key            string
	limit          int
	held           []benchPermitter
	holder, waiter benchPermitter
}

// start takes the permits held throughout, and the holder takes the last.
func (h *benchSemHandoff) start(ctx context.Context, env *benchEnv, side string) error {
	for range h.limit - 1 {
		m, err := newBenchPermitter(ctx, side, env.cli, h.key, h.limit)
		if err != nil {
			return err
		}
		h.held = append(h.held, m)
		if err := m.acquire(ctx); err != nil {
			return err
		}
	}
	for _, m := range []*benchPermitter{&h.holder, &h.waiter} {
		cli, err := env.client()
		if err != nil {
			return err
		}
		if *m, err = newBenchPermitter(ctx, side, cli, h.key, h.limit); err != nil {
			return err
		}
	}
	return h.holder.acquire(ctx)
}

// round queues the waiter, waits settle once its key is in line, releases
// the holder's permit and returns how long the waiter took to hold; then
// they swap.
func (h *benchSemHandoff) round(ctx context.Context, cli *clientv3.Client, settle time.Duration) (time.Duration, error) {
	res := make(chan benchCampaignResult, 1)
	go func() {
		err := h.waiter.acquire(ctx)
		res <- benchCampaignResult{time.Now(), err}
	}()
	if err := benchWaitCandidates(ctx, cli, h.key, int64(h.limit)+1, nil); err != nil {
		return 0, err
	}
	if err := benchSleep(ctx, settle); err != nil {
		return 0, err
	}
	t0 := time.Now()
	if err := h.holder.release(ctx); err != nil {
		return 0, err
	}
	select {
	case r := <-res:
		if r.err != nil {
			return 0, r.err
		}
		h.holder, h.waiter = h.waiter, h.holder
		return r.at.Sub(t0), nil
	case <-time.After(10 * time.Second):
		return 0, errors.New("bench: waiter not holding 10 s after release")
	}
}

func (h *benchSemHandoff) close() {
	for _, m := range append(h.held, h.holder, h.waiter) {
		if m != nil {
			m.close()
		}
	}
}

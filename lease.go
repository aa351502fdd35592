package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// keeper renews one lease on its own schedule, a third of the TTL after
// each answered renewal, and says when the lease is gone or has gone
// unanswered for too long. The etcd client's KeepAlive renews on a 500ms
// tick and only gives up after a whole TTL: too coarse for a leader that
// must step down before etcd expires its lease.
type keeper struct {
	cli *clientv3.Client
	id  clientv3.LeaseID
	ttl time.Duration
	log *slog.Logger

	cancel    context.CancelFunc
	lost      context.Context // ended by run when the lease is gone for good; err says why
	endLost   context.CancelFunc
	stale     chan struct{} // closed by run once renewals went unanswered for 2/3 of the TTL
	done      chan struct{} // closed when run returns
	err       error
	staleOnce sync.Once
}

// startKeeper renews lease id, granted with ttl by a request sent at sent.
func startKeeper(cli *clientv3.Client, id clientv3.LeaseID, ttl time.Duration, sent time.Time, log *slog.Logger) *keeper {
	ctx, cancel := context.WithCancel(context.Background())
	k := &keeper{
		cli: cli, id: id, ttl: ttl, log: log, cancel: cancel,
		stale: make(chan struct{}), done: make(chan struct{}),
	}
	k.lost, k.endLost = context.WithCancel(context.Background())
	go k.run(ctx, sent)
	return k
}

// stop ends the renewals (the lease is left to its owner) and waits.
func (k *keeper) stop() {
	k.cancel()
	<-k.done
	k.endLost()
}

func (k *keeper) run(ctx context.Context, renewed time.Time) {
	defer close(k.done)
	var r retry
	wait := time.Until(renewed.Add(k.ttl / 3))
	for sleep(ctx, wait) {
		// etcd renewed the lease after we sent the request, so the lease
		// lives at least until sent+TTL: measure from the send.
		sent := time.Now()
		deadline := renewed.Add(2 * k.ttl / 3)
		if !deadline.After(sent) {
			// Already stale: give each try a third of the TTL.
			deadline = sent.Add(k.ttl / 3)
		}
		// A member cut off from its peers cannot renew: with
		// WithRequireLeader it says so at once instead of holding the try
		// for its whole deadline, and the next try goes to another member.
		rctx, cancel := context.WithDeadline(clientv3.WithRequireLeader(ctx), deadline)
		_, err := k.cli.KeepAliveOnce(rctx, k.id)
		cancel()
		if err == nil {
			renewed, r = sent, retry{}
			wait = time.Until(renewed.Add(k.ttl / 3))
			continue
		}
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			k.end(fmt.Errorf("coord: lease %x expired or revoked", int64(k.id)))
			return
		}
		if k.cli.Ctx().Err() != nil {
			k.end(ErrClientClosed)
			return
		}
		if time.Since(renewed) >= 2*k.ttl/3 {
			k.markStale()
		}
		k.log.Debug("coord: lease renewal failed", "lease", fmt.Sprintf("%x", int64(k.id)), "err", err)
		// Several tries must fit in what is left of the TTL: a try that
		// fails fast (a member without leader) is worth repeating soon,
		// on another member.
		wait = min(r.next(), k.ttl/10)
	}
}

func (k *keeper) markStale() {
	k.staleOnce.Do(func() {
		k.log.Warn("coord: lease renewals unanswered", "lease", fmt.Sprintf("%x", int64(k.id)), "ttl", k.ttl)
		close(k.stale)
	})
}

func (k *keeper) end(err error) {
	k.err = err
	k.endLost()
}

// revoke revokes a lease, within ttl at most. A lease that is already gone
// is not an error; on a closed client it fails at once.
func revoke(ctx context.Context, cli *clientv3.Client, id clientv3.LeaseID, ttl time.Duration) error {
	// A closed client sends nothing more: as after a crash, the lease is
	// left to expire. (The client's connection outlives its Close by a
	// moment; a revoke sent then would still land.)
	if cli.Ctx().Err() != nil {
		return ErrClientClosed
	}
	ctx, cancel := clientCtx(ctx, cli)
	defer cancel()
	ctx, cancelT := context.WithTimeout(ctx, ttl)
	defer cancelT()
	_, err := cli.Revoke(ctx, id)
	if err == nil || errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return nil
	}
	return opErr(fmt.Sprintf("revoke lease %x", int64(id)), err)
}

// revokeQuietly revokes a lease we no longer need, even after ctx ended,
// bounded by ttl. Failure is only logged: the lease expires by itself.
func revokeQuietly(ctx context.Context, cli *clientv3.Client, id clientv3.LeaseID, ttl time.Duration, log *slog.Logger) {
	err := revoke(context.WithoutCancel(ctx), cli, id, ttl)
	log.Debug("coord: revoked lease", "lease", hexID(id), "err", err)
}

// session is an election's lease. It ends when etcd says the lease is gone,
// when renewals go unanswered for 2/3 of the TTL (so that a leader cut off
// steps down before etcd can elect another), or when its parent ends; then
// it revokes the lease, retrying until etcd answers, so that its keys go.
type session struct {
	cli *clientv3.Client
	id  clientv3.LeaseID
	ttl time.Duration
	log *slog.Logger

	parent context.Context // its owner's life
	ctx    context.Context // done when the session has ended
	cancel context.CancelFunc
	mu     sync.Mutex
	err    error
}

// startSession grants a lease (bounded by ctx) and keeps it until parent
// ends; wg counts the session's goroutine.
func startSession(ctx, parent context.Context, cli *clientv3.Client, ttl time.Duration, log *slog.Logger, wg *sync.WaitGroup) (*session, error) {
	sent := time.Now()
	g, err := cli.Grant(ctx, int64(ttl/time.Second))
	if err != nil {
		return nil, fmt.Errorf("grant session lease: %w", err)
	}
	s := &session{cli: cli, id: g.ID, ttl: time.Duration(g.TTL) * time.Second, log: log.With("lease", hexID(g.ID))}
	s.parent = parent
	s.ctx, s.cancel = context.WithCancel(parent)
	k := startKeeper(cli, g.ID, s.ttl, sent, s.log)
	wg.Add(1)
	go s.run(k, wg)
	return s, nil
}

func (s *session) run(k *keeper, wg *sync.WaitGroup) {
	defer wg.Done()
	select {
	case <-k.lost.Done():
		s.end(k.err)
	case <-k.stale:
		s.end(errors.New("coord: lease renewals unanswered"))
	case <-s.ctx.Done():
		s.end(ErrClosed)
	}
	k.stop()
	var r retry
	for {
		err := revoke(context.Background(), s.cli, s.id, s.ttl)
		// Once the parent has ended, one try is all: its owner is closing.
		if err == nil || s.cli.Ctx().Err() != nil || !sleep(s.parent, r.next()) {
			s.log.Debug("coord: session released", "err", err)
			return
		}
	}
}

// end ends the session, recording why (the first reason wins).
func (s *session) end(err error) {
	s.mu.Lock()
	if s.err == nil {
		s.err = err
	}
	s.mu.Unlock()
	s.cancel()
}

// Err says why the session ended.
func (s *session) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// hexID formats a lease ID as etcd tools do.
func hexID(id clientv3.LeaseID) string { return fmt.Sprintf("%x", int64(id)) }

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
// each answered renewal, over its client's one renewal stream (renewer),
// and says when the lease is gone or has gone unanswered for too long. The
// etcd client's KeepAlive renews on a 500ms tick and only gives up after a
// whole TTL: too coarse for a leader that must step down before etcd
// expires its lease.
//
// Staleness is judged on the clock, not by the renewal tries: etcd keeps
// the lease at least a TTL after it received the last request it answered,
// so the lease is ours for sure until that request's send time + 2/3 TTL
// (a third of the TTL is left as margin for etcd's expiry and clock rates).
// Past that point the keeper is stale, whatever a try in flight later
// says: a timer marks it, and valid checks again at each call, so that a
// process paused past the point never acts on a lease it may have lost.
// It goes on renewing: a renewal sent after it went stale and answered
// (the lease lived on: etcd answers a lease it no longer has with TTL 0)
// vouches for the lease again, from a new up context.
type keeper struct {
	cli *clientv3.Client
	r   *renewer
	id  clientv3.LeaseID
	ttl time.Duration
	log *slog.Logger

	cancel  context.CancelFunc
	lost    context.Context // ended by run when the lease is gone for good (its cause says why), or by stop
	endLost context.CancelCauseFunc
	done    chan struct{} // closed when run returns

	mu       sync.Mutex
	answered time.Time // send time of the last request etcd answered
	live     bool      // answered is recent enough to vouch for the lease
	grace    time.Time // while !live: when a late grant's first renewal is due an answer
	// up ends (cause errUnanswered) when renewals have gone unanswered
	// for 2/3 of the TTL, or when the keeper stops (the cause given to
	// stop); a new one starts when etcd answers a renewal sent after that.
	up      context.Context
	endUp   context.CancelCauseFunc
	isStale bool          // up ended for want of answers
	staleAt time.Time     // when it did: renewals sent since vouch for the lease again
	fresh   chan struct{} // closed and replaced at each answer
	timer   *time.Timer   // marks staleness on time
	stopped bool
}

// startKeeper renews lease id, granted with ttl by a request sent at sent.
// A grant answered so late that its lease may already be near expiry (as
// after an outage) is renewed at once, and is given a third of the TTL for
// that renewal to be answered before it is stale.
func startKeeper(cli *clientv3.Client, id clientv3.LeaseID, ttl time.Duration, sent time.Time, log *slog.Logger) *keeper {
	ctx, cancel := context.WithCancel(context.Background())
	now := time.Now()
	k := &keeper{
		cli: cli, r: acquireRenewer(cli), id: id, ttl: ttl, log: log, cancel: cancel,
		done: make(chan struct{}), fresh: make(chan struct{}),
		answered: sent, live: now.Before(sent.Add(2 * ttl / 3)), grace: now.Add(ttl / 3),
	}
	k.lost, k.endLost = context.WithCancelCause(context.Background())
	k.up, k.endUp = context.WithCancelCause(context.Background())
	k.mu.Lock()
	k.timer = time.AfterFunc(time.Until(k.deadlineLocked()), k.checkStale)
	k.mu.Unlock()
	go k.run(ctx)
	return k
}

// stop ends the renewals (the lease is left to its owner) and waits; the
// up context ends with cause (nil: context.Canceled).
func (k *keeper) stop(cause error) {
	k.cancel()
	<-k.done
	k.r.release()
	k.mu.Lock()
	k.stopped = true
	k.timer.Stop()
	k.endUp(cause)
	k.mu.Unlock()
	k.endLost(nil)
}

func (k *keeper) run(ctx context.Context) {
	defer close(k.done)
	var r retry
	wait := time.Until(k.lastAnswer().Add(k.ttl / 3))
	for sleep(ctx, wait) {
		sent := time.Now()
		// Two tries fit in the third of the TTL between a renewal due and
		// staleness: one that hangs does not use up the whole window.
		rctx, cancel := context.WithTimeout(ctx, k.ttl/6)
		err := k.r.renew(rctx, k.id)
		cancel()
		if err == nil {
			k.answer(sent)
			r = retry{}
			wait = time.Until(sent.Add(k.ttl / 3))
			continue
		}
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			k.endLost(fmt.Errorf("lease %x expired or revoked", int64(k.id)))
			return
		}
		if k.cli.Ctx().Err() != nil {
			k.endLost(ErrClientClosed)
			return
		}
		k.log.Debug("coord: lease renewal failed", "lease", hexID(k.id), "err", err)
		// Several tries must fit in what is left of the TTL: a try that
		// fails fast (a member without leader) is worth repeating soon,
		// on another member.
		wait = min(r.next(), k.ttl/10)
	}
}

// answer records that etcd answered a renewal sent at sent.
func (k *keeper) answer(sent time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.live && !sent.Before(k.answered.Add(2*k.ttl/3)) {
		// Sent after the lease could no longer be vouched for: the
		// lapse stands, though etcd renewed the lease.
		k.markStaleLocked()
	}
	k.answered, k.live = sent, true
	if k.isStale && !sent.Before(k.staleAt) && !k.stopped {
		// Sent once stale, and answered: the lease lived on, and is
		// vouched for again, from a new up.
		k.isStale = false
		k.up, k.endUp = context.WithCancelCause(context.Background())
		k.timer.Reset(time.Until(k.deadlineLocked()))
		k.log.Info("coord: lease renewals answered again", "lease", hexID(k.id), "ttl", k.ttl)
	}
	close(k.fresh)
	k.fresh = make(chan struct{})
}

// deadlineLocked returns when the keeper turns stale without an answer.
func (k *keeper) deadlineLocked() time.Time {
	if !k.live {
		return k.grace
	}
	return k.answered.Add(2 * k.ttl / 3)
}

// checkStale runs on the timer: it marks the keeper stale once its
// deadline has passed, or waits for the deadline an answer moved.
func (k *keeper) checkStale() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.lapsedLocked() && !k.stopped {
		k.timer.Reset(time.Until(k.deadlineLocked()))
	}
}

// valid reports whether the lease is vouched for now, judged on the
// monotonic clock at the call: a lapse found here marks the keeper stale
// at once, before the timer says so.
func (k *keeper) valid() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return !k.lapsedLocked() && k.live
}

// lapsedLocked marks the keeper stale once its deadline has passed, and
// reports whether it is stale.
func (k *keeper) lapsedLocked() bool {
	if !time.Now().Before(k.deadlineLocked()) {
		k.markStaleLocked()
	}
	return k.isStale
}

// vouch returns the up context (see upCtx) if the lease is vouched for
// now (see valid), else nil: both judged at once.
func (k *keeper) vouch() context.Context {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.lapsedLocked() || !k.live {
		return nil
	}
	return k.up
}

// upCtx returns the context that ends when the lease can no longer be
// vouched for (cause errUnanswered), or when the keeper stops (the cause
// given to stop).
func (k *keeper) upCtx() context.Context {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.up
}

// renewed returns a channel closed at the next answer.
func (k *keeper) renewed() <-chan struct{} {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.fresh
}

// lastAnswer returns the send time of the last request etcd answered.
func (k *keeper) lastAnswer() time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.answered
}

func (k *keeper) markStaleLocked() {
	if k.isStale || k.stopped {
		return
	}
	k.isStale, k.staleAt = true, time.Now()
	k.log.Warn("coord: lease renewals unanswered", "lease", hexID(k.id), "ttl", k.ttl)
	k.endUp(errUnanswered)
}

// revoke revokes a lease, within ttl at most. A lease that is already gone
// is not an error, nor is a closed client: it sends nothing more, and the
// lease is left to expire, as after a crash. (The client's connection
// outlives its Close by a moment; a revoke sent then would still land.)
func revoke(ctx context.Context, cli *clientv3.Client, id clientv3.LeaseID, ttl time.Duration) error {
	if cli.Ctx().Err() != nil {
		return nil
	}
	ctx, cancel := clientCtx(ctx, cli)
	defer cancel()
	ctx, cancelT := context.WithTimeout(ctx, ttl)
	defer cancelT()
	if _, err := cli.Revoke(ctx, id); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("revoke lease %x: %w", int64(id), err)
	}
	return nil
}

// session is an election's lease. It ends when etcd says the lease is gone,
// or when its parent ends; then it revokes the lease, retrying until etcd
// answers, so that its keys go. Its ctx's cause says why it ended. When
// renewals go unanswered for 2/3 of the TTL, its terms step down (so that
// a leader cut off steps down before etcd can elect another: see
// takeLead), but the session lives on for two TTLs more: its keys may be
// taken back once etcd answers again (see stepped), after an etcd leader
// change or a cut shorter than the lease. Then it ends: a link slow
// enough that no renewal is answered in time may still carry them to
// etcd, and keep a lease alive that nobody can use, with its keys. A
// session on a host registration's lease deletes its keys instead of
// revoking (see startHostSession).
type session struct {
	cli *clientv3.Client
	id  clientv3.LeaseID
	ttl time.Duration
	log *slog.Logger
	k   *keeper

	parent context.Context // its owner's life
	ctx    context.Context // done when the session has ended
	cancel context.CancelCauseFunc

	// A host session's (see startHostSession); nil for one of its own.
	host  *hostLease
	swept chan struct{}  // closed once its keys are deleted, or left to the lease
	puts  sync.WaitGroup // its puts under way; added to under mu while ctx lives
	mu    sync.Mutex
	names map[string]bool // the keys put on it
}

// errUnanswered is why a term whose session's renewals went unanswered
// ended.
var errUnanswered = errors.New("lease renewals unanswered")

// startSession grants a lease and keeps it until parent ends; wg counts
// the session's goroutines. It returns at ctx's end, but the grant is not
// bound to ctx, nor to parent (etcd may carry out a grant whose caller gave
// up): it goes on, bounded by the TTL and the client's life, and a lease it
// gets then is revoked.
func startSession(ctx, parent context.Context, cli *clientv3.Client, ttl time.Duration, log *slog.Logger, wg *sync.WaitGroup) (*session, error) {
	if ctx.Err() != nil {
		return nil, fmt.Errorf("grant session lease: %w", ctx.Err())
	}
	type grant struct {
		g    *clientv3.LeaseGrantResponse
		err  error
		sent time.Time
	}
	res := make(chan grant)
	abandoned := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		gctx, cancel := clientCtx(context.WithoutCancel(parent), cli)
		defer cancel()
		gctx, cancelT := context.WithTimeout(gctx, ttl)
		defer cancelT()
		sent := time.Now()
		g, err := cli.Grant(gctx, int64(ttl/time.Second))
		select {
		case res <- grant{g, err, sent}:
		case <-abandoned:
			if err == nil {
				err = revoke(context.Background(), cli, g.ID, time.Duration(g.TTL)*time.Second)
				log.Debug("coord: revoked a session lease granted after its caller gave up", "lease", hexID(g.ID), "err", err)
			}
		}
	}()
	var r grant
	select {
	case r = <-res:
	case <-ctx.Done():
		close(abandoned)
		return nil, fmt.Errorf("grant session lease: %w", ctx.Err())
	}
	if r.err != nil {
		return nil, fmt.Errorf("grant session lease: %w", r.err)
	}
	g, sent := r.g, r.sent
	s := &session{cli: cli, id: g.ID, ttl: time.Duration(g.TTL) * time.Second, log: log.With("lease", hexID(g.ID))}
	s.parent = parent
	s.ctx, s.cancel = context.WithCancelCause(parent)
	s.k = startKeeper(cli, g.ID, s.ttl, sent, s.log)
	wg.Add(1)
	go s.run(wg)
	return s, nil
}

func (s *session) run(wg *sync.WaitGroup) {
	defer wg.Done()
	if err := s.hold(); err != nil {
		s.end(err)
	}
	if s.host != nil {
		s.sweep()
		return
	}
	// The session has ended: its terms end with its cause, whether they
	// learn it from it or from its keeper's up context (see takeLead).
	s.k.stop(context.Cause(s.ctx))
	var r retry
	for {
		// Each try is bounded by a third of the TTL: one sent while etcd
		// has no leader must not hold the next back once it has one.
		err := revoke(context.Background(), s.cli, s.id, s.ttl/3)
		// Once the parent has ended, one try is all: its owner is closing.
		if err == nil || !sleep(s.parent, min(r.next(), s.ttl/10)) {
			s.log.Debug("coord: session released", "err", err)
			return
		}
		s.log.Debug("coord: session lease not revoked, trying again", "err", err)
	}
}

// hold waits until the session ends, and returns why if it ended by
// itself: the lease gone, or renewals unanswered for two TTLs after a
// step-down (measured, as the step-down, from the last answered renewal).
func (s *session) hold() error {
	for {
		select {
		case <-s.k.lost.Done():
			return context.Cause(s.k.lost)
		case <-s.ctx.Done():
			return nil
		case <-s.k.upCtx().Done():
		}
		s.log.Debug("coord: session stepped down, its lease kept for two TTLs for etcd to answer again")
		giveUp := time.NewTimer(time.Until(s.k.lastAnswer().Add(2*s.ttl/3 + 2*s.ttl)))
		for s.k.vouch() == nil {
			select {
			case <-s.k.renewed():
			case <-giveUp.C:
				return errUnanswered
			case <-s.k.lost.Done():
				return context.Cause(s.k.lost)
			case <-s.ctx.Done():
				return nil
			}
		}
		giveUp.Stop()
	}
}

// end ends the session, recording why (the first reason wins).
func (s *session) end(err error) { s.cancel(err) }

// Err says why the session ended; nil while it lives.
func (s *session) Err() error { return context.Cause(s.ctx) }

// valid reports whether the session lives and its lease is vouched for
// now (see keeper.valid).
func (s *session) valid() bool { return s.ctx.Err() == nil && s.k.valid() }

// ready waits until the session's lease is vouched for (see keeper.valid),
// and returns the keeper's up context then (see keeper.upCtx): a session
// granted late, or whose renewals went unanswered, waits for etcd to
// answer one. It returns an error if the session ends first, or ctx does.
func (s *session) ready(ctx context.Context) (context.Context, error) {
	for {
		if s.ctx.Err() == nil {
			if up := s.k.vouch(); up != nil {
				return up, nil
			}
		}
		select {
		case <-s.k.renewed():
		case <-s.ctx.Done():
			return nil, fmt.Errorf("%w: session ended: %w", ErrLeadershipLost, s.Err())
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for the session's renewals to be answered: %w", ctx.Err())
		}
	}
}

// hexID formats a lease ID as etcd tools do.
func hexID(id clientv3.LeaseID) string { return fmt.Sprintf("%x", int64(id)) }

// unanswered says whether the keeper's renewals have gone unanswered too
// long at now. A renewal is sent a third of the TTL after the last one
// etcd answered and is tried for a sixth of it: the lease is in doubt once
// that try is over without an answer, or a second after it was sent if
// that is sooner (TTLs over 6 s), so that an outage is told within a third
// of the TTL and a second, long before the keeper turns stale. Judging at
// a third of the TTL exactly would fail a check that lands during the
// round trip of every renewal.
func (k *keeper) unanswered(now time.Time) error {
	if age := now.Sub(k.lastAnswer()); age > k.ttl/3+min(k.ttl/6, time.Second) {
		return fmt.Errorf("lease %x: no renewal answered for %v (TTL %v)", int64(k.id), age.Round(time.Millisecond), k.ttl)
	}
	return nil
}

// judgeSession judges the session of a campaign or an acquire under way:
// granting is when we started to go without a live session (zero while we
// have one), s the latest session, if any.
func judgeSession(s *session, granting time.Time, ttl time.Duration, now time.Time) error {
	if !granting.IsZero() && now.Sub(granting) > ttl {
		return fmt.Errorf("no session granted for %v (TTL %v)", now.Sub(granting).Round(time.Millisecond), ttl)
	}
	if s != nil {
		return s.k.unanswered(now)
	}
	return nil
}

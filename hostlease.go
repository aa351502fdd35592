package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// One lease per host: with a Host (PoolOptions, SemaphoreOptions,
// ShardOptions), keys ride the lease of our registration rather than
// leases of their own, so that an agent holds one lease, renewed by one
// keeper, and its host going down releases everything at once.
//
// A session on the host's lease (a host session) is a session as any
// other for the terms on it: the same keeper (the registration's) says
// when to step down, and when etcd answers again. What differs is its
// end. The lease is not the session's to revoke: the registration, and
// other sessions, hold it. So a host session that ends deletes the keys
// it put (sweep), each only while it is still on our lease; if etcd
// cannot be told within the TTL, the registration leaves the lease (it
// registers again on a new one, and the old one, renewed by nobody,
// expires with the keys). And when the registration leaves the lease
// (lost, its key deleted, Stop), every host session on it ends at once,
// before the lease is revoked: their keys go with it.
//
// Candidate keys are named after the lease. Two owners on one host that
// used the same election key would share a key name, and each take the
// other's key for its own: an owner claims its keys on the host first
// (ErrInUse for a key another holds).

// hostLease is one lease of a registration, lent to host sessions.
type hostLease struct {
	id  clientv3.LeaseID
	ttl time.Duration
	k   *keeper
	// ctx ends, its cause saying why, when the registration leaves the
	// lease; leave makes it leave (and register again on a new one).
	ctx   context.Context
	leave context.CancelCauseFunc

	mu       sync.Mutex
	sessions map[*session]bool
	why      error // why the registration left the lease, once it has
}

// join adds s to the sessions on the lease, unless the registration has
// left it (false).
func (hl *hostLease) join(s *session) bool {
	hl.mu.Lock()
	defer hl.mu.Unlock()
	if hl.why == nil {
		hl.sessions[s] = true
	}
	return hl.why == nil
}

// part forgets s, ended.
func (hl *hostLease) part(s *session) {
	hl.mu.Lock()
	defer hl.mu.Unlock()
	delete(hl.sessions, s)
}

// end is the registration leaving the lease, for cause: every session
// on it ends now, so that their terms end before the lease is revoked.
func (hl *hostLease) end(cause error) {
	hl.mu.Lock()
	defer hl.mu.Unlock()
	hl.leave(cause)
	hl.why = cause
	for s := range hl.sessions {
		s.end(cause)
	}
}

// lend makes the lease of registration reg, renewed by k, the one that
// host sessions ride, until the returned hostLease's end. ctx is the
// registration's life.
func (h *HostLiveness) lend(ctx context.Context, reg registration, k *keeper) *hostLease {
	hl := &hostLease{id: reg.lease, ttl: reg.ttl, k: k, sessions: map[*session]bool{}}
	hl.ctx, hl.leave = context.WithCancelCause(ctx)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lent = hl
	close(h.relent)
	h.relent = make(chan struct{})
	return hl
}

// unlend ends hl (see hostLease.end), err saying why the registration
// left it: ErrHostGone if that ends the registration (Stop, taken over,
// the client closed: see run). hold calls it before its keeper stops,
// and before a heal or Stop revokes the lease.
func (h *HostLiveness) unlend(hl *hostLease, err error) {
	h.mu.Lock()
	h.lent = nil
	h.mu.Unlock()
	if errors.Is(err, ErrHostExists) || fatal(h.life, h.cli, err) != nil {
		err = ErrHostGone
	} else {
		err = fmt.Errorf("host registration left lease %x: %w", int64(hl.id), err)
	}
	hl.end(err)
}

// borrow joins s to the lease host sessions ride, and returns it,
// waiting within ctx while the registration heals; ErrHostGone once it
// is over.
func (h *HostLiveness) borrow(ctx context.Context, s *session) (*hostLease, error) {
	for {
		h.mu.Lock()
		hl, relent := h.lent, h.relent
		h.mu.Unlock()
		select {
		case <-h.exited: // ended by itself: taken over, client closed
			return nil, ErrHostGone
		default:
		}
		if h.life.Err() != nil {
			return nil, ErrHostGone
		}
		if hl != nil && hl.join(s) {
			return hl, nil
		}
		select {
		case <-relent:
		case <-h.exited: // over: see above
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for the host's registration: %w", ctx.Err())
		}
	}
}

// claim reserves key, an election's or a semaphore's, for one owner on
// the host (see above), until the returned func is called.
func (h *HostLiveness) claim(key string) (func(), error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.claims[key] {
		return nil, fmt.Errorf("%w: %q is held on host %q by another owner", ErrInUse, key, h.id)
	}
	h.claims[key] = true
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		delete(h.claims, key)
	}, nil
}

// startHostSession starts a session on h's lease (see above), waiting
// within ctx while the registration heals; it ends when parent does, or
// when the registration leaves the lease. wg counts its goroutine. after,
// if not nil, is an earlier session of the same owner on h: its keys have
// the names of this one's, so its sweep must be over first.
func startHostSession(ctx, parent context.Context, h *HostLiveness, after *session, log *slog.Logger, wg *sync.WaitGroup) (*session, error) {
	if after != nil && !within(ctx, after.swept) {
		return nil, fmt.Errorf("wait for the keys of an ended session to be deleted: %w", ctx.Err())
	}
	s := &session{cli: h.cli, parent: parent, names: map[string]bool{}, swept: make(chan struct{})}
	s.ctx, s.cancel = context.WithCancelCause(parent)
	hl, err := h.borrow(ctx, s)
	if err != nil {
		s.end(err)
		return nil, err
	}
	s.id, s.ttl, s.log, s.k, s.host = hl.id, hl.ttl, log.With("lease", hexID(hl.id)), hl.k, hl
	wg.Add(1)
	go s.run(wg)
	return s, nil
}

// sending records that a put of key on s's lease, bound to s.ctx, is
// about to be sent, and returns the func to call once its outcome is
// known: a host session sweeps its keys once its puts are over. Once s has
// ended, nothing is recorded: the put is not sent (gRPC sends no call
// whose ctx has ended). Other sessions record nothing: their lease takes
// their keys.
func (s *session) sending(key string) (sent func()) {
	if s.host == nil {
		return func() {}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx.Err() != nil {
		return func() {}
	}
	s.names[key] = true
	s.puts.Add(1)
	return s.puts.Done
}

// sweepBatch is how many keys one transaction of a sweep deletes: well
// under etcd's default limit of 128 operations a transaction.
const sweepBatch = 32

// sweep deletes the keys host session s put, which has ended, once its
// puts are over: each only while it is on our lease (the name may have
// been deleted, or taken by another lease since). If the registration
// has left the lease, there is nothing to do: the lease goes, with the
// keys; nor once the client is closed. If etcd cannot be told within the
// TTL, the registration leaves the lease.
func (s *session) sweep() {
	defer close(s.swept)
	s.host.part(s)
	s.mu.Lock() // no put starts from here on: s.ctx has ended
	names := make([]string, 0, len(s.names))
	for name := range s.names {
		names = append(names, name)
	}
	s.mu.Unlock()
	s.puts.Wait()
	// A closed client sends nothing more, as after a crash (see revoke):
	// the keys go with the lease.
	if s.host.ctx.Err() != nil || len(names) == 0 || s.cli.Ctx().Err() != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.ttl)
	defer cancel()
	var r retry
	for len(names) > 0 {
		n := min(len(names), sweepBatch)
		ops := make([]clientv3.Op, 0, n)
		for _, name := range names[:n] {
			ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(name), "=", s.id)},
				[]clientv3.Op{clientv3.OpDelete(name)}, nil))
		}
		tctx, cancelT := context.WithTimeout(ctx, s.ttl/3)
		_, err := s.cli.Txn(tctx).Then(ops...).Commit()
		cancelT()
		if err == nil {
			names = names[n:]
			continue
		}
		if fatal(ctx, s.cli, err) != nil || !sleep(ctx, min(r.next(), s.ttl/10)) {
			s.log.Warn("coord: keys of an ended session not deleted, the registration leaves its lease", "keys", len(names), "err", err)
			s.host.leave(fmt.Errorf("%w: %d keys of an ended session not deleted: %w", errLeft, len(names), err))
			return
		}
	}
	s.log.Debug("coord: host session swept", "err", s.Err())
}

// errLeft is why a registration left a lease that still lives: it
// registers again on a new one.
var errLeft = errors.New("lease left")

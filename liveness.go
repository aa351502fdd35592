package coord

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// HostLiveness is a host's registration: a lease kept alive in the
// background, holding the host's metadata at its key. It heals by itself
// until Stop. It is safe for concurrent use.
type HostLiveness struct {
	cli    *clientv3.Client
	key    string
	reqTTL time.Duration
	log    *slog.Logger
	signal func(Signal)

	cancel context.CancelFunc
	writes chan struct{} // a one-slot semaphore: one write of the key at a time
	done   chan struct{} // closed by run when the registration ends for good
	exited chan struct{} // closed when run returns

	mu       sync.Mutex
	meta     HostMetadata
	lease    clientv3.LeaseID
	ttl      time.Duration
	err      error
	stopOnce sync.Once
	stopErr  error
}

// registration is one lease holding the key.
type registration struct {
	lease clientv3.LeaseID
	ttl   time.Duration
	rev   int64     // revision of the put
	sent  time.Time // when the grant was sent
}

// RegisterHostLiveness registers meta at <prefix><meta.HostUUID> under a new
// lease and keeps it alive until Stop. ctx bounds the registration only.
//
// If the key is held by another live lease, it waits for that lease's
// remaining TTL plus etcd's expiry slack (bounded by ctx) and returns an
// error wrapping ErrHostExists if the key is still held then; with
// opts.Takeover it overwrites the key at once. Invalid arguments return an
// error and write nothing.
func RegisterHostLiveness(ctx context.Context, cli *clientv3.Client, meta HostMetadata, opts LivenessOptions) (*HostLiveness, error) {
	if cli == nil {
		return nil, ErrNilClient
	}
	if err := checkHostUUID(meta.HostUUID); err != nil {
		return nil, err
	}
	prefix, err := prefixOrDefault(opts.Prefix)
	if err != nil {
		return nil, err
	}
	ttl, err := ttlOrDefault(opts.TTL, DefaultLivenessTTL)
	if err != nil {
		return nil, err
	}
	h := &HostLiveness{
		cli:    cli,
		key:    prefix + meta.HostUUID,
		reqTTL: ttl,
		log:    logger(opts.Logger).With("host", meta.HostUUID),
		signal: opts.OnSignal,
		writes: make(chan struct{}, 1),
		done:   make(chan struct{}),
		exited: make(chan struct{}),
		meta:   meta,
	}
	reg, err := h.register(ctx, !opts.Takeover, opts.Takeover)
	if err != nil {
		return nil, fmt.Errorf("coord: register host %q: %w", meta.HostUUID, err)
	}
	h.log.Info("coord: host registered", "key", h.key, "lease", hexID(reg.lease), "ttl", reg.ttl)
	emit(h.signal, Signal{Kind: SignalRegistered, Host: meta.HostUUID, Key: h.key, Lease: reg.lease})
	loopCtx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go h.run(loopCtx, reg)
	return h, nil
}

// register writes the host's latest metadata under a new lease. If another
// lease holds the key it waits that lease out when wait is set, overwrites
// it when takeover is set, and returns ErrHostExists otherwise.
func (h *HostLiveness) register(ctx context.Context, wait, takeover bool) (registration, error) {
	var waited clientv3.LeaseID
	// A member without leader fails the calls at once: a heal retries on
	// another member rather than waiting out its attempt.
	ctx = clientv3.WithRequireLeader(ctx)
	for {
		h.mu.Lock()
		meta := h.meta
		h.mu.Unlock()
		// Strings and a map of strings: encoding cannot fail.
		val, _ := json.Marshal(meta)
		sent := time.Now()
		g, err := h.cli.Grant(ctx, int64(h.reqTTL/time.Second))
		if err != nil {
			return registration{}, opErr("grant lease", err)
		}
		reg := registration{lease: g.ID, ttl: time.Duration(g.TTL) * time.Second, sent: sent}
		// A key without a lease holds no host: write over it.
		free := []clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(h.key), "=", clientv3.NoLease)}
		if takeover {
			free = nil
		}
		resp, err := h.cli.Txn(ctx).If(free...).
			Then(clientv3.OpPut(h.key, string(val), clientv3.WithLease(g.ID))).
			Else(clientv3.OpGet(h.key)).Commit()
		if err == nil && resp.Succeeded {
			reg.rev = resp.Header.Revision
			h.mu.Lock()
			h.lease, h.ttl = reg.lease, reg.ttl
			h.mu.Unlock()
			return reg, nil
		}
		// Ours is not needed (yet): do not leave it to expire.
		revokeQuietly(ctx, h.cli, g.ID, reg.ttl, h.log)
		if err != nil {
			return registration{}, opErr("put host key", err)
		}
		holder := resp.Responses[0].GetResponseRange().Kvs[0]
		if !wait || clientv3.LeaseID(holder.Lease) == waited {
			return registration{}, fmt.Errorf("%w: key %q held by lease %x", ErrHostExists, h.key, holder.Lease)
		}
		waited = clientv3.LeaseID(holder.Lease)
		if err := h.waitOut(ctx, waited, resp.Header.Revision); err != nil {
			return registration{}, err
		}
	}
}

// waitOut waits until the key is deleted, or until lease would have expired
// had nobody renewed it.
func (h *HostLiveness) waitOut(ctx context.Context, lease clientv3.LeaseID, rev int64) error {
	// If the lease cannot be read, the longest it can have left is the TTL
	// we ask for ourselves, as far as we know.
	left := h.reqTTL + expirySlack
	if ttl, err := h.cli.TimeToLive(ctx, lease); err == nil {
		// etcd rounds the remaining TTL down to whole seconds.
		left = time.Duration(max(ttl.TTL, 0)+1)*time.Second + expirySlack
	}
	h.log.Info("coord: host key held by another lease, waiting it out", "key", h.key, "lease", hexID(lease), "wait", left)
	wctx, cancel := context.WithTimeout(ctx, left)
	defer cancel()
	for wr := range h.cli.Watch(wctx, h.key, clientv3.WithRev(rev+1)) {
		for _, ev := range wr.Events {
			if ev.Type == mvccpb.DELETE {
				return nil
			}
		}
	}
	if ctx.Err() != nil {
		return opErr("wait for holder's lease", ctx.Err())
	}
	return nil
}

// run holds the registration and heals it until ctx ends or it cannot.
func (h *HostLiveness) run(ctx context.Context, reg registration) {
	defer close(h.exited)
	var err error
	for {
		err = h.hold(ctx, reg)
		if errors.Is(err, ErrHostExists) || fatal(ctx, h.cli, err) != nil {
			break
		}
		h.log.Warn("coord: host registration lost, healing", "key", h.key, "lease", hexID(reg.lease), "err", err)
		if reg, err = h.heal(ctx, reg.lease); err != nil {
			break
		}
		h.log.Info("coord: host registration healed", "key", h.key, "lease", hexID(reg.lease), "ttl", reg.ttl)
	}
	if ctx.Err() != nil {
		err = nil // stopped
	}
	h.finish(err)
}

// hold keeps reg alive and returns why it ended. The key is the judge: a
// lease that expires or is revoked deletes the key with it.
func (h *HostLiveness) hold(ctx context.Context, reg registration) error {
	k := startKeeper(h.cli, reg.lease, reg.ttl, reg.sent, h.log)
	defer k.stop()
	// Cancelled on return: ends every watch opened below. When etcd says
	// the lease is gone, the watch ends too and the key is read again: the
	// watch may have missed the delete (a connection that lost data).
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	defer context.AfterFunc(k.lost, cancel)()
	rev := reg.rev
	wch := h.cli.Watch(wctx, h.key, clientv3.WithRev(rev+1))
	var r retry
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil {
				if err := fatal(ctx, h.cli, wr.Err()); err != nil {
					return fmt.Errorf("coord: watch host key %q: %w", h.key, err)
				}
				// The watch broke (no leader, compaction): read the key
				// and watch on from there.
				h.log.Debug("coord: host key watch broke", "key", h.key, "err", wr.Err())
				sleep(ctx, r.next())
				if g, err := h.cli.Get(ctx, h.key); err == nil {
					if err := h.check(reg.lease, g.Kvs...); err != nil {
						return err
					}
					rev = g.Header.Revision
				}
				wch = h.cli.Watch(wctx, h.key, clientv3.WithRev(rev+1))
				h.log.Debug("coord: host key watch resumed", "key", h.key, "rev", rev)
				continue
			}
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					return errors.New("coord: host key deleted")
				}
				if err := h.check(reg.lease, ev.Kv); err != nil {
					return err
				}
			}
			rev = wr.Header.Revision
		}
	}
}

// check says whether the key's state still belongs to lease.
func (h *HostLiveness) check(lease clientv3.LeaseID, kvs ...*mvccpb.KeyValue) error {
	switch {
	case len(kvs) == 0:
		return errors.New("coord: host key deleted")
	case kvs[0].Lease == int64(lease):
		return nil
	case kvs[0].Lease == int64(clientv3.NoLease):
		return errors.New("coord: host key overwritten without a lease")
	}
	return fmt.Errorf("%w: key %q taken over by lease %x", ErrHostExists, h.key, kvs[0].Lease)
}

// heal revokes the old lease where it still exists and registers again,
// retrying with backoff, until it succeeds or cannot.
func (h *HostLiveness) heal(ctx context.Context, old clientv3.LeaseID) (registration, error) {
	revokeQuietly(ctx, h.cli, old, h.reqTTL, h.log)
	var r retry
	for attempt := 1; ; attempt++ {
		select {
		case h.writes <- struct{}{}:
		case <-ctx.Done():
			return registration{}, ctx.Err()
		}
		// Each attempt is bounded: one stuck on a member without leader
		// is retried afresh rather than waiting silently.
		actx, cancel := context.WithTimeout(ctx, max(h.reqTTL, attemptTimeout))
		reg, err := h.register(actx, false, false)
		cancel()
		<-h.writes
		if err == nil {
			emit(h.signal, Signal{Kind: SignalRegistered, Host: h.host(), Key: h.key, Lease: reg.lease, Attempt: attempt})
			return reg, nil
		}
		if errors.Is(err, ErrHostExists) {
			return reg, err
		}
		if ferr := fatal(ctx, h.cli, err); ferr != nil {
			return reg, fmt.Errorf("coord: heal host key %q: %w", h.key, ferr)
		}
		h.log.Warn("coord: heal attempt failed", "key", h.key, "attempt", attempt, "err", err)
		emit(h.signal, Signal{Kind: SignalHealAttempt, Host: h.host(), Key: h.key, Attempt: attempt, Err: err})
		sleep(ctx, r.next())
	}
}

func (h *HostLiveness) finish(err error) {
	h.mu.Lock()
	h.err = err
	h.mu.Unlock()
	if err != nil {
		h.log.Error("coord: host registration ended", "key", h.key, "err", err)
	}
	emit(h.signal, Signal{Kind: SignalRegistrationEnded, Host: h.host(), Key: h.key, Err: err})
	close(h.done)
}

// Stop ends the registration and revokes its lease, so that watchers see the
// host Down at once. ctx bounds the revoke; without a deadline it is bounded
// by the TTL. Stop is idempotent: later calls return the first call's result.
func (h *HostLiveness) Stop(ctx context.Context) error {
	h.stopOnce.Do(func() {
		h.cancel()
		<-h.exited
		err := revoke(ctx, h.cli, h.LeaseID(), h.TTL())
		if err != nil && !errors.Is(h.Err(), ErrClientClosed) {
			h.stopErr = fmt.Errorf("coord: stop host %q: %w", h.Key(), err)
		}
	})
	return h.stopErr
}

// Update publishes new metadata under the same lease; watchers see
// HostUpdated. meta.HostUUID must stay the same. While the registration is
// healing, the metadata is recorded and the heal writes it.
func (h *HostLiveness) Update(ctx context.Context, meta HostMetadata) error {
	h.mu.Lock()
	id := h.meta.HostUUID
	h.mu.Unlock()
	if meta.HostUUID != id {
		return fmt.Errorf("%w: update of host %q names %q", ErrInvalidHostUUID, id, meta.HostUUID)
	}
	val, _ := json.Marshal(meta)
	select {
	case h.writes <- struct{}{}:
	case <-ctx.Done():
		return opErr(fmt.Sprintf("update host %q", id), ctx.Err())
	}
	defer func() { <-h.writes }()
	select {
	case <-h.done:
		if err := h.Err(); err != nil {
			return fmt.Errorf("coord: update host %q: %w", id, err)
		}
		return fmt.Errorf("coord: update host %q: %w", id, ErrClosed)
	default:
	}
	lease := h.LeaseID()
	// Only under our lease: a key deleted or taken over is the loop's to
	// judge. If the key is not ours now, a heal is coming and writes the
	// metadata recorded below.
	_, err := h.cli.Txn(ctx).If(clientv3.Compare(clientv3.LeaseValue(h.key), "=", lease)).
		Then(clientv3.OpPut(h.key, string(val), clientv3.WithLease(lease))).Commit()
	if err != nil {
		return opErr(fmt.Sprintf("update host %q", id), err)
	}
	h.mu.Lock()
	h.meta = meta
	h.mu.Unlock()
	return nil
}

// LeaseID returns the lease currently holding the key; it changes when the
// registration heals.
func (h *HostLiveness) LeaseID() clientv3.LeaseID {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lease
}

// host returns the registration's HostUUID.
func (h *HostLiveness) host() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.meta.HostUUID
}

// Key returns the host's key, <prefix><HostUUID>.
func (h *HostLiveness) Key() string { return h.key }

// TTL returns the TTL etcd granted, which may be longer than asked.
func (h *HostLiveness) TTL() time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ttl
}

// Done returns a channel closed when the registration ends for good: after
// Stop, when taken over, or when the client is closed.
func (h *HostLiveness) Done() <-chan struct{} { return h.done }

// Err says why the registration ended: nil while it lives and after Stop,
// an error wrapping ErrHostExists if it was taken over, ErrClientClosed if
// the client was closed.
func (h *HostLiveness) Err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

package coord

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// HostLiveness is a host's registration: a lease kept alive in the
// background, holding the host's metadata at its key. It heals by itself
// until Stop. It is safe for concurrent use.
type HostLiveness struct {
	cli    *clientv3.Client
	id     string
	key    string
	reqTTL time.Duration
	log    *slog.Logger
	signal func(Signal)

	life   context.Context // the loop's, ended by Stop
	cancel context.CancelFunc
	writes chan struct{} // a one-slot semaphore: one write of the key at a time
	// done is closed when the registration has ended for good: by run when
	// it ends by itself, by Stop's cleanup once that is over.
	done   chan struct{}
	exited chan struct{}  // closed when run returns
	drops  sync.WaitGroup // revokes of leases granted and not needed

	mu      sync.Mutex
	meta    HostMetadata  // the latest, which a heal writes
	gen     uint64        // counts the metadata recorded
	wrote   uint64        // gen of the metadata etcd holds on our lease
	written chan struct{} // closed and replaced when wrote changes
	lease   clientv3.LeaseID
	ttl     time.Duration
	cause   error     // why the registration ended by itself
	err     error     // cause as Err reports it
	keep    *keeper   // the keeper of the lease held, for Healthy
	lost    time.Time // when the registration was found lost, zero unless healing
	lostWhy error     // why it was lost
	// unneeded are the leases of our attempts to register, since the
	// last that succeeded, that were not kept and whose revoke etcd has
	// not confirmed (see drop): a put of ours on one may have landed
	// unseen; and the lease a heal left, if its revoke failed. Once we
	// hold the key again, none of them does.
	unneeded []clientv3.LeaseID

	mark etcdMark // the etcd of our writes

	lent   *hostLease      // the lease host sessions ride; nil while healing
	relent chan struct{}   // closed and replaced when lent is
	claims map[string]bool // the keys of elections and semaphores on the host (see claim)

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
// meta is copied: the caller may change or reuse it afterwards.
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
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	prefix, ttl := opts.Prefix, opts.TTL
	life, cancel := context.WithCancel(context.Background())
	h := &HostLiveness{
		cli:     cli,
		id:      meta.HostUUID,
		key:     prefix + meta.HostUUID,
		reqTTL:  ttl,
		log:     logger(opts.Logger).With("host", meta.HostUUID),
		signal:  opts.OnSignal,
		life:    life,
		cancel:  cancel,
		writes:  make(chan struct{}, 1),
		done:    make(chan struct{}),
		exited:  make(chan struct{}),
		meta:    cloneMeta(meta),
		gen:     1,
		written: make(chan struct{}),
		relent:  make(chan struct{}),
		claims:  map[string]bool{},
	}
	mode := claimWaitOut
	if opts.Takeover {
		mode = claimTakeover
	}
	reg, err := h.register(ctx, mode)
	if err != nil {
		cancel()
		return nil, opErr(fmt.Sprintf("register host %q", meta.HostUUID), err)
	}
	h.log.Info("coord: host registered", "key", h.key, "lease", hexID(reg.lease), "ttl", reg.ttl)
	emit(h.signal, Signal{Kind: SignalRegistered, Host: h.id, Key: h.key, Lease: reg.lease})
	go h.run(life, reg)
	return h, nil
}

// cloneMeta copies m, its Labels included: a heal marshals the recorded
// metadata at any time, while the caller may be changing its own map.
func cloneMeta(m HostMetadata) HostMetadata {
	m.Labels = maps.Clone(m.Labels)
	return m
}

// claim says what register does when another lease holds the host key.
type claim int

const (
	// claimWaitOut waits the holder's lease out, once (a crash-restart:
	// the holder may be our own previous life), then registers.
	claimWaitOut claim = iota
	// claimTakeover overwrites the key at once (Takeover).
	claimTakeover
	// claimIfFree returns ErrHostExists at once (a heal never overwrites
	// another holder).
	claimIfFree
)

// register writes the host's latest metadata under a new lease. If another
// lease holds the key, mode says what to do (see claim).
func (h *HostLiveness) register(ctx context.Context, mode claim) (registration, error) {
	var waited clientv3.LeaseID
	over := clientv3.NoLease // the lease whose key we may write over
	// A member without leader fails the calls at once: a heal retries on
	// another member rather than waiting out its attempt.
	ctx = clientv3.WithRequireLeader(ctx)
	for {
		reg, holder, err := h.putKey(ctx, mode, over)
		switch {
		case err != nil:
			return registration{}, err
		case reg.lease != clientv3.NoLease:
			return reg, nil
		case holder == nil:
			// Gone with the lease of ours it was on: free now.
			over = clientv3.NoLease
			continue
		case h.isUnneeded(clientv3.LeaseID(holder.Lease)):
			// Put by an attempt of ours that landed unseen, or left
			// on the lease we left, its revoke refused: the key is
			// ours, not another host's.
			h.log.Debug("coord: host key on a lease of ours not revoked yet, writing over it", "key", h.key, "lease", hexID(clientv3.LeaseID(holder.Lease)))
			over = clientv3.LeaseID(holder.Lease)
			continue
		case mode != claimWaitOut || clientv3.LeaseID(holder.Lease) == waited:
			return registration{}, fmt.Errorf("%w: key %q held by lease %x", ErrHostExists, h.key, holder.Lease)
		}
		waited = clientv3.LeaseID(holder.Lease)
		if err := h.waitOut(ctx, waited); err != nil {
			return registration{}, err
		}
	}
}

// putKey puts the host's latest metadata on a new lease, if the key is on
// no lease or on over (or whatever holds it, with claimTakeover), and
// returns the registration. Else it returns the key as it found it (nil
// if there is none), its lease not needed and dropped.
func (h *HostLiveness) putKey(ctx context.Context, mode claim, over clientv3.LeaseID) (registration, *mvccpb.KeyValue, error) {
	h.mu.Lock()
	meta, gen := h.meta, h.gen
	h.mu.Unlock()
	// Strings and a map of strings: encoding cannot fail. The map is
	// never changed once recorded.
	val, _ := json.Marshal(meta)
	sent := time.Now()
	g, err := h.cli.Grant(ctx, int64(h.reqTTL/time.Second))
	if err != nil {
		return registration{}, nil, fmt.Errorf("grant lease: %w", err)
	}
	reg := registration{lease: g.ID, ttl: time.Duration(g.TTL) * time.Second, sent: sent}
	// A key without a lease holds no host, nor does one on a lease of
	// ours not revoked yet (see unneeded): write over it.
	free := []clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(h.key), "=", over)}
	if mode == claimTakeover {
		free = nil
	}
	since := h.mark.at()
	resp, err := h.cli.Txn(ctx).If(free...).
		Then(clientv3.OpPut(h.key, string(val), clientv3.WithLease(g.ID))).
		Else(clientv3.OpGet(h.key)).Commit()
	if err == nil {
		h.heard(resp.Header, since)
	}
	if err == nil && resp.Succeeded {
		reg.rev = resp.Header.Revision
		h.published(gen, reg.lease, reg.ttl)
		h.mu.Lock()
		h.unneeded = nil
		h.mu.Unlock()
		return reg, nil, nil
	}
	// Ours is not needed (yet): do not leave it to expire.
	h.drop(ctx, g.ID, reg.ttl)
	if err != nil {
		return registration{}, nil, fmt.Errorf("put host key: %w", err)
	}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		return registration{}, kvs[0], nil
	}
	return registration{}, nil, nil
}

// heard takes in the header of a write's answer: an etcd that replaced the
// one of our writes (see etcdMark) is reported. The registration has healed
// on it by then (its lease was gone with the old etcd).
func (h *HostLiveness) heard(hdr *etcdserverpb.ResponseHeader, since *markAt) {
	if err := h.mark.see(hdr, since); err != nil {
		h.log.Error("coord: etcd was replaced or restored, host registered on the new one", "key", h.key, "err", err)
		emit(h.signal, Signal{Kind: SignalEtcdReplaced, Key: h.key, Host: h.id, Err: err})
	}
}

// published records that etcd holds the metadata of generation gen on
// lease, and wakes the updates waiting for it.
func (h *HostLiveness) published(gen uint64, lease clientv3.LeaseID, ttl time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lease, h.ttl, h.wrote = lease, ttl, gen
	close(h.written)
	h.written = make(chan struct{})
}

// drop revokes a lease we no longer need, waiting for it as long as ctx
// lasts: the revoke goes on after ctx ends, bounded by the TTL, since the
// lease holds the key if our put went through unseen.
func (h *HostLiveness) drop(ctx context.Context, id clientv3.LeaseID, ttl time.Duration) {
	revoked := make(chan struct{})
	h.mu.Lock()
	h.unneeded = append(h.unneeded, id)
	h.mu.Unlock()
	h.drops.Add(1)
	go func() {
		defer h.drops.Done()
		defer close(revoked)
		err := revoke(context.Background(), h.cli, id, ttl)
		h.log.Debug("coord: revoked lease", "lease", hexID(id), "err", err)
		if err == nil {
			h.mu.Lock()
			h.unneeded = slices.DeleteFunc(h.unneeded, func(l clientv3.LeaseID) bool { return l == id })
			h.mu.Unlock()
		}
	}()
	select {
	case <-revoked:
	case <-ctx.Done():
	}
}

// isUnneeded reports whether lease is one of our attempts' (see drop).
func (h *HostLiveness) isUnneeded(lease clientv3.LeaseID) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Contains(h.unneeded, lease)
}

// waitOut waits until lease no longer holds the key, or would have expired
// had nobody renewed it, or ctx ends. A broken or compacted watch does not
// end the wait: the lease's TTL is read again (a new etcd leader renews
// every lease), then the key, and the watch resumes from there.
func (h *HostLiveness) waitOut(ctx context.Context, lease clientv3.LeaseID) error {
	var (
		expiry time.Time // zero until the lease's TTL is read: ours says nothing of it
		r      retry
	)
	for {
		ttl, err := h.cli.TimeToLive(ctx, lease)
		if err == nil {
			// etcd rounds the remaining TTL down to whole seconds.
			left := time.Duration(max(ttl.TTL, 0)+1)*time.Second + expirySlack
			expiry = time.Now().Add(left)
		}
		if !expiry.IsZero() {
			gone, werr := h.watchHolder(ctx, lease, expiry)
			if gone {
				return nil
			}
			err = werr
		}
		if ferr := fatal(ctx, h.cli, err); ferr != nil {
			return fmt.Errorf("wait out lease %x: %w", int64(lease), ferr)
		}
		h.log.Debug("coord: wait for the holder's lease interrupted", "key", h.key, "lease", hexID(lease), "err", err)
		sleep(ctx, r.next())
	}
}

// watchHolder reads the key and watches it until lease no longer holds it
// or expiry has passed, which end the wait (true), or until the read or the
// watch fails or ctx ends (false, with the error if any).
func (h *HostLiveness) watchHolder(ctx context.Context, lease clientv3.LeaseID, expiry time.Time) (bool, error) {
	wctx, cancel := context.WithDeadline(ctx, expiry)
	defer cancel()
	g, err := h.cli.Get(wctx, h.key)
	if err == nil && (len(g.Kvs) == 0 || g.Kvs[0].Lease != int64(lease)) {
		return true, nil
	}
	if err == nil {
		wch := h.cli.Watch(wctx, h.key, clientv3.WithRev(g.Header.Revision+1), clientv3.WithCreatedNotify())
		for wr := range responses(wctx, wch) {
			if wr.Created {
				h.log.Info("coord: host key held by another lease, waiting it out", "key", h.key, "lease", hexID(lease), "wait", time.Until(expiry))
			}
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE || ev.Kv.Lease != int64(lease) {
					return true, nil
				}
			}
			err = wr.Err()
		}
	}
	// Past expiry, the lease would have expired had nobody renewed it.
	return ctx.Err() == nil && wctx.Err() != nil, err
}

// run holds the registration and heals it until ctx ends or it cannot.
func (h *HostLiveness) run(ctx context.Context, reg registration) {
	defer close(h.exited)
	var err error
	for {
		err = h.hold(ctx, reg)
		h.holding(nil, err)
		if errors.Is(err, ErrHostExists) {
			break
		}
		// A client closed, or an etcd that refuses for good, is why the
		// registration ends, whatever hold saw last: a key deleted as
		// the client closed would have been healed.
		if ferr := fatal(ctx, h.cli, err); ferr != nil {
			err = ferr
			break
		}
		h.log.Warn("coord: host registration lost, healing", "key", h.key, "lease", hexID(reg.lease), "err", err)
		if reg, err = h.heal(ctx, reg.lease); err != nil {
			break
		}
		h.log.Info("coord: host registration healed", "key", h.key, "lease", hexID(reg.lease), "ttl", reg.ttl)
	}
	// Once stopped, Stop's cleanup ends the registration when it is over.
	if ctx.Err() == nil {
		h.finish(err)
	}
}

// hold keeps reg alive and returns why it ended. The key is the judge: a
// lease that expires or is revoked deletes the key with it.
func (h *HostLiveness) hold(ctx context.Context, reg registration) (err error) {
	k := startKeeper(h.cli, reg.lease, reg.ttl, reg.sent, h.log)
	hl := h.lend(ctx, reg, k)
	defer func() {
		h.unlend(hl, err) // before the keeper stops (see unlend)
		k.stop(context.Cause(hl.ctx))
	}()
	h.holding(k, nil)
	// Ended on return: ends every watch opened below. When etcd says the
	// lease is gone, the watch ends too and the key is read again: the
	// watch may have missed the delete (a connection that lost data). A
	// host session that cannot delete its keys leaves the lease (see
	// sweep): so does the registration.
	ctx = hl.ctx
	wctx, cancel := withCancelOn(clientv3.WithRequireLeader(ctx), k.lost)
	defer cancel()
	rev := reg.rev
	wch := h.cli.Watch(wctx, h.key, clientv3.WithRev(rev+1))
	var r retry
	for {
		// The watch ends with wctx, closed or not (see responses).
		var wr clientv3.WatchResponse
		ok := false
		select {
		case wr, ok = <-wch:
		case <-wctx.Done():
		}
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		if !ok || wr.Err() != nil {
			if err := fatal(ctx, h.cli, wr.Err()); err != nil {
				return fmt.Errorf("watch host key %q: %w", h.key, err)
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
				return errors.New("host key deleted")
			}
			if err := h.check(reg.lease, ev.Kv); err != nil {
				return err
			}
		}
		rev = wr.Header.Revision
	}
}

// check says whether the key's state still belongs to lease.
func (h *HostLiveness) check(lease clientv3.LeaseID, kvs ...*mvccpb.KeyValue) error {
	switch {
	case len(kvs) == 0:
		return errors.New("host key deleted")
	case kvs[0].Lease == int64(lease):
		return nil
	case kvs[0].Lease == int64(clientv3.NoLease):
		return errors.New("host key overwritten without a lease")
	}
	return fmt.Errorf("%w: key %q taken over by lease %x", ErrHostExists, h.key, kvs[0].Lease)
}

// heal revokes the old lease where it still exists and registers again,
// retrying with backoff, until it succeeds or cannot.
func (h *HostLiveness) heal(ctx context.Context, old clientv3.LeaseID) (registration, error) {
	// Stop cuts this revoke short: its cleanup revokes the lease on
	// record, which is old until a heal succeeds.
	err := revoke(ctx, h.cli, old, h.TTL())
	h.log.Debug("coord: revoked lease", "lease", hexID(old), "err", err)
	if err != nil {
		// A lease we left may still hold the key: ours to write over
		// (see register).
		h.mu.Lock()
		h.unneeded = append(h.unneeded, old)
		h.mu.Unlock()
	}
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
		reg, err := h.register(actx, claimIfFree)
		cancel()
		<-h.writes
		if err == nil {
			emit(h.signal, Signal{Kind: SignalRegistered, Host: h.id, Key: h.key, Lease: reg.lease, Attempt: attempt})
			return reg, nil
		}
		if errors.Is(err, ErrHostExists) {
			return reg, err
		}
		if ferr := fatal(ctx, h.cli, err); ferr != nil {
			return reg, fmt.Errorf("heal host key %q: %w", h.key, ferr)
		}
		h.log.Warn("coord: heal attempt failed", "key", h.key, "attempt", attempt, "err", err)
		emit(h.signal, Signal{Kind: SignalHealAttempt, Host: h.id, Key: h.key, Attempt: attempt, Err: err})
		sleep(ctx, r.next())
	}
}

// finish ends the registration for good, cause saying why.
func (h *HostLiveness) finish(cause error) {
	err := ended(cause)
	h.mu.Lock()
	h.cause, h.err = cause, err
	h.mu.Unlock()
	if err != nil {
		h.log.Error("coord: host registration ended", "key", h.key, "err", err)
	}
	emit(h.signal, Signal{Kind: SignalRegistrationEnded, Host: h.id, Key: h.key, Err: err})
	close(h.done)
}

// ended returns cause as Err reports it, saying "coord:" once: an error
// wrapping one of our sentinels says it already.
func ended(cause error) error {
	if cause == nil || errors.Is(cause, ErrHostExists) || errors.Is(cause, ErrClientClosed) {
		return cause
	}
	return fmt.Errorf("coord: %w", cause)
}

// Stop ends the registration and revokes its lease, so that watchers see the
// host Down at once. It returns within ctx: what is left of the cleanup then
// goes on in the background, bounded by the TTL, and Done closes once it is
// over. Without a deadline, Stop is bounded by the TTL. Stop is idempotent:
// later calls return the first call's result.
func (h *HostLiveness) Stop(ctx context.Context) error {
	h.stopOnce.Do(func() {
		h.cancel()
		released := make(chan error, 1)
		go func() { released <- h.release() }()
		var err error
		select {
		case err = <-released:
		case <-ctx.Done():
			err = ctx.Err()
		}
		if err != nil {
			h.stopErr = opErr(fmt.Sprintf("stop host %q", h.id), err)
		}
	})
	return h.stopErr
}

// release is Stop's cleanup: once the loop is over, it revokes the lease on
// record and waits for the leases being dropped, then ends the registration
// if it had not ended by itself. Each revoke is bounded by the TTL.
func (h *HostLiveness) release() error {
	<-h.exited
	err := revoke(context.Background(), h.cli, h.LeaseID(), h.TTL())
	h.drops.Wait()
	select {
	case <-h.done:
	default:
		h.finish(nil)
	}
	return err
}

// Update publishes new metadata under the same lease; watchers see
// HostUpdated. meta.HostUUID must stay the same; meta is copied. Update
// returns nil only once etcd holds meta on our lease: if the key is not ours
// because a heal is under way, it waits, within ctx, for the heal to write
// meta. If the key was taken over it fails with an error wrapping
// ErrHostExists and writes nothing. If etcd cannot be reached within ctx it
// fails with ctx's error, and the next heal writes meta; meta that etcd
// refuses is dropped.
func (h *HostLiveness) Update(ctx context.Context, meta HostMetadata) error {
	if meta.HostUUID != h.id {
		return fmt.Errorf("%w: update of host %q names %q", ErrInvalidHostUUID, h.id, meta.HostUUID)
	}
	gen, healing, err := h.write(ctx, cloneMeta(meta))
	if err == nil && healing {
		h.log.Debug("coord: host key not ours, waiting for the heal to write the update", "key", h.key)
		err = h.awaitHeal(ctx, gen)
	}
	if err != nil {
		return opErr(fmt.Sprintf("update host %q", h.id), err)
	}
	return nil
}

// write records meta, for the heals to come, and puts it on our lease. It
// reports whether the key was not ours (deleted, without a lease, or on a
// lease of an attempt of ours): a heal is under way then, which writes
// meta of generation gen.
func (h *HostLiveness) write(ctx context.Context, meta HostMetadata) (gen uint64, healing bool, err error) {
	val, _ := json.Marshal(meta)
	select {
	case h.writes <- struct{}{}:
	case <-ctx.Done():
		return 0, false, ctx.Err()
	}
	defer func() { <-h.writes }()
	if err := h.endErr(); err != nil {
		return 0, false, err
	}
	h.mu.Lock()
	prev, prevGen, lease, ttl := h.meta, h.gen, h.lease, h.ttl
	h.gen++
	h.meta, gen = meta, h.gen
	h.mu.Unlock()
	since := h.mark.at()
	resp, err := h.cli.Txn(ctx).If(clientv3.Compare(clientv3.LeaseValue(h.key), "=", lease)).
		Then(clientv3.OpPut(h.key, string(val), clientv3.WithLease(lease))).
		Else(clientv3.OpGet(h.key)).Commit()
	if err != nil {
		// Turned down for good (too large to send or to store, denied):
		// no heal may write it either. Unanswered, it stays for the next
		// heal.
		if status.Code(err) == codes.ResourceExhausted || (ctx.Err() == nil && fatal(ctx, h.cli, err) != nil) {
			h.mu.Lock()
			h.meta, h.gen = prev, prevGen
			h.mu.Unlock()
		}
		return 0, false, fmt.Errorf("put host key: %w", err)
	}
	h.heard(resp.Header, since)
	if resp.Succeeded {
		h.published(gen, lease, ttl)
		return gen, false, nil
	}
	// A lease of our attempts holds no other host (see unneeded): the
	// next attempt writes over it.
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 && kvs[0].Lease != int64(clientv3.NoLease) && !h.isUnneeded(clientv3.LeaseID(kvs[0].Lease)) {
		return 0, false, fmt.Errorf("%w: key %q held by lease %x", ErrHostExists, h.key, kvs[0].Lease)
	}
	return gen, true, nil
}

// awaitHeal waits until etcd holds metadata of generation gen, or a later
// one, on our lease.
func (h *HostLiveness) awaitHeal(ctx context.Context, gen uint64) error {
	for {
		h.mu.Lock()
		wrote, written := h.wrote, h.written
		h.mu.Unlock()
		if wrote >= gen {
			return nil
		}
		select {
		case <-written:
		case <-ctx.Done():
			return ctx.Err()
		case <-h.done:
		case <-h.life.Done():
		}
		if err := h.endErr(); err != nil {
			return err
		}
	}
}

// endErr returns why the registration takes no more writes, nil while it
// lives.
func (h *HostLiveness) endErr() error {
	select {
	case <-h.done:
		h.mu.Lock()
		defer h.mu.Unlock()
		if h.cause != nil {
			return h.cause
		}
	case <-h.life.Done():
	default:
		return nil
	}
	return ErrClosed
}

// LeaseID returns the lease currently holding the key; it changes when the
// registration heals.
func (h *HostLiveness) LeaseID() clientv3.LeaseID {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lease
}

// Key returns the host's key, <prefix><HostUUID>.
func (h *HostLiveness) Key() string { return h.key }

// TTL returns the TTL etcd granted, which may be longer than asked.
func (h *HostLiveness) TTL() time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ttl
}

// Done returns a channel closed when the registration ends for good: when it
// is taken over or its client is closed, or once Stop's cleanup is over.
func (h *HostLiveness) Done() <-chan struct{} { return h.done }

// Err says why the registration ended: nil while it lives and after Stop,
// an error wrapping ErrHostExists if it was taken over, ErrClientClosed if
// the client was closed.
func (h *HostLiveness) Err() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// Healthy returns nil while the registration holds its key on a lease
// whose renewals etcd answers. It returns an error once the registration
// is lost and healing (from the moment it is found lost, saying since
// when), when renewals have gone unanswered for over a third of the TTL
// past the one due (see keeper), once it ended by itself (Err), and
// "stopped" once Stop was called (a registration that ended by itself
// says why, even after Stop).
func (h *HostLiveness) Healthy() error {
	what := fmt.Sprintf("host %q", h.id)
	h.mu.Lock()
	k, lost, why, cause := h.keep, h.lost, h.lostWhy, h.cause
	h.mu.Unlock()
	now := time.Now()
	switch {
	case cause != nil:
		return opErr(what, fmt.Errorf("registration ended: %w", bare{cause}))
	case h.life.Err() != nil:
		return opErr(what, errStopped)
	case !lost.IsZero():
		return opErr(what, fmt.Errorf("registration lost %v ago, healing: %w",
			now.Sub(lost).Round(time.Millisecond), bare{why}))
	case k != nil:
		if err := k.unanswered(now); err != nil {
			return opErr(what, err)
		}
	}
	return nil
}

// holding records the keeper of the registration held, or, with nil,
// that it was lost, err saying why.
func (h *HostLiveness) holding(k *keeper, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.keep, h.lost, h.lostWhy = k, time.Time{}, err
	if k == nil {
		h.lost = time.Now()
	}
}

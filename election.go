package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Election is a leader election on one key, compatible with etcd's
// concurrency package. It holds a session (a lease) renewed in the
// background and replaced when it ends. It is safe for concurrent use;
// Campaign, TryCampaign, Proclaim and Resign run one at a time. Once the
// caller's client is closed, leadership ends and they fail with
// ErrClientClosed.
type Election struct {
	cli      *clientv3.Client
	key      string
	prefix   string // key + "/": where candidates live
	ttl      time.Duration
	identity string
	log      *slog.Logger
	signal   func(Signal)
	pooled   bool

	ctx    context.Context // ended by Close
	cancel context.CancelFunc
	turn   chan struct{} // one-slot semaphore: one campaign operation at a time
	wg     sync.WaitGroup
	once   sync.Once

	mu   sync.Mutex
	sess *session
	lead *leadership // the latest leadership; over once its ctx is done
}

// leadership is one term as leader.
type leadership struct {
	key    string
	rev    int64    // create revision of key: the fencing token
	sess   *session // the session whose lease the key is attached to
	ctx    context.Context
	cancel context.CancelFunc
}

// NewElection joins the election on opts.Key with a new session. ctx bounds
// the session's creation only; the election lives until Close.
func NewElection(ctx context.Context, cli *clientv3.Client, opts ElectionOptions) (*Election, error) {
	if cli == nil {
		return nil, ErrNilClient
	}
	if err := checkElectionKey(opts.Key); err != nil {
		return nil, err
	}
	ttl, err := ttlOrDefault(opts.TTL, DefaultElectionTTL)
	if err != nil {
		return nil, err
	}
	ectx, cancel := context.WithCancel(context.Background())
	e := &Election{
		cli:      cli,
		key:      opts.Key,
		prefix:   opts.Key + "/",
		ttl:      ttl,
		identity: identityOrDefault(opts.Identity),
		log:      logger(opts.Logger).With("key", opts.Key),
		signal:   opts.OnSignal,
		ctx:      ectx,
		cancel:   cancel,
		turn:     make(chan struct{}, 1),
	}
	if _, err := e.session(ctx); err != nil {
		cancel()
		return nil, err
	}
	return e, nil
}

// session returns the live session, starting a new one if it ended.
// Called with the turn held, or before the election is shared.
func (e *Election) session(ctx context.Context) (*session, error) {
	e.mu.Lock()
	s := e.sess
	e.mu.Unlock()
	if s != nil && s.ctx.Err() == nil {
		return s, nil
	}
	s, err := startSession(ctx, e.ctx, e.cli, e.ttl, e.log, &e.wg)
	if err != nil {
		return nil, e.fail(ctx, "election", err)
	}
	e.mu.Lock()
	e.sess = s
	e.mu.Unlock()
	return s, nil
}

// renew starts a new session if the current one ended. A campaign under way
// renews it itself, so renew does not wait for one.
func (e *Election) renew(ctx context.Context) error {
	select {
	case e.turn <- struct{}{}:
	default:
		return nil
	}
	defer e.release()
	ctx, cancel := e.bind(ctx)
	defer cancel()
	_, err := e.session(ctx)
	return err
}

// acquire takes the turn, or fails when ctx ends or the election is closed.
// The context it returns ends with ctx or on Close, so that Close never
// waits for a call stuck on an unreachable etcd; done gives the turn back.
func (e *Election) acquire(ctx context.Context, what string) (_ context.Context, done func(), _ error) {
	select {
	case e.turn <- struct{}{}:
	case <-ctx.Done():
		return nil, nil, opErr(fmt.Sprintf("%s %q", what, e.key), ctx.Err())
	case <-e.ctx.Done():
		// Closed: Close holds the turn for good, so it is not ours to give.
		return nil, nil, fmt.Errorf("coord: %s %q: %w", what, e.key, ErrClosed)
	}
	if e.cli.Ctx().Err() != nil {
		// Calls on a closed client would retry for seconds before failing.
		e.release()
		return nil, nil, fmt.Errorf("coord: %s %q: %w", what, e.key, ErrClientClosed)
	}
	// Should Close start meanwhile, ctx ends with it: the call fails fast
	// and gives the turn to Close.
	ctx, cancel := e.bind(ctx)
	return ctx, func() { cancel(); e.release() }, nil
}

func (e *Election) release() { <-e.turn }

// bind returns a context that ends with ctx or when the election is closed.
func (e *Election) bind(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(e.ctx, cancel)
	return ctx, func() { stop(); cancel() }
}

// fail explains an error met by a call: ErrClosed if Close cut it short,
// else what was being done, wrapping err (and the end of ctx).
func (e *Election) fail(ctx context.Context, what string, err error) error {
	if e.ctx.Err() != nil {
		return fmt.Errorf("coord: %s %q: %w", what, e.key, ErrClosed)
	}
	return opErr(fmt.Sprintf("%s %q", what, e.key), err)
}

// current returns the leadership in force, or nil.
func (e *Election) current() *leadership {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.lead == nil || e.lead.ctx.Err() != nil {
		return nil
	}
	return e.lead
}

// Campaign blocks until we lead the election, proclaiming identity (or
// ElectionOptions.Identity when ""). If we lead already it proclaims the new
// identity and returns nil. On any error no candidate key of ours is left
// behind; if our session ends while waiting the error wraps
// ErrLeadershipLost; when ctx ends, errors.Is(err, ctx.Err()) holds.
func (e *Election) Campaign(ctx context.Context, identity string) error {
	_, err := e.campaign(ctx, identity, true)
	return err
}

// TryCampaign becomes leader if nobody else leads, without waiting: it
// returns false, and leaves no key behind, when another candidate is ahead.
func (e *Election) TryCampaign(ctx context.Context, identity string) (bool, error) {
	return e.campaign(ctx, identity, false)
}

func (e *Election) campaign(ctx context.Context, identity string, wait bool) (bool, error) {
	if identity == "" {
		identity = e.identity
	}
	ctx, done, err := e.acquire(ctx, "campaign")
	if err != nil {
		return false, err
	}
	defer done()
	if l := e.current(); l != nil {
		err := e.proclaim(ctx, l, identity)
		if !errors.Is(err, ErrNotLeader) {
			return err == nil, err
		}
	}
	s, key, rev, err := e.candidate(ctx, identity)
	if err != nil {
		return false, err
	}
	hdr, err := e.waitTurn(ctx, s, key, rev, wait)
	if err != nil {
		e.withdraw(s, key, rev)
		return false, err
	}
	if hdr == 0 {
		e.withdraw(s, key, rev)
		return false, nil
	}
	lctx, cancel := context.WithCancel(s.ctx)
	l := &leadership{key: key, rev: rev, sess: s, ctx: lctx, cancel: cancel}
	e.mu.Lock()
	e.lead = l
	e.mu.Unlock()
	e.wg.Add(1)
	go e.monitor(l, hdr)
	e.log.Info("coord: leadership gained", "token", rev, "identity", identity)
	emit(e.signal, Signal{Kind: SignalLeadershipGained, Key: e.key, Token: rev})
	return true, nil
}

// candidate puts our candidate key, proclaiming identity, and returns it
// with its create revision and session. A key of our lease already there
// (left by a program sharing our lease, as etcd's concurrency package
// allows) is taken over in the same transaction.
func (e *Election) candidate(ctx context.Context, identity string) (*session, string, int64, error) {
	for {
		s, err := e.session(ctx)
		if err != nil {
			return nil, "", 0, err
		}
		key := e.prefix + hexID(s.id)
		put := clientv3.OpPut(key, identity, clientv3.WithLease(s.id))
		resp, err := e.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(put).Else(clientv3.OpGet(key), put).Commit()
		switch {
		case errors.Is(err, rpctypes.ErrLeaseNotFound):
			// The lease expired before the session noticed: start another.
			s.end(fmt.Errorf("coord: lease %x expired or revoked", int64(s.id)))
			continue
		case err != nil:
			// The put may have landed: take it back.
			e.withdraw(s, key, 0)
			return nil, "", 0, e.fail(ctx, "campaign", err)
		case !resp.Succeeded:
			return s, key, resp.Responses[0].GetResponseRange().Kvs[0].CreateRevision, nil
		}
		return s, key, resp.Header.Revision, nil
	}
}

// waitTurn waits until no candidate created before rev remains, and
// returns the revision at which we lead; 0 when !wait and someone is ahead.
func (e *Election) waitTurn(ctx context.Context, s *session, key string, rev int64, wait bool) (int64, error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(s.ctx, cancel)()
	for {
		resp, err := e.cli.Txn(wctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", rev)).
			Then(clientv3.OpGet(e.prefix, append(clientv3.WithLastCreate(), clientv3.WithMaxCreateRev(rev-1))...)).
			Commit()
		if err != nil {
			return 0, e.why(ctx, s, err)
		}
		if !resp.Succeeded {
			return 0, fmt.Errorf("coord: campaign %q: our key was deleted: %w", e.key, ErrLeadershipLost)
		}
		ahead := resp.Responses[0].GetResponseRange().Kvs
		if len(ahead) == 0 {
			return resp.Header.Revision, nil
		}
		if !wait {
			return 0, nil
		}
		e.log.Debug("coord: campaign waits for its turn", "token", rev, "behind", string(ahead[0].Key))
		// Someone is ahead: wait for any delete under the prefix (theirs, or
		// ours by someone else), then look again.
		for wr := range e.cli.Watch(wctx, e.prefix, clientv3.WithPrefix(), clientv3.WithFilterPut(),
			clientv3.WithRev(resp.Header.Revision+1)) {
			if len(wr.Events) > 0 || wr.Err() != nil {
				break
			}
		}
	}
}

// why explains an error met while waiting our turn.
func (e *Election) why(ctx context.Context, s *session, err error) error {
	// Close ends e.ctx, and so s.ctx at once, but ctx a moment later.
	if ctx.Err() == nil && e.ctx.Err() == nil && s.ctx.Err() != nil {
		return fmt.Errorf("coord: campaign %q: session ended (%v): %w", e.key, s.Err(), ErrLeadershipLost)
	}
	return e.fail(ctx, "campaign", err)
}

// withdraw deletes our candidate key (rev 0: whatever its revision). If
// etcd cannot be told, it ends the session: its lease, and the key with it,
// is revoked as soon as etcd answers.
func (e *Election) withdraw(s *session, key string, rev int64) {
	if s.ctx.Err() == nil {
		ctx, cancel := context.WithTimeout(e.ctx, s.ttl)
		cmp := clientv3.Compare(clientv3.CreateRevision(key), "=", rev)
		if rev == 0 {
			cmp = clientv3.Compare(clientv3.LeaseValue(key), "=", s.id)
		}
		_, err := e.cli.Txn(ctx).If(cmp).Then(clientv3.OpDelete(key)).Commit()
		cancel()
		if err == nil {
			return
		}
		e.log.Warn("coord: cannot withdraw candidate, ending session", "lease", hexID(s.id), "err", err)
	}
	s.end(errors.New("coord: candidate could not be withdrawn"))
}

// monitor ends leadership l when its key is deleted; the session's end,
// Resign and Close end it through l.ctx.
func (e *Election) monitor(l *leadership, rev int64) {
	defer e.wg.Done()
	defer emit(e.signal, Signal{Kind: SignalLeadershipLost, Key: e.key, Token: l.rev})
	defer l.cancel()
	wch := e.cli.Watch(clientv3.WithRequireLeader(l.ctx), l.key, clientv3.WithRev(rev+1))
	for {
		select {
		case <-l.ctx.Done():
			e.log.Info("coord: leadership ended", "token", l.rev)
			return
		case wr, ok := <-wch:
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					// Ours, by Resign, or someone else's: either way it ends.
					e.log.Info("coord: leader key deleted, leadership ended", "token", l.rev)
					return
				}
				if ev.Kv.Lease != int64(l.sess.id) {
					e.log.Warn("coord: leader key written off our lease, stepping down", "token", l.rev, "lease", hexID(clientv3.LeaseID(ev.Kv.Lease)))
					e.dropKey(l)
					return
				}
			}
			if !ok || wr.Err() != nil {
				// The watch broke: read the key and watch on. If etcd will
				// not let us (client closed, permission denied), we can no
				// longer tell that we lead: step down rather than spin, and
				// end the session so that the key goes with its lease.
				var g *clientv3.GetResponse
				var err error
				ferr := fatal(l.ctx, e.cli, wr.Err())
				if ferr == nil {
					g, err = e.cli.Get(l.ctx, l.key)
					ferr = fatal(l.ctx, e.cli, err)
				}
				if ferr != nil {
					e.log.Warn("coord: cannot watch leader key, leadership ended", "token", l.rev, "err", ferr)
					if l.ctx.Err() == nil {
						l.sess.end(ferr)
					}
					return
				}
				if err == nil && (len(g.Kvs) == 0 || g.Kvs[0].CreateRevision != l.rev || g.Kvs[0].Lease != int64(l.sess.id)) {
					// Gone, or no longer ours: step down, and take back a
					// key of this term that now outlives our session.
					e.log.Warn("coord: leader key gone or no longer ours, leadership lost", "token", l.rev)
					e.dropKey(l)
					return
				}
				if err == nil {
					rev = g.Header.Revision
				}
				e.log.Debug("coord: leader watch broke, watching on", "token", l.rev, "rev", rev, "err", wr.Err())
				wch = e.cli.Watch(clientv3.WithRequireLeader(l.ctx), l.key, clientv3.WithRev(rev+1))
			}
		}
	}
}

// dropKey deletes the key of leadership l if it is still that of l: written
// off our session's lease, it would outlive the session, and no candidate
// could ever win again. Failure is only logged.
func (e *Election) dropKey(l *leadership) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(l.ctx), l.sess.ttl)
	defer cancel()
	_, err := e.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(l.key), "=", l.rev)).
		Then(clientv3.OpDelete(l.key)).Commit()
	e.log.Debug("coord: leader key taken back", "token", l.rev, "err", err)
}

// Proclaim announces a new identity as leader without a new election. It
// returns an error wrapping ErrNotLeader when we do not lead.
func (e *Election) Proclaim(ctx context.Context, identity string) error {
	ctx, done, err := e.acquire(ctx, "proclaim")
	if err != nil {
		return err
	}
	defer done()
	l := e.current()
	if l == nil {
		return fmt.Errorf("coord: proclaim %q: %w", e.key, ErrNotLeader)
	}
	return e.proclaim(ctx, l, identity)
}

// proclaim rewrites l's key, on l's own lease: a session started since
// must not keep an old leader key alive.
func (e *Election) proclaim(ctx context.Context, l *leadership, identity string) error {
	resp, err := e.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(l.key), "=", l.rev)).
		Then(clientv3.OpPut(l.key, identity, clientv3.WithLease(l.sess.id))).Commit()
	if err != nil {
		return e.fail(ctx, "proclaim", err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("coord: proclaim %q: %w", e.key, ErrNotLeader)
	}
	return nil
}

// Resign gives up leadership, so another candidate can lead. It returns nil
// when we do not lead. On error we still lead; Close ends it for good.
func (e *Election) Resign(ctx context.Context) error {
	ctx, done, err := e.acquire(ctx, "resign")
	if err != nil {
		return err
	}
	defer done()
	return e.resign(ctx)
}

func (e *Election) resign(ctx context.Context) error {
	l := e.current()
	if l == nil {
		return nil
	}
	_, err := e.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(l.key), "=", l.rev)).
		Then(clientv3.OpDelete(l.key)).Commit()
	if err != nil {
		return e.fail(ctx, "resign", err)
	}
	l.cancel()
	e.log.Info("coord: resigned", "token", l.rev)
	return nil
}

// Leader returns the identity of the current leader, or an error wrapping
// ErrNoLeader when there is none.
func (e *Election) Leader(ctx context.Context) (string, error) {
	if e.ctx.Err() != nil {
		return "", fmt.Errorf("coord: leader of %q: %w", e.key, ErrClosed)
	}
	resp, err := e.cli.Get(ctx, e.prefix, clientv3.WithFirstCreate()...)
	if err != nil {
		return "", opErr(fmt.Sprintf("leader of %q", e.key), err)
	}
	if len(resp.Kvs) == 0 {
		return "", fmt.Errorf("coord: leader of %q: %w", e.key, ErrNoLeader)
	}
	return string(resp.Kvs[0].Value), nil
}

// Observe returns a channel that receives the leader's identity, "" while
// there is none: first the current one, then each change. A slow reader
// gets the latest leader, not every one in between. The channel is closed
// when ctx ends, on Close, or when the client is closed; etcd faults and
// refusals (permission denied) do not close it: it retries. After Close it
// returns a closed channel.
func (e *Election) Observe(ctx context.Context) <-chan string {
	ch := make(chan string)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ctx.Err() != nil {
		close(ch)
		return ch
	}
	octx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(e.ctx, cancel)
	// Under e.mu, so that Close (which cancels e.ctx under e.mu) waits for it.
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		defer close(ch)
		defer cancel()
		defer stop()
		e.observe(octx, ch)
	}()
	return ch
}

func (e *Election) observe(ctx context.Context, ch chan<- string) {
	var (
		last string
		sent bool
		r    retry
	)
	for {
		resp, err := e.cli.Get(ctx, e.prefix, clientv3.WithPrefix())
		if err != nil {
			if e.over(ctx) {
				return
			}
			e.log.Debug("coord: observe: cannot list candidates", "err", err)
			sleep(ctx, r.next())
			continue
		}
		r = retry{}
		cands := map[string]*mvccpb.KeyValue{}
		for _, kv := range resp.Kvs {
			cands[string(kv.Key)] = kv
		}
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		wch := e.cli.Watch(wctx, e.prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	watch:
		for {
			var out chan<- string
			cur := leaderOf(cands)
			if !sent || cur != last {
				out = ch
			}
			select {
			case out <- cur:
				last, sent = cur, true
			case wr, ok := <-wch:
				if !ok || wr.Err() != nil {
					cancel()
					if e.over(ctx) {
						return
					}
					break watch
				}
				for _, ev := range wr.Events {
					if ev.Type == mvccpb.DELETE {
						delete(cands, string(ev.Kv.Key))
					} else {
						cands[string(ev.Kv.Key)] = ev.Kv
					}
				}
			}
		}
	}
}

// over reports whether an observer is over: its ctx ended (Close included)
// or the client was closed.
func (e *Election) over(ctx context.Context) bool {
	return ctx.Err() != nil || e.cli.Ctx().Err() != nil
}

// leaderOf returns the value of the candidate created first, "" if none.
func leaderOf(cands map[string]*mvccpb.KeyValue) string {
	var first *mvccpb.KeyValue
	for _, kv := range cands {
		if first == nil || kv.CreateRevision < first.CreateRevision {
			first = kv
		}
	}
	if first == nil {
		return ""
	}
	return string(first.Value)
}

// IsLeader reports whether we lead now, as far as we know.
func (e *Election) IsLeader() bool { return e.current() != nil }

// Done returns a channel closed when the current leadership ends: Resign,
// session expiry or renewals unanswered for 2/3 of the TTL, leader key
// deleted, Close. When we do not lead it returns a closed channel.
func (e *Election) Done() <-chan struct{} {
	if l := e.current(); l != nil {
		return l.ctx.Done()
	}
	return closedChan
}

// Token returns the fencing token of the current leadership, the create
// revision of our leader key, or 0 when we do not lead. Tokens of
// successive leaders of a key strictly increase.
func (e *Election) Token() int64 {
	if l := e.current(); l != nil {
		return l.rev
	}
	return 0
}

// Guard returns a Txn comparison that holds only while our leader key
// exists with the current token. When we do not lead it never holds.
func (e *Election) Guard() clientv3.Cmp {
	if l := e.current(); l != nil {
		return clientv3.Compare(clientv3.CreateRevision(l.key), "=", l.rev)
	}
	return clientv3.Compare(clientv3.CreateRevision(e.prefix), "=", -1)
}

// Key returns the election's key.
func (e *Election) Key() string { return e.key }

// Close resigns, releases the session and waits for the election's
// goroutines; Campaigns under way return ErrClosed. It bounds its own time
// to about one TTL. It is idempotent; on an election handed out by an
// ElectionPool it does nothing (the pool owns it).
func (e *Election) Close() error {
	if e.pooled {
		return nil
	}
	return e.close()
}

func (e *Election) close() error {
	e.once.Do(func() {
		// Ending e.ctx ends every session, and so the leadership; each
		// session revokes its lease, which deletes our keys, on its way out.
		// Under e.mu, so that no Observe starts a goroutine past wg.Wait.
		e.mu.Lock()
		e.cancel()
		e.mu.Unlock()
		// Wait out a campaign under way; the turn is never given back.
		e.turn <- struct{}{}
		e.wg.Wait()
	})
	return nil
}

var closedChan = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

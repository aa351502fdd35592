package coord

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Election is a leader election on one key, compatible with etcd's
// concurrency package. It holds a session (a lease) renewed in the
// background and replaced when it ends. It is safe for concurrent use:
// Campaigns run one at a time, and nothing else waits for a pending one.
// Once the caller's client is closed, leadership ends and calls fail with
// ErrClientClosed.
type Election struct {
	cli      *clientv3.Client
	watchCli *clientv3.Client // Observe's: WatchClient, else cli
	key      string
	prefix   string // key + "/": where candidates live
	ttl      time.Duration
	identity string
	log      *slog.Logger
	signal   func(Signal)
	pool     *ElectionPool // the pool whose sessions it shares; nil if it has its own
	slot     *poolSession  // its place on a shared session; guarded by pool.mu
	unclaim  func()        // a pooled Election's: gives its key back to the host (see claim)
	c        *candidacy    // our place in line, taken by each campaign

	ctx    context.Context // ended by Close, with cause ErrClosed
	cancel context.CancelCauseFunc
	turn   chan struct{} // one-slot semaphore: one campaign at a time
	wg     sync.WaitGroup
	once   sync.Once

	mu      sync.Mutex
	sess    *session
	lead    *leadership             // the latest leadership; over once its ctx is done
	pending context.CancelCauseFunc // ends the campaign under way, if any
	// campaigned is closed when the campaign under way, if any, has
	// returned: what it left in etcd is then being settled (c.settling).
	campaigned <-chan struct{}
	// granting is when the election started to go without a live
	// session, zero while it has one.
	granting time.Time
}

// NewElection joins the election on opts.Key with a new session. ctx bounds
// the session's creation only; the election lives until Close.
func NewElection(ctx context.Context, cli *clientv3.Client, opts ElectionOptions) (*Election, error) {
	if cli == nil {
		return nil, ErrNilClient
	}
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	e := newElection(cli, opts.Key, opts.TTL, opts.Identity, logger(opts.Logger), opts.OnSignal, new(etcdMark))
	e.watchCli = cmp.Or(opts.WatchClient, cli)
	if _, err := e.session(ctx); err != nil {
		e.cancel(ErrClosed)
		return nil, opErr(fmt.Sprintf("election %q", opts.Key), err)
	}
	return e, nil
}

func newElection(cli *clientv3.Client, key string, ttl time.Duration, identity string, log *slog.Logger, signal func(Signal), mark *etcdMark) *Election {
	ctx, cancel := context.WithCancelCause(context.Background())
	e := &Election{
		cli:      cli,
		watchCli: cli,
		key:      key,
		prefix:   key + "/",
		ttl:      ttl,
		identity: identityOrDefault(identity),
		log:      log.With("key", key),
		signal:   signal,
		ctx:      ctx,
		cancel:   cancel,
		turn:     make(chan struct{}, 1),
	}
	e.c = &candidacy{cli: cli, key: key, prefix: e.prefix, limit: 1, words: electionWords, log: e.log,
		signal: signal, session: e.session, mark: mark, stepped: newStepped(ctx, &e.wg), held: e.held, wg: &e.wg,
		unsettled: closedChan}
	return e
}

// held publishes leadership l, before it is announced.
func (e *Election) held(l *leadership) {
	e.mu.Lock()
	e.lead = l
	e.mu.Unlock()
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
	e.granted(nil)
	var err error
	if e.pool != nil {
		s, err = e.pool.share(ctx, e)
	} else {
		s, err = startSession(ctx, e.ctx, e.cli, e.ttl, e.log, &e.wg)
	}
	if err != nil {
		return nil, err
	}
	e.granted(s)
	return s, nil
}

func (e *Election) release() { <-e.turn }

// bind returns a context that ends with ctx or when the election is closed.
func (e *Election) bind(ctx context.Context) (context.Context, context.CancelFunc) {
	return withCancelOn(ctx, e.ctx)
}

// callErr explains an error met by a call: ErrClosed if Close cut it short,
// ErrClientClosed once the client is closed, else what was being done,
// wrapping err (and the end of ctx).
func (e *Election) callErr(ctx context.Context, what string, err error) error {
	return explain(ctx, e.ctx, e.cli, what, e.key, err)
}

// current returns the leadership in force, or nil. It is judged at the
// call: a leadership whose lease can no longer be vouched for is over,
// even before a timer has said so.
func (e *Election) current() *leadership {
	e.mu.Lock()
	l := e.lead
	e.mu.Unlock()
	if l == nil || l.ctx.Err() != nil || !l.sess.k.valid() {
		return nil
	}
	return l
}

// Campaign blocks until we lead the election, proclaiming identity (or
// ElectionOptions.Identity when ""). If we lead already it proclaims the new
// identity and returns nil.
//
// It waits through etcd outages: a candidacy whose session ends (expired,
// revoked, renewals unanswered for two TTLs) starts a new session and
// queues again, for as long as ctx lasts. After a step-down for unanswered
// renewals, a Campaign pending when etcd answers again resumes the
// leadership if its key still stands on its live lease: same key, same
// Token, a new Done, SignalLeadershipResumed. Nobody else can have led
// meanwhile: the candidates behind wait for that key's delete. (Without a
// pending Campaign, the key is deleted as soon as etcd answers.) It returns nil only when we lead on a live session,
// and an error only when ctx ends (errors.Is(err, ctx.Err()) holds), on
// Resign (ErrResigned), Close (ErrClosed), a closed client
// (ErrClientClosed), or a refusal that retrying cannot pass (permission
// denied). It returns within ctx; on error, no candidate key of ours is
// left behind: what etcd could not be told within ctx is withdrawn in the
// background, bounded by the TTL.
func (e *Election) Campaign(ctx context.Context, identity string) error {
	_, err := e.campaign(ctx, identity, true)
	return err
}

// TryCampaign becomes leader if nobody else leads, without waiting: it
// returns false, and leaves no key behind, when another candidate is ahead,
// and at once when a Campaign of this Election is pending.
func (e *Election) TryCampaign(ctx context.Context, identity string) (bool, error) {
	return e.campaign(ctx, identity, false)
}

func (e *Election) campaign(ctx context.Context, identity string, wait bool) (bool, error) {
	if identity == "" {
		identity = e.identity
	}
	if ctx.Err() != nil {
		// Not started: nothing is written.
		return false, e.callErr(ctx, "campaign", ctx.Err())
	}
	if took, err := e.takeTurn(ctx, wait); !took {
		return false, err
	}
	defer e.release()
	cctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	defer context.AfterFunc(e.ctx, func() { cancel(ErrClosed) })()
	campaigned := make(chan struct{})
	e.mu.Lock()
	e.pending, e.campaigned = cancel, campaigned
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		e.pending, e.campaigned = nil, nil
		e.mu.Unlock()
		close(campaigned)
	}()
	if l := e.current(); l != nil {
		err := e.proclaim(cctx, l, identity)
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, ErrNotLeader) {
			return false, e.campaignErr(ctx, cctx, err)
		}
	}
	l, err := e.c.run(cctx, identity, wait)
	if err != nil {
		return false, e.campaignErr(ctx, cctx, err)
	}
	return l != nil, nil
}

// takeTurn takes the campaign turn. Without wait it does not wait for a
// pending Campaign of ours: someone (us) is ahead, so it reports false, nil.
func (e *Election) takeTurn(ctx context.Context, wait bool) (bool, error) {
	if !wait {
		select {
		case e.turn <- struct{}{}:
		default:
			if e.ctx.Err() != nil {
				return false, e.callErr(ctx, "campaign", ErrClosed)
			}
			return false, nil
		}
	} else {
		select {
		case e.turn <- struct{}{}:
		case <-ctx.Done():
			return false, e.callErr(ctx, "campaign", ctx.Err())
		case <-e.ctx.Done():
			// Close holds the turn for good: it is not ours to take.
			return false, e.callErr(ctx, "campaign", ErrClosed)
		}
	}
	if e.ctx.Err() != nil || e.cli.Ctx().Err() != nil {
		// Calls on a closed client would retry for seconds before failing.
		e.release()
		return false, e.callErr(ctx, "campaign", ErrClosed)
	}
	return true, nil
}

// campaignErr explains why a campaign ended without leading: ctx is the
// caller's, cctx the campaign's own (ended by Resign, Close, the client).
func (e *Election) campaignErr(ctx, cctx context.Context, err error) error {
	if errors.Is(context.Cause(cctx), ErrResigned) && ctx.Err() == nil && e.ctx.Err() == nil {
		return opErr(fmt.Sprintf("campaign %q", e.key), ErrResigned)
	}
	return e.callErr(ctx, "campaign", err)
}

// Proclaim announces a new identity as leader without a new election. It
// returns an error wrapping ErrNotLeader when we do not lead. It does not
// wait for a pending Campaign.
func (e *Election) Proclaim(ctx context.Context, identity string) error {
	if e.ctx.Err() != nil || e.cli.Ctx().Err() != nil {
		return e.callErr(ctx, "proclaim", ErrClosed)
	}
	l := e.current()
	if l == nil {
		return opErr(fmt.Sprintf("proclaim %q", e.key), ErrNotLeader)
	}
	ctx, cancel := e.bind(ctx)
	defer cancel()
	return e.proclaim(ctx, l, identity)
}

// proclaim rewrites l's key, on l's own lease: a session started since
// must not keep an old leader key alive.
func (e *Election) proclaim(ctx context.Context, l *leadership, identity string) error {
	resp, err := e.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(l.key), "=", l.rev)).
		Then(clientv3.OpPut(l.key, identity, clientv3.WithLease(l.sess.id))).Commit()
	if err != nil {
		return e.callErr(ctx, "proclaim", err)
	}
	if !resp.Succeeded {
		return opErr(fmt.Sprintf("proclaim %q", e.key), ErrNotLeader)
	}
	return nil
}

// Resign gives up leadership, so that another candidate can lead, and
// withdraws a pending Campaign of this Election (which returns an error
// wrapping ErrResigned). A leadership that stepped down is given up too:
// its key is deleted as soon as etcd answers, never resumed. Our leadership ends at once (Done closes, Err
// wraps ErrResigned). Resign returns nil once our key is gone from etcd;
// if etcd cannot be told within ctx, it returns ctx's error and the delete
// goes on in the background, bounded by the TTL. Should that fail too, the
// session ends, so that the key goes with its lease as soon as etcd
// answers; an Election of its own ends its session at once instead. A
// pooled Election's shared session, and every other leadership on it, is
// never ended for want of ctx. Resign returns nil when we neither lead nor
// campaign; it never waits for a pending Campaign to lead.
func (e *Election) Resign(ctx context.Context) error {
	e.mu.Lock()
	if e.ctx.Err() != nil || ctx.Err() != nil || e.cli.Ctx().Err() != nil {
		e.mu.Unlock()
		// Not started: nothing changes. (A closed client sends nothing
		// more, as after a crash: the key goes with the lease.)
		return e.callErr(ctx, "resign", ctx.Err())
	}
	// Counted, so that Close waits for what Resign starts.
	e.wg.Add(1)
	defer e.wg.Done()
	l, pending, campaigned := e.lead, e.pending, e.campaigned
	e.mu.Unlock()
	ctx, cancel := e.bind(ctx)
	defer cancel()
	// A leadership that stepped down is not taken back: its key goes as
	// soon as etcd answers.
	e.c.stepped.giveUp(nil)
	if pending != nil {
		pending(ErrResigned)
		// The withdrawn candidacy settles its key as the Campaign returns.
		if !within(ctx, campaigned) || !within(ctx, e.c.settling()) {
			return e.callErr(ctx, "resign", ctx.Err())
		}
	}
	if l == nil || l.ctx.Err() != nil {
		return nil
	}
	var err error
	settled := e.c.release(l, ErrResigned, "resign", &err)
	e.log.Info("coord: resigned", "token", l.rev)
	if !within(ctx, settled) {
		if e.pool == nil {
			// Our own session: its lease takes the key.
			l.sess.end(errors.New("leader key could not be deleted on resign"))
		}
		return e.callErr(ctx, "resign", ctx.Err())
	}
	if err != nil {
		return e.callErr(ctx, "resign", err)
	}
	return nil
}

// Leader returns the identity of the current leader, or an error wrapping
// ErrNoLeader when there is none. It reports what etcd holds: a process
// that stepped down while cut off may be shown until its key goes.
func (e *Election) Leader(ctx context.Context) (string, error) {
	if e.ctx.Err() != nil {
		return "", opErr(fmt.Sprintf("leader of %q", e.key), ErrClosed)
	}
	resp, err := e.cli.Get(ctx, e.prefix, clientv3.WithFirstCreate()...)
	if err != nil {
		return "", opErr(fmt.Sprintf("leader of %q", e.key), err)
	}
	if len(resp.Kvs) == 0 {
		return "", opErr(fmt.Sprintf("leader of %q", e.key), ErrNoLeader)
	}
	return string(resp.Kvs[0].Value), nil
}

// Observe returns a channel that receives the leader's identity, "" while
// there is none: first the current one, then each change. A slow reader
// gets the latest leader, not every one in between. It reports what etcd
// holds: a process that stepped down while cut off may be shown until its
// key goes. It reads and watches through the election's WatchClient, if
// it has one. The channel is closed when ctx ends, on Close, or when the
// client (or WatchClient) is closed; etcd faults do not close it: it
// retries with backoff, and logs a refusal (permission denied) as a
// warning. After Close it returns a closed channel.
func (e *Election) Observe(ctx context.Context) <-chan string {
	ch := make(chan string)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ctx.Err() != nil {
		close(ch)
		return ch
	}
	octx, cancel := e.bind(ctx)
	// Under e.mu, so that Close (which cancels e.ctx under e.mu) waits for it.
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		defer close(ch)
		defer cancel()
		o := observer{e: e, ch: ch}
		o.run(octx)
	}()
	return ch
}

// observer follows the candidates of an election for Observe.
type observer struct {
	e    *Election
	ch   chan<- string
	last string // the last leader sent
	sent bool   // whether anything was sent
}

// run lists the candidates and follows them, again after each broken
// watch, until ctx ends or the client is closed.
func (o *observer) run(ctx context.Context) {
	var r retry
	for {
		resp, err := o.e.watchCli.Get(ctx, o.e.prefix, clientv3.WithPrefix())
		if err == nil {
			var news bool
			news, err = o.follow(ctx, resp)
			if news {
				r = retry{}
			}
		}
		if o.ended(ctx) {
			return
		}
		if fatal(ctx, o.e.watchCli, err) != nil {
			o.e.log.Warn("coord: observe: etcd refuses, retrying", "err", err)
		} else {
			o.e.log.Debug("coord: observe: watch broke, listing again", "err", err)
		}
		sleep(ctx, r.next())
	}
}

// follow sends the leader among the candidates listed by resp, and each
// change of it, until the watch breaks. It reports whether the watch
// brought news, and why it ended.
func (o *observer) follow(ctx context.Context, resp *clientv3.GetResponse) (news bool, _ error) {
	cands := map[string]*mvccpb.KeyValue{}
	for _, kv := range resp.Kvs {
		cands[string(kv.Key)] = kv
	}
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	wch := o.e.watchCli.Watch(wctx, o.e.prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	for {
		var out chan<- string
		cur := leaderOf(cands)
		if !o.sent || cur != o.last {
			out = o.ch
		}
		// A watch ends with ctx, closed or not (see responses).
		var wr clientv3.WatchResponse
		ok := false
		select {
		case out <- cur:
			o.last, o.sent = cur, true
			continue
		case wr, ok = <-wch:
		case <-ctx.Done():
		}
		if !ok || wr.Err() != nil {
			return news, wr.Err()
		}
		news = true
		for _, ev := range wr.Events {
			if ev.Type == mvccpb.DELETE {
				delete(cands, string(ev.Kv.Key))
			} else {
				cands[string(ev.Kv.Key)] = ev.Kv
			}
		}
	}
}

// ended reports whether the observer is to end: its ctx ended (Close
// included) or a client it uses was closed.
func (o *observer) ended(ctx context.Context) bool {
	return ctx.Err() != nil || o.e.cli.Ctx().Err() != nil || o.e.watchCli.Ctx().Err() != nil
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

// IsLeader reports whether we lead now. It is judged at the call, on the
// monotonic clock: false once two thirds of the TTL have passed since the
// last renewal etcd answered, even if the process was paused and no timer
// has fired yet.
func (e *Election) IsLeader() bool { return e.current() != nil }

// Done returns a channel closed when the current leadership ends: Resign,
// session expiry or renewals unanswered for 2/3 of the TTL (measured from
// the last answered renewal; a Campaign may resume it, with a new Done),
// leader key deleted, Close. When we do not
// lead it returns a closed channel.
func (e *Election) Done() <-chan struct{} {
	if l := e.current(); l != nil {
		return l.ctx.Done()
	}
	return closedChan
}

// Err says why the latest leadership ended: an error wrapping ErrResigned
// after Resign, ErrClosed after Close, ErrClientClosed when the client was
// closed, else ErrLeadershipLost wrapping the cause (renewals unanswered,
// lease expired or revoked, key deleted). It is nil while we lead and
// before any leadership.
func (e *Election) Err() error {
	e.mu.Lock()
	l := e.lead
	e.mu.Unlock()
	return termErr(l, e.current() == l)
}

// Token returns the fencing token of the current leadership, the create
// revision of our leader key, or 0 when we do not lead (judged as
// IsLeader). Tokens of successive leaders of a key strictly increase.
func (e *Election) Token() int64 {
	if l := e.current(); l != nil {
		return l.rev
	}
	return 0
}

// wonAt returns the revision from which the latest leadership holds (or
// held); called once a Campaign has won, so there is one.
func (e *Election) wonAt() int64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lead.at
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

// Close resigns (or withdraws a pending Campaign, which returns
// ErrClosed), releases the session and waits for the election's
// goroutines. It bounds its own time to about one TTL, and is idempotent.
// An Election of an ElectionPool deletes its candidate key from the shared
// session (if etcd cannot be told within the TTL, that session ends, so
// that the key goes with its lease) and gives its key back to the pool.
func (e *Election) Close() error {
	e.once.Do(func() {
		// Ending e.ctx ends a Campaign under way and every session of our
		// own; each revokes its lease, which deletes our keys, on its way
		// out. Under e.mu, so that no Observe starts a goroutine past
		// wg.Wait.
		e.mu.Lock()
		e.cancel(ErrClosed)
		e.mu.Unlock()
		// Wait out a campaign under way; the turn is never given back.
		// Only then is the latest leadership known: a campaign that won
		// as Close began has made it ours, and its key must go too (on a
		// shared session, nothing else would take it, and its monitor
		// would never end).
		e.turn <- struct{}{}
		e.mu.Lock()
		l := e.lead
		e.mu.Unlock()
		if e.pool != nil {
			e.leave(l)
		}
		e.wg.Wait()
		if e.pool != nil {
			e.pool.release(e)
		}
	})
	return nil
}

// leave ends leadership l of a pooled election, if it is live, and
// deletes its key from the shared session, which outlives us.
func (e *Election) leave(l *leadership) {
	if l == nil || l.ctx.Err() != nil {
		return
	}
	l.cancel(ErrClosed)
	// A closed client sends nothing more, as after a crash (see revoke):
	// the key goes with the shared lease.
	err := e.cli.Ctx().Err()
	if err == nil {
		err = e.c.deleteWithin(l.sess, l.key, l.rev)
	}
	if err != nil {
		e.log.Warn("coord: cannot delete leader key, ending the shared session", "lease", hexID(l.sess.id), "err", err)
		l.sess.end(errors.New("leader key could not be deleted on close"))
	}
}

var closedChan = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// Healthy returns nil while a Campaign of ours is under way or we lead,
// on a session whose renewals etcd answers: a standby waiting in line is
// healthy, and so is an Election that does not campaign. It returns an
// error when the session's renewals have gone unanswered for over a third
// of the TTL past the one due (see keeper), or when no session could be
// granted for over the TTL; and "closed" after Close or once the client
// is closed.
func (e *Election) Healthy() error {
	if err := e.health(time.Now()); err != nil {
		return opErr(fmt.Sprintf("election %q", e.key), err)
	}
	return nil
}

func (e *Election) health(now time.Time) error {
	if e.ctx.Err() != nil {
		return errHClosed
	}
	if e.cli.Ctx().Err() != nil {
		return ErrClientClosed
	}
	e.mu.Lock()
	wanted := e.pending != nil || e.lead != nil && e.lead.ctx.Err() == nil
	s, granting := e.sess, e.granting
	e.mu.Unlock()
	if !wanted {
		return nil
	}
	return judgeSession(s, granting, e.ttl, now)
}

// granted records that the election has the live session s, or, with
// nil, that it is getting one.
func (e *Election) granted(s *session) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case s != nil:
		e.sess, e.granting = s, time.Time{}
	case e.granting.IsZero():
		e.granting = time.Now()
	}
}

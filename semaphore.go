package coord

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Semaphore hands out up to Limit permits of one key, fleet-wide, first
// come, first served, each with a fencing token: never more than Limit
// permits whose Guards hold at once. The permits are candidate keys under
// Key+"/", on the semaphore's session, ranked by create revision; the
// first Limit of them are held. An Election is a semaphore of one: both
// run the same candidacies, and a permit steps down when cut off from
// etcd as a leader does. Key itself holds the Limit, stored by the first
// user; Key must not also name an election.
//
// It is safe for concurrent use: each Acquire is a permit of its own, and
// one process may hold several. Once the caller's client is closed, its
// permits end and calls fail with ErrClientClosed.
type Semaphore struct {
	cli      *clientv3.Client
	key      string
	prefix   string // key + "/": where permits live
	limit    int
	ttl      time.Duration
	host     *HostLiveness // with Host: the registration whose lease the permits ride
	unclaim  func()        // gives our key back to the host (see claim)
	identity string
	log      *slog.Logger
	signal   func(Signal)
	mark     etcdMark // the etcd of its candidacies' answers
	stepped  *stepped // permits that may be taken back after a step-down

	ctx    context.Context // ended by Close, with cause ErrClosed
	cancel context.CancelCauseFunc
	calls  sync.WaitGroup // calls under way; Close waits for them
	wg     sync.WaitGroup // the goroutines of sessions and candidacies
	n      atomic.Int64   // numbers our permit keys
	once   sync.Once

	mu       sync.Mutex
	sess     *session
	starting chan struct{} // closed when the session being started is ready
	closed   bool
	granting time.Time // when it started to go without a live session, zero while it has one
	busy     int       // Acquires under way and permits held
}

// Holder is a permit held, as etcd holds it.
type Holder struct {
	Identity string // SemaphoreOptions.Identity of its holder
	Token    int64  // its fencing token
}

// Permit is one permit of a Semaphore, from Acquire until it ends
// (Release, lost, Close). It is safe for concurrent use.
type Permit struct {
	s *Semaphore
	c *candidacy
	l *leadership
}

// NewSemaphore joins the semaphore on opts.Key with a new session. The
// first user stores opts.Limit at Key; another Limit fails with
// ErrLimitMismatch and writes nothing. Invalid options (ErrNilClient,
// ErrInvalidKey, ErrInvalidLimit, ErrInvalidTTL) write nothing either.
// ctx bounds the call only; the semaphore lives until Close.
func NewSemaphore(ctx context.Context, cli *clientv3.Client, opts SemaphoreOptions) (*Semaphore, error) {
	if cli == nil {
		return nil, ErrNilClient
	}
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	ttl := opts.TTL
	unclaim := func() {}
	if h := opts.Host; h != nil {
		if unclaim, err = h.claim(opts.Key); err != nil {
			return nil, opErr(fmt.Sprintf("semaphore %q", opts.Key), err)
		}
	}
	sctx, cancel := context.WithCancelCause(context.Background())
	s := &Semaphore{cli: cli, key: opts.Key, prefix: opts.Key + "/", limit: opts.Limit, ttl: ttl, host: opts.Host, unclaim: unclaim,
		identity: identityOrDefault(opts.Identity), log: logger(opts.Logger).With("key", opts.Key),
		signal: opts.OnSignal, ctx: sctx, cancel: cancel}
	s.stepped = newStepped(sctx, &s.wg)
	err = s.storeLimit(ctx)
	if err == nil {
		_, err = s.session(ctx)
	}
	if err != nil {
		s.cancel(ErrClosed)
		unclaim()
		return nil, opErr(fmt.Sprintf("semaphore %q", opts.Key), err)
	}
	return s, nil
}

// storeLimit stores our Limit at the key if none is there, else checks
// that the one there is ours.
func (s *Semaphore) storeLimit(ctx context.Context) error {
	want := strconv.Itoa(s.limit)
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(s.key), "=", 0)).
		Then(clientv3.OpPut(s.key, want)).Else(clientv3.OpGet(s.key)).Commit()
	if err != nil {
		return fmt.Errorf("store limit: %w", err)
	}
	if resp.Succeeded {
		return nil
	}
	if got := string(resp.Responses[0].GetResponseRange().Kvs[0].Value); got != want {
		return fmt.Errorf("%w: the key holds %q, want %d", ErrLimitMismatch, got, s.limit)
	}
	return nil
}

// session returns the live session, starting a new one if it ended. One
// caller starts it; the others wait for it, within their ctx, and no lock
// is held meanwhile.
func (s *Semaphore) session(ctx context.Context) (*session, error) {
	for {
		s.mu.Lock()
		cur, starting := s.sess, s.starting
		live := cur != nil && cur.ctx.Err() == nil
		if !live && starting == nil {
			s.starting = make(chan struct{})
			s.granting = cmp.Or(s.granting, time.Now())
		}
		s.mu.Unlock()
		switch {
		case live:
			return cur, nil
		case starting == nil:
			return s.start(ctx)
		case !within(ctx, starting):
			return nil, ctx.Err()
		}
	}
}

// start starts a session (with Host, on its lease) and publishes it;
// called by the one starter. Our permit keys are numbered: a host
// session's keys are never those of an earlier one still being swept.
func (s *Semaphore) start(ctx context.Context) (*session, error) {
	var (
		ss  *session
		err error
	)
	if s.host != nil {
		ss, err = startHostSession(ctx, s.ctx, s.host, nil, s.log, &s.wg)
	} else {
		ss, err = startSession(ctx, s.ctx, s.cli, s.ttl, s.log, &s.wg)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	close(s.starting)
	s.starting = nil
	if err != nil {
		return nil, err
	}
	s.sess, s.granting = ss, time.Time{}
	return ss, nil
}

// enter counts a call under way, unless Close was called.
func (s *Semaphore) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.calls.Add(1)
	return true
}

// callErr explains an error met by a call (see explain).
func (s *Semaphore) callErr(ctx context.Context, what string, err error) error {
	return explain(ctx, s.ctx, s.cli, what, s.key, err)
}

// Acquire waits for a permit, first come, first served, and returns it.
//
// It waits through etcd outages: a wait whose session ends (expired,
// revoked, renewals unanswered for two TTLs) starts a new session and
// queues again, for as long as ctx lasts. After a permit of this
// Semaphore stepped down for unanswered renewals, an Acquire pending when
// etcd answers again resumes it if its key still stands on its live
// lease: a new Permit with the same key and Token, SignalPermitResumed. It returns a permit only when it is held on a
// live session, and an error only when ctx ends (errors.Is(err,
// ctx.Err()) holds), on Close (ErrClosed), a closed client
// (ErrClientClosed), or a refusal that retrying cannot pass (permission
// denied). It returns within ctx; on error, no key of ours is left
// behind: what etcd could not be told within ctx is withdrawn in the
// background, bounded by the TTL.
func (s *Semaphore) Acquire(ctx context.Context) (*Permit, error) { return s.acquire(ctx, true) }

// TryAcquire returns a permit if one is free, without waiting: when all
// are held (or asked for before us), it returns an error wrapping
// ErrNoPermit at once, and leaves no key behind.
func (s *Semaphore) TryAcquire(ctx context.Context) (*Permit, error) { return s.acquire(ctx, false) }

func (s *Semaphore) acquire(ctx context.Context, wait bool) (*Permit, error) {
	if ctx.Err() != nil {
		// Not started: nothing is written.
		return nil, s.callErr(ctx, "acquire", ctx.Err())
	}
	if !s.enter() {
		return nil, s.callErr(ctx, "acquire", ErrClosed)
	}
	defer s.calls.Done()
	defer s.using()()
	if s.cli.Ctx().Err() != nil {
		// Calls on a closed client would retry for seconds before failing.
		return nil, s.callErr(ctx, "acquire", ErrClientClosed)
	}
	actx, cancel := withCancelOn(ctx, s.ctx)
	defer cancel()
	c := &candidacy{cli: s.cli, key: s.key, prefix: s.prefix, suffix: fmt.Sprintf("-%d", s.n.Add(1)),
		limit: int64(s.limit), words: permitWords, log: s.log, signal: s.signal, session: s.session, mark: &s.mark,
		stepped: s.stepped, wg: &s.wg, unsettled: closedChan}
	l, err := c.run(actx, s.identity, wait)
	switch {
	case err != nil:
		return nil, s.callErr(ctx, "acquire", err)
	case l == nil:
		return nil, opErr(fmt.Sprintf("acquire %q", s.key), ErrNoPermit)
	}
	context.AfterFunc(l.ctx, s.using())
	return &Permit{s: s, c: c, l: l}, nil
}

// Holders returns the permits held, as etcd holds them, by Token. A
// process that stepped down while cut off may be listed until its key
// goes.
func (s *Semaphore) Holders(ctx context.Context) ([]Holder, error) {
	what := fmt.Sprintf("holders of %q", s.key)
	if s.ctx.Err() != nil {
		return nil, opErr(what, ErrClosed)
	}
	resp, err := s.cli.Get(ctx, s.prefix, top(int64(s.limit), clientv3.SortAscend)...)
	if err != nil {
		return nil, opErr(what, err)
	}
	hs := make([]Holder, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		hs = append(hs, Holder{Identity: string(kv.Value), Token: kv.CreateRevision})
	}
	return hs, nil
}

// Key returns the semaphore's key.
func (s *Semaphore) Key() string { return s.key }

// Close ends our permits and waits (their Acquires return ErrClosed),
// revokes the session, which removes their keys (with Host, the keys are
// deleted, and the host's lease lives on), and waits for the
// semaphore's goroutines. It bounds its own time to about one TTL, and
// is idempotent.
func (s *Semaphore) Close() error {
	s.once.Do(func() {
		s.mu.Lock()
		s.closed = true
		s.cancel(ErrClosed)
		s.mu.Unlock()
		s.calls.Wait()
		s.wg.Wait()
		s.unclaim()
	})
	return nil
}

// held reports whether the permit is held now, judged at the call on the
// monotonic clock, as Election.IsLeader.
func (p *Permit) held() bool { return p.l.ctx.Err() == nil && p.l.sess.k.valid() }

// Token returns the permit's fencing token: the create revision of its
// key, unique and increasing across the semaphore's permits. It stays
// the permit's after it ended; Guard says whether it holds.
func (p *Permit) Token() int64 { return p.l.rev }

// Guard returns a Txn comparison that holds only while the permit is
// held: its key exists with its token. Once the permit ended (judged as
// Done), it never holds.
func (p *Permit) Guard() clientv3.Cmp {
	if p.held() {
		return clientv3.Compare(clientv3.CreateRevision(p.l.key), "=", p.l.rev)
	}
	return clientv3.Compare(clientv3.CreateRevision(p.s.prefix), "=", -1)
}

// Done returns a channel closed when the permit ends: Release, session
// expiry or renewals unanswered for 2/3 of the TTL (measured from the
// last answered renewal), its key deleted, Close. Once the permit ended
// it returns a closed channel.
func (p *Permit) Done() <-chan struct{} {
	if p.held() {
		return p.l.ctx.Done()
	}
	return closedChan
}

// Err says why the permit ended: ErrReleased after Release, ErrClosed
// after Close, ErrClientClosed when the client was closed, else
// ErrPermitLost wrapping the cause (renewals unanswered, lease expired
// or revoked, key deleted; errors.Is(err, ErrLeadershipLost) holds too).
// It is nil while the permit is held.
func (p *Permit) Err() error { return termErr(p.l, p.held()) }

// Release gives the permit up, so that the next in line gets it: it
// ends at once (Done closes, Err is ErrReleased), and Release returns
// nil once its key is gone from etcd. If etcd cannot be told within ctx,
// it returns ctx's error and the delete goes on in the background,
// bounded by the TTL; should that fail too, the session ends, so that
// the key goes with its lease as soon as etcd answers. A permit that
// ended already returns nil once what its Release started is settled
// (a permit lost takes its key with its session); one that stepped down
// is not resumed: its key is deleted as soon as etcd answers.
func (p *Permit) Release(ctx context.Context) error {
	s := p.s
	if ctx.Err() != nil || s.cli.Ctx().Err() != nil || !s.enter() {
		// Not started: nothing changes. (A closed client sends nothing
		// more, as after a crash: the key goes with the lease.)
		return s.callErr(ctx, "release", ctx.Err())
	}
	defer s.calls.Done()
	ctx, cancel := withCancelOn(ctx, s.ctx)
	defer cancel()
	// A permit that stepped down is not taken back: its key goes as soon
	// as etcd answers.
	s.stepped.giveUp(p.l)
	settled := p.c.settling()
	var err error
	if l := p.l; l.ctx.Err() == nil {
		settled = p.c.release(l, ErrReleased, "release", &err)
		s.log.Info("coord: permit released", "token", l.rev)
	}
	if !within(ctx, settled) {
		return s.callErr(ctx, "release", ctx.Err())
	}
	if err != nil {
		return s.callErr(ctx, "release", err)
	}
	return nil
}

// Healthy returns nil while no Acquire is under way and no permit held,
// or while they are, on a session whose renewals etcd answers. It returns
// an error when, with an Acquire under way or a permit held, the
// session's renewals have gone unanswered for over a third of the TTL
// past the one due (see keeper), or no session could be granted for over
// the TTL; and "closed" after Close or once the client is closed.
func (s *Semaphore) Healthy() error {
	if err := s.health(time.Now()); err != nil {
		return opErr(fmt.Sprintf("semaphore %q", s.key), err)
	}
	return nil
}

func (s *Semaphore) health(now time.Time) error {
	if s.ctx.Err() != nil {
		return errHClosed
	}
	if s.cli.Ctx().Err() != nil {
		return ErrClientClosed
	}
	s.mu.Lock()
	busy, sess, granting := s.busy, s.sess, s.granting
	s.mu.Unlock()
	if busy == 0 {
		return nil
	}
	return judgeSession(sess, granting, s.ttl, now)
}

// using counts an Acquire under way or a permit held until the returned
// function is called.
func (s *Semaphore) using() func() {
	s.mu.Lock()
	s.busy++
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		s.busy--
		s.mu.Unlock()
	}
}

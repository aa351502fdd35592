package coord

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// A line of candidates: the keys under a prefix, each on a session's
// lease, ranked by create revision. The first limit of them hold; keys
// ahead of a candidate only ever go, so a candidate that holds holds until
// its own key goes, and its create revision is an exact fencing token. An
// election is a line whose first holds; a semaphore one whose first Limit
// hold. A candidacy is one place in such a line, taken again after each
// loss until it holds or its ctx ends.

// leadership is one term holding a place of a line: an election's
// leadership, or a permit. Its ctx's cause says why it ended.
type leadership struct {
	key      string
	rev      int64           // create revision of key: the fencing token
	at       int64           // the revision from which it holds (our key stood then)
	identity string          // what the term was gained as
	lost     error           // what it wraps once lost: ErrLeadershipLost, ErrPermitLost
	sess     *session        // the session whose lease the key is attached to
	up       context.Context // the session's up context it started in (see keeper.upCtx)
	ctx      context.Context
	cancel   context.CancelCauseFunc
}

// Why a term whose key was deleted ended.
var (
	errKeyDeleted       = errors.New("leader key deleted")
	errPermitKeyDeleted = errors.New("permit key deleted")
)

// vocab is what a line's records and signals call its terms.
type vocab struct {
	ask     string     // what queues: "campaign"
	holder  string     // whose key holds: "leader"
	term    string     // a term: "leadership"
	gained  string     // "leadership gained"
	resumed string     // "leadership resumed"
	onGain  SignalKind // emitted when a term starts
	onBack  SignalKind // emitted when a term resumes
	onEnd   SignalKind // emitted when a term ends
	gone    error      // why a term whose key was deleted ended
	lost    error      // what a term lost (not given up) wraps
}

var (
	electionWords = &vocab{ask: "campaign", holder: "leader", term: "leadership", gained: "leadership gained", resumed: "leadership resumed",
		onGain: SignalLeadershipGained, onBack: SignalLeadershipResumed, onEnd: SignalLeadershipLost, gone: errKeyDeleted, lost: ErrLeadershipLost}
	permitWords = &vocab{ask: "acquire", holder: "permit", term: "permit", gained: "permit acquired", resumed: "permit resumed",
		onGain: SignalPermitAcquired, onBack: SignalPermitResumed, onEnd: SignalPermitReleased, gone: errPermitKeyDeleted, lost: ErrPermitLost}
)

// candidacy is our place in a line: it puts our candidate key, waits
// until fewer than limit candidates are ahead of it, and holds; on
// failure it withdraws its key, and queues again, on a live session, for
// as long as its ctx lasts. What it gives up in etcd is settled in the
// background, in order: each key of a candidacy is that of the next on
// the same session. It is safe for concurrent use; its runs take turns
// (an Election's turn, or one Acquire per candidacy).
type candidacy struct {
	cli     *clientv3.Client
	key     string // the election's or semaphore's key
	prefix  string // key + "/": where candidates live
	suffix  string // follows our lease's hex in our candidate key
	limit   int64  // how many of the first candidates hold
	words   *vocab
	log     *slog.Logger
	signal  func(Signal)
	session func(context.Context) (*session, error) // the live session, started anew once one ended
	mark    *etcdMark                               // its owner's: the etcd of its puts and reads
	stepped *stepped                                // its owner's: terms whose keys a run may take back
	held    func(*leadership)                       // if set, told of a term before it is announced
	again   func(context.Context) error             // if set, asked before each queueing again: an error ends the run
	wg      *sync.WaitGroup                         // its owner's: counts the goroutines it starts

	mu sync.Mutex
	// unsettled is closed once what a candidacy given up left in etcd (its
	// put, or its key being withdrawn) is settled.
	unsettled <-chan struct{}
}

// run holds a place in the line as identity, queueing again after each
// candidacy lost, until ctx ends or an error retrying cannot pass.
// Without wait, it makes one try and returns nil, nil when limit
// candidates are ahead.
func (c *candidacy) run(ctx context.Context, identity string, wait bool) (*leadership, error) {
	defer c.stepped.begin()()
	var r retry
	for {
		l, err := c.try(ctx, identity, wait)
		if err == nil {
			return l, nil
		}
		if !wait || ctx.Err() != nil || fatal(ctx, c.cli, err) != nil || !sleep(ctx, r.next()) {
			return nil, err
		}
		if c.again != nil {
			if err := c.again(ctx); err != nil {
				return nil, err
			}
		}
		c.log.Info("coord: "+c.words.ask+" queues again", "err", err)
	}
}

// try runs one candidacy on the live session: it puts our key, waits for
// our turn (when wait is set) and takes the lead. It returns nil, nil
// when !wait and limit candidates are ahead. On error our key is
// withdrawn.
func (c *candidacy) try(ctx context.Context, identity string, wait bool) (*leadership, error) {
	s, err := c.session(ctx)
	if err != nil {
		return nil, err
	}
	// Nothing is put on a lease etcd does not answer for: it may have
	// expired, and the put would wait on an etcd that does not answer.
	if !s.valid() {
		c.log.Debug("coord: "+c.words.ask+" waits for its session's renewals to be answered", "lease", hexID(s.id))
	}
	if _, err := s.ready(ctx); err != nil {
		return nil, err
	}
	key, rev, hdr, back, err := c.candidate(ctx, s, identity)
	if err != nil {
		return nil, err
	}
	if hdr == 0 && wait {
		hdr, err = c.waitTurn(ctx, s, key, rev)
	}
	if err == nil && hdr != 0 {
		var l *leadership
		if l, err = c.takeLead(ctx, s, key, rev, hdr, identity, back); err == nil {
			return l, nil
		}
	}
	c.withdraw(ctx, s, key, rev)
	return nil, err
}

// candidate puts our candidate key, proclaiming identity, and returns it
// with its create revision, and the revision at which we hold if fewer
// than limit candidates are ahead of it (else 0): one round trip when
// uncontended. A key of our lease already there (left by a program
// sharing our lease, as etcd's concurrency package allows) is taken over
// in the same transaction. So is the key of a term of ours that stepped
// down on this session (see stepped): back reports that the put found it
// with the term's create revision, which it keeps.
//
// The put is not bound to ctx: a put given up may still land, after any
// delete sent meanwhile. When ctx ends first, it goes on in the
// background, bounded by the TTL, and its key is taken back once its
// fate is known (see unput). A put whose fate is unknown (its answer
// late past the TTL, as while etcd elects a leader, or lost) is sent
// again until etcd answers (see unanswered): the candidacy keeps its
// place, and the session the terms it shares.
func (c *candidacy) candidate(ctx context.Context, s *session, identity string) (key string, rev, hdr int64, back bool, _ error) {
	key = c.prefix + hexID(s.id) + c.suffix
	// A candidacy given up earlier is settled first (its put, or its
	// withdrawal): its key is this one, and its delete must not take the
	// key of this candidacy.
	if !within(ctx, c.settling()) {
		return "", 0, 0, false, ctx.Err()
	}
	var was int64 // the token of the term taken back
	if l := c.stepped.adopt(s); l != nil {
		key, was = l.key, l.rev
	}
	since := c.mark.at()
	res := c.put(s, key, identity, 0)
	var (
		p putResult
		r retry
	)
	for {
		select {
		case p = <-res:
		case <-ctx.Done():
			k := key // key, a result, is cleared by the return
			c.settle(func() { c.unput(s, k, identity, <-res) })
			return "", 0, 0, false, ctx.Err()
		}
		if !c.unanswered(s, p.err) {
			break
		}
		// If ctx ended meanwhile, this copy is the one unput settles.
		res = c.reput(s, key, identity, &r, p.err)
	}
	switch {
	case errors.Is(p.err, rpctypes.ErrLeaseNotFound):
		// The lease expired before the session noticed.
		s.end(fmt.Errorf("lease %x expired or revoked", int64(s.id)))
		return "", 0, 0, false, fmt.Errorf("%w: session ended: %w", ErrLeadershipLost, s.Err())
	case p.err != nil:
		// etcd refused it, or the session or the client ended.
		return "", 0, 0, false, fmt.Errorf("put candidate key: %w", p.err)
	}
	c.heard(p.resp.Header, since)
	rev = p.rev()
	// Our key is there: among the first limit candidates, or behind them.
	for _, kv := range p.resp.Responses[len(p.resp.Responses)-1].GetResponseRange().Kvs {
		if kv.CreateRevision == rev {
			hdr = p.resp.Header.Revision
		}
	}
	return key, rev, hdr, rev == was, nil
}

// heard takes in the header of a linearizable answer: an etcd that
// replaced the one of the owner's earlier answers (see etcdMark) is
// reported, by the first candidacy of the owner (an Election, a pool, a
// Semaphore) that hears it. Its tokens start over below the old ones.
func (c *candidacy) heard(h *etcdserverpb.ResponseHeader, since *markAt) {
	if err := c.mark.see(h, since); err != nil {
		c.log.Error("coord: etcd was replaced or restored: tokens start over", "err", err)
		emit(c.signal, Signal{Kind: SignalEtcdReplaced, Key: c.key, Err: err})
	}
}

// putResult is the outcome of a candidate put.
type putResult struct {
	resp *clientv3.TxnResponse
	err  error
}

// rev returns the create revision of the candidate key a put left.
func (p putResult) rev() int64 {
	if !p.resp.Succeeded {
		return p.resp.Responses[0].GetResponseRange().Kvs[0].CreateRevision
	}
	return p.resp.Header.Revision
}

// put sends our candidate put after a delay, bounded by the TTL and the
// session, and returns its outcome on a channel.
func (c *candidacy) put(s *session, key, identity string, after time.Duration) <-chan putResult {
	res := make(chan putResult, 1)
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		if after > 0 {
			sleep(s.ctx, after) // if the session ends, so does the put
		}
		defer s.sending(key)()
		ctx, cancel := context.WithTimeout(s.ctx, s.ttl)
		defer cancel()
		op := clientv3.OpPut(key, identity, clientv3.WithLease(s.id))
		first := clientv3.OpGet(c.prefix, top(c.limit, clientv3.SortAscend)...)
		resp, err := c.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(op, first).Else(clientv3.OpGet(key), op, first).Commit()
		res <- putResult{resp, err}
	}()
	return res
}

// unanswered reports whether a candidate put failed with err without
// etcd's answer (its TTL ran out, its answer was lost, etcd had no
// leader, the link was down), on a session that lives: it may have
// landed or not, and is sent again. The put is one transaction on one
// key of our lease, conditional on the key's absence, so its copies
// land once: the first that etcd applies puts the key, the others find
// it and keep its create revision. A copy given up lands, if ever, when
// etcd takes it in: in practice before a request sent after it is
// answered. One that etcd took in later still (held in a link that
// healed, after the key's delete) would put a key that nobody serves:
// the next candidacy of this key on the session takes it over (see
// candidate), else it goes with the session. Ending the session at once,
// as a revoke settles every copy, would end every term on it at each
// etcd leader change. A put etcd refused, or on an expired lease, is
// answered.
func (c *candidacy) unanswered(s *session, err error) bool {
	return err != nil && s.ctx.Err() == nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) &&
		fatal(context.Background(), c.cli, err) == nil
}

// top returns the options that read the first n candidates under a
// prefix (the last n, in descending order); for n = 1, those of etcd's
// WithFirstCreate and WithLastCreate.
func top(n int64, order clientv3.SortOrder) []clientv3.OpOption {
	return []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, order), clientv3.WithLimit(n)}
}

// reput sends again a put that err left unanswered, after r's next
// delay.
func (c *candidacy) reput(s *session, key, identity string, r *retry, err error) <-chan putResult {
	c.log.Info("coord: candidate put not answered, sending it again", "lease", hexID(s.id), "err", err)
	return c.put(s, key, identity, min(r.next(), s.ttl/10))
}

// unput takes back the key of a put that nobody waits for: a put whose
// fate is unknown is sent again until etcd answers (see unanswered), and
// the key it left is deleted, bounded by the TTL; if that delete fails,
// the session ends, its lease revoked as soon as etcd answers, and the
// key with it. A put etcd refused left nothing; one on a lease gone, or
// of a session that ended, leaves nothing once the lease is gone (the
// session learns it from its renewals).
func (c *candidacy) unput(s *session, key, identity string, p putResult) {
	var r retry
	for c.unanswered(s, p.err) {
		p = <-c.reput(s, key, identity, &r, p.err)
	}
	if p.err != nil {
		return
	}
	if err := c.deleteWithin(s, key, p.rev()); err != nil {
		c.log.Warn("coord: candidate key not taken back, ending session", "lease", hexID(s.id), "err", err)
		s.end(errors.New("candidate key not taken back"))
	}
}

// deleteWithin deletes our candidate key (see deleteRetrying), bounded by
// the TTL and the session.
func (c *candidacy) deleteWithin(s *session, key string, rev int64) error {
	ctx, cancel := context.WithTimeout(s.ctx, s.ttl)
	defer cancel()
	return c.deleteRetrying(ctx, s, key, rev)
}

// deleteRetrying deletes our candidate key (see deleteCandidate) within
// ctx, trying again after what fails for now (no leader, a timeout, a
// member unavailable): one such answer must not end a session that other
// terms share. Each try is bounded by a third of the TTL, so that one
// that hangs while etcd elects a leader does not use up the window, and
// the key goes as soon as etcd answers again.
func (c *candidacy) deleteRetrying(ctx context.Context, s *session, key string, rev int64) error {
	var r retry
	for {
		tctx, cancel := context.WithTimeout(ctx, s.ttl/3)
		err := c.deleteCandidate(tctx, key, rev)
		cancel()
		if err == nil || fatal(ctx, c.cli, err) != nil || !sleep(ctx, min(r.next(), s.ttl/10)) {
			return err
		}
		c.log.Debug("coord: candidate key not deleted, trying again", "lease", hexID(s.id), "err", err)
	}
}

// deleteCandidate deletes our candidate key if it is the one created at
// rev.
func (c *candidacy) deleteCandidate(ctx context.Context, key string, rev int64) error {
	_, err := c.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", rev)).
		Then(clientv3.OpDelete(key)).Commit()
	return err
}

// waitTurn waits until fewer than limit candidates created before rev
// remain, and returns the revision at which we hold. A watch that breaks
// without news is retried with backoff, not at once.
func (c *candidacy) waitTurn(ctx context.Context, s *session, key string, rev int64) (int64, error) {
	wctx, cancel := withCancelOn(ctx, s.ctx)
	defer cancel()
	var r retry
	for {
		hdr, news, err := c.look(wctx, s, key, rev)
		switch {
		case err != nil:
			return 0, err
		case hdr != 0:
			return hdr, nil
		case news:
			r = retry{}
		default:
			sleep(wctx, r.next())
		}
	}
}

// look reads the nearest limit+1 candidates ahead of our key (created at
// rev) and returns the revision at which we hold if fewer than limit are.
// Else it waits for a delete under the prefix (one ahead of us, or ours by
// someone else) and reports whether one came (news). When fewer than
// limit+1 come back, they are all of them, and since keys ahead only ever
// go (a key put again keeps its place, one created again is behind us),
// the deletes are enough to know when we hold, without reading again:
// the next in line holds on the event that frees its place.
//
// The watch is opened first, from etcd's current revision: etcd keeps
// such a watch up to date and sends it each delete as it is applied. One
// from the read's revision, opened after it, would wait for etcd's
// catch-up loop (up to 100 ms) whenever a write landed in between. Once
// etcd has registered it, the read comes after, so no delete after the
// read is missed. The watch may sit on a member that lags the one that
// answered the read (clientv3 keeps a client's watches on the member it
// first reached): it then starts before the read, and replays deletes the
// read already reflects, a delete of an earlier term of a key ahead among
// them (a session's candidate keys of successive terms share a name). So
// a delete counts only if it came after the read and took the very key
// the read showed (see waitDelete).
func (c *candidacy) look(ctx context.Context, s *session, key string, rev int64) (hdr int64, news bool, _ error) {
	deletes, stop := c.watchDeletes(ctx)
	defer stop()
	since := c.mark.at()
	resp, err := c.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", rev)).
		Then(clientv3.OpGet(c.prefix, append(top(c.limit+1, clientv3.SortDescend), clientv3.WithMaxCreateRev(rev-1))...)).
		Commit()
	switch {
	case s.ctx.Err() != nil:
		return 0, false, fmt.Errorf("%w: session ended: %w", ErrLeadershipLost, s.Err())
	case err != nil:
		return 0, false, fmt.Errorf("wait for our turn: %w", err)
	case !resp.Succeeded:
		return 0, false, fmt.Errorf("%w: our candidate key was deleted", ErrLeadershipLost)
	}
	c.heard(resp.Header, since)
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if int64(len(kvs)) < c.limit {
		return resp.Header.Revision, true, nil
	}
	c.log.Debug("coord: "+c.words.ask+" waits for its turn", "token", rev, "behind", string(kvs[0].Key))
	var ahead map[string]int64 // the keys ahead of ours, if we read them all (limit of them): their create revisions
	if int64(len(kvs)) == c.limit {
		ahead = map[string]int64{}
		for _, kv := range kvs {
			ahead[string(kv.Key)] = kv.CreateRevision
		}
	}
	hdr, news = waitDelete(ctx, deletes, key, resp.Header.Revision, ahead)
	return hdr, news, nil
}

// watchDeletes opens a watch of the deletes under the prefix from etcd's
// current revision on, each with the key it took, and returns it once
// etcd has registered it (or refused it, or ctx ended: the watch then
// ends without news), with the func that ends it. It requires a leader:
// a member cut off from its peers ends it, and the next goes elsewhere.
func (c *candidacy) watchDeletes(ctx context.Context) (clientv3.WatchChan, context.CancelFunc) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	wch := c.cli.Watch(ctx, c.prefix, clientv3.WithPrefix(), clientv3.WithFilterPut(), clientv3.WithPrevKV(), clientv3.WithCreatedNotify())
	// The first response says the watch is created; a refusal is its
	// last (the client closes the channel after it).
	select {
	case <-wch:
	case <-ctx.Done():
	}
	return wch, cancel
}

// waitDelete waits on deletes (see watchDeletes) for one that may give us
// our turn, and reports whether it saw one (false: the watch broke or ctx
// ended). Only deletes after read, the revision of the read that placed
// us, count. With ahead, the keys (and their create revisions) that are
// all those ahead of ours (key), it returns the revision of the first
// delete of one of them, from which on we hold, and goes on past deletes
// of keys behind ours; our key deleted is news too, and so is a delete of
// a key ahead whose term it cannot tell (read again). Every event of a
// revision comes in one response (etcd never splits a revision), so a
// range delete that frees our place and takes our key in one revision is
// seen whole: we never hold at a revision at which our key is gone.
func waitDelete(ctx context.Context, deletes clientv3.WatchChan, key string, read int64, ahead map[string]int64) (hdr int64, news bool) {
	for wr := range responses(ctx, deletes) {
		for _, ev := range wr.Events {
			k := string(ev.Kv.Key)
			if ev.Kv.ModRevision <= read || ahead != nil && ahead[k] == 0 && k != key {
				continue // known to the read already, or behind us
			}
			if k == key {
				return 0, true
			}
			news = true
			if hdr == 0 && ahead != nil && ahead[k] == ev.PrevKv.GetCreateRevision() {
				// limit were ahead: one fewer now. (A key ahead has a
				// create revision: a delete that comes without the
				// previous version, compacted away before etcd sent the
				// event, is news, not our turn.)
				hdr = ev.Kv.ModRevision
			}
		}
		if news {
			return hdr, true
		}
		// A response with an error (compacted, cancelled, no leader) is
		// the watch's last: the client closes the channel after it.
	}
	return 0, false
}

// takeLead makes us hold with our key at rev, from revision hdr on (back:
// again, see stepped). A session granted late is renewed first: we never
// hold on a lease we cannot vouch for, and a term is never lost for want
// of a renewal that was not tried. The term steps down when the session's
// renewals go unanswered (its up context ends), before etcd can expire
// the lease and let another hold.
func (c *candidacy) takeLead(ctx context.Context, s *session, key string, rev, hdr int64, identity string, back bool) (*leadership, error) {
	up, err := s.ready(ctx)
	if err != nil {
		return nil, err
	}
	lctx, end := context.WithCancelCause(s.ctx)
	// up ends with errUnanswered, or with the session's cause once it has
	// ended (its keeper stops then, maybe before l.ctx hears of it).
	stopDown := context.AfterFunc(up, func() { end(context.Cause(up)) })
	l := &leadership{key: key, rev: rev, at: hdr, identity: identity, lost: c.words.lost, sess: s, up: up, ctx: lctx, cancel: end}
	c.stepped.track(l)
	if c.held != nil {
		c.held(l)
	}
	c.wg.Add(1)
	go c.monitor(l, hdr, stopDown)
	what, kind := c.words.gained, c.words.onGain
	if back {
		what, kind = c.words.resumed, c.words.onBack
	}
	c.log.Info("coord: "+what, "token", rev, "identity", identity)
	emit(c.signal, Signal{Kind: kind, Key: c.key, Identity: identity, Token: rev})
	return l, nil
}

// withdraw deletes our candidate key, created at rev, within ctx. What
// etcd cannot be told within ctx is retried in the background, bounded by
// the TTL; if that fails too, the session ends, and its lease, with the
// key, is revoked as soon as etcd answers. A session that ended already
// takes the key with its lease.
func (c *candidacy) withdraw(ctx context.Context, s *session, key string, rev int64) {
	if s.ctx.Err() != nil || c.deleteRetrying(ctx, s, key, rev) == nil {
		return
	}
	c.settle(func() {
		if err := c.deleteWithin(s, key, rev); err != nil {
			c.log.Warn("coord: cannot withdraw candidate, ending session", "lease", hexID(s.id), "err", err)
			s.end(errors.New("candidate could not be withdrawn"))
		}
	})
}

// settle runs f, what settles a candidacy or a term given up (its put, or
// its key being withdrawn or deleted), in the background. The next
// candidacy waits for it (see candidate), and for those settling before
// it: the key of each is the key of the next on the same session. It
// returns a channel closed once all of them are settled. Called with the
// turn held, or by a call its owner's Close waits for.
func (c *candidacy) settle(f func()) <-chan struct{} {
	settled := make(chan struct{})
	c.mu.Lock()
	before := c.unsettled
	c.unsettled = settled
	c.mu.Unlock()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(settled)
		f()
		<-before
	}()
	return settled
}

// settling returns the channel closed once what candidacies given up
// left in etcd is settled.
func (c *candidacy) settling() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.unsettled
}

// release ends term l with cause why and deletes its key (on a verb:
// "resign"), in the background: the returned channel is closed once that
// is settled, and *err is then set. Should the delete fail, the session
// ends, so that the key goes with its lease as soon as etcd answers.
func (c *candidacy) release(l *leadership, why error, verb string, err *error) <-chan struct{} {
	l.cancel(why)
	return c.settle(func() {
		if *err = c.deleteWithin(l.sess, l.key, l.rev); *err != nil {
			c.log.Warn("coord: "+c.words.holder+" key not deleted on "+verb+", ending session", "token", l.rev, "err", *err)
			l.sess.end(fmt.Errorf("%s key could not be deleted on %s", c.words.holder, verb))
		}
	})
}

// monitor ends term l when its key is deleted or written off our lease;
// the session's end, Resign, Release and Close end it through l.ctx.
func (c *candidacy) monitor(l *leadership, rev int64, stopDown func() bool) {
	defer c.wg.Done()
	// Emitted once l.ctx has ended: its cause is why. A term that stepped
	// down leaves its key to a run that may take it back (see stepped);
	// any other is over with its key.
	defer func() {
		stopDown()
		emit(c.signal, Signal{Kind: c.words.onEnd, Key: c.key, Identity: l.identity, Token: l.rev, Err: termErr(l, false)})
		if errors.Is(context.Cause(l.ctx), errUnanswered) {
			c.wg.Add(1)
			go func() {
				defer c.wg.Done()
				c.stepped.settle(c, l)
			}()
		} else {
			c.stepped.untrack(l)
		}
	}()
	wch := c.cli.Watch(clientv3.WithRequireLeader(l.ctx), l.key, clientv3.WithRev(rev+1))
	var r retry
	for {
		select {
		case <-l.ctx.Done():
			c.log.Info("coord: "+c.words.term+" ended", "token", l.rev, "err", context.Cause(l.ctx))
			return
		case wr, ok := <-wch:
			if len(wr.Events) > 0 {
				r = retry{}
			}
			err := c.checkEvents(l, wr.Events)
			if err == nil && (!ok || wr.Err() != nil) {
				sleep(l.ctx, r.next())
				if rev, err = c.rewatch(l, rev, wr.Err()); err == nil {
					wch = c.cli.Watch(clientv3.WithRequireLeader(l.ctx), l.key, clientv3.WithRev(rev+1))
				}
			}
			if err != nil {
				l.cancel(err)
				c.log.Info("coord: "+c.words.term+" ended", "token", l.rev, "err", context.Cause(l.ctx))
				return
			}
		}
	}
}

// checkEvents says whether events of l's key end l: deleted (ours, by
// Resign or Release, or someone else's), or written off our lease.
func (c *candidacy) checkEvents(l *leadership, evs []*clientv3.Event) error {
	for _, ev := range evs {
		if ev.Type == mvccpb.DELETE {
			return c.words.gone
		}
		if ev.Kv.Lease != int64(l.sess.id) {
			c.log.Warn("coord: "+c.words.holder+" key written off our lease, stepping down", "token", l.rev, "lease", hexID(clientv3.LeaseID(ev.Kv.Lease)))
			c.dropKey(l)
			return errors.New(c.words.holder + " key written off our lease")
		}
	}
	return nil
}

// rewatch reads l's key after its watch broke, and returns the revision
// to watch on from, or why l is over. If etcd will not let us read
// (client closed, permission denied), we can no longer tell that we hold:
// we step down rather than spin, and end the session so that the key
// goes with its lease.
func (c *candidacy) rewatch(l *leadership, rev int64, werr error) (int64, error) {
	ferr := fatal(l.ctx, c.cli, werr)
	var (
		g   *clientv3.GetResponse
		err error
	)
	if ferr == nil {
		g, err = c.cli.Get(l.ctx, l.key)
		ferr = fatal(l.ctx, c.cli, err)
	}
	if ferr != nil {
		if l.ctx.Err() == nil {
			c.log.Warn("coord: cannot watch "+c.words.holder+" key, "+c.words.term+" ended", "token", l.rev, "err", ferr)
			l.sess.end(ferr)
		}
		return 0, ferr
	}
	// A read that failed for now (no leader, say): watch on from where we
	// were.
	if err == nil {
		if len(g.Kvs) == 0 || g.Kvs[0].CreateRevision != l.rev || g.Kvs[0].Lease != int64(l.sess.id) {
			// Gone, or no longer ours: step down, and take back a key of
			// this term that now outlives our session.
			c.log.Warn("coord: "+c.words.holder+" key gone or no longer ours, "+c.words.term+" lost", "token", l.rev)
			c.dropKey(l)
			return 0, errors.New(c.words.holder + " key gone or no longer ours")
		}
		rev = g.Header.Revision
	}
	c.log.Debug("coord: "+c.words.holder+" watch broke, watching on", "token", l.rev, "rev", rev, "werr", werr, "err", err)
	return rev, nil
}

// dropKey deletes the key of term l if it is still that of l: written
// off our session's lease, it would outlive the session, and no candidate
// could ever hold again. Failure is only logged.
func (c *candidacy) dropKey(l *leadership) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(l.ctx), l.sess.ttl)
	defer cancel()
	_, err := c.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(l.key), "=", l.rev)).
		Then(clientv3.OpDelete(l.key)).Commit()
	c.log.Debug("coord: "+c.words.holder+" key taken back", "token", l.rev, "err", err)
}

// termErr says why term l ended, judged at the call (as live): nil while
// it holds; ErrLeadershipLost (ErrPermitLost for a permit) wrapping the
// cause when it was lost, else the known cause itself (resigned,
// released, closed, client closed).
func termErr(l *leadership, live bool) error {
	if l == nil || live {
		return nil
	}
	cause := errUnanswered // judged at the call, before the timer said so
	if l.ctx.Err() != nil {
		cause = context.Cause(l.ctx)
	}
	for _, known := range []error{ErrResigned, ErrReleased, ErrClosed, ErrClientClosed} {
		if errors.Is(cause, known) {
			return cause
		}
	}
	return fmt.Errorf("%w: %w", l.lost, cause)
}

// explain explains an error met by a call on key of an object whose life
// is life: ErrClosed if Close cut it short, ErrClientClosed once the
// client is closed, else what was being done, wrapping err (and the end
// of ctx).
func explain(ctx, life context.Context, cli *clientv3.Client, what, key string, err error) error {
	switch {
	case life.Err() != nil:
		err = ErrClosed
	case cli.Ctx().Err() != nil:
		err = ErrClientClosed
	case ctx.Err() != nil && !errors.Is(err, ctx.Err()):
		err = fmt.Errorf("%w (%w)", ctx.Err(), err)
	}
	return opErr(fmt.Sprintf("%s %q", what, key), err)
}
